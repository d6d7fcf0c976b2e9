"""Prepacked graphs: copies of a bundle's graphs whose weights ONNX Runtime has already packed for this CPU.

At session creation ONNX Runtime repacks every matmul weight into its kernel's layout (MLAS), in
anonymous memory: 470 MB for the demo's fp32 prefill graph, 170 MB for its int8 graph. With
`session.save_external_prepacked_constant_initializers` it writes those packed weights into the external
data file of a saved copy, and a session on that copy memory-maps them instead. Measured here: the
demo's prepacked weights leave the heap (anonymous memory 480 -> 30 MB for the prefill graph), live in the
page cache shared by every server on the machine, and a process snapshot leaves them out, since CRIU
dumps no clean file-backed pages. Decode and prefill run as fast as from packed heap memory. They save
memory, not start-up time: ONNX Runtime 1.31 still runs its prepacking step on a copy (a session build takes
1.1 s either way for Llama-3.2-1B's shape, 0.93 s of it prepacking on the copy, by its verbose log's times).

The packed layout depends on the CPU's instruction sets and on the ONNX Runtime build, so a copy is used
only on a machine with the same CPU flags, the same ONNX Runtime version, for the same bundle, and with its
files as they were written (the identity `runtime.verified` trusts: size, inode, mtime); anything else falls
back to the bundle's graph, with the reason logged. The copies live outside the bundle (its manifest lists
every file it holds): the `local` target writes them under `build/NAME/local/prepacked/`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import shutil
from dataclasses import dataclass
from pathlib import Path

from runtime.bundle import Bundle
from runtime.verified import file_identity

META_FILE = "prepacked.json"
FORMAT = 1
log = logging.getLogger("runtime.engine")


def data_file(graph: Path) -> Path:
    return graph.with_name(graph.name + ".data")


def machine_key() -> dict[str, str]:
    """What the packed layout depends on besides the graph: the ONNX Runtime version and the CPU's features."""
    import onnxruntime as ort

    return {"onnxruntime": ort.__version__, "cpu": _cpu_digest()}


def _cpu_digest() -> str:
    """The CPU model and instruction-set flags (as the kernel reports them), hashed."""
    described = f"{platform.machine()}\n"
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        described += platform.processor()
    else:
        wanted = ("model name", "flags", "Features", "CPU implementer", "CPU part")
        for line in cpuinfo.split("\n\n")[0].splitlines():  # the first processor's block
            if line.split(":")[0].strip() in wanted:
                described += line.strip() + "\n"
    return hashlib.sha256(described.encode()).hexdigest()


def _identities(graph: Path) -> dict[str, list[int]]:
    """The identities of a graph file and of its data file, by name."""
    return {graph.name: file_identity(graph), data_file(graph).name: file_identity(data_file(graph))}


@dataclass(frozen=True)
class PrepackedGraphs:
    """A directory of prepacked copies of one bundle's graphs, and the record that says where they are valid."""

    directory: Path

    def graph_for(self, bundle: Bundle, graph: Path) -> Path:
        """The prepacked copy of the bundle's `graph` when it is valid here, else `graph` (the reason is logged)."""
        problem = self.problem(bundle, graph.name)
        if problem is None:
            return self.directory / graph.name
        log.warning("prepacked graphs: using the bundle's %s (%s)", graph.name, problem)
        return graph

    def problem(self, bundle: Bundle, name: str) -> str | None:
        """Why the copy of graph `name` cannot be used for `bundle` on this machine; None when it can."""
        try:
            meta = json.loads((self.directory / META_FILE).read_text())
        except FileNotFoundError:
            return f"{self.directory / META_FILE} does not exist"
        except (OSError, ValueError) as exc:
            return f"{self.directory / META_FILE} is unreadable ({exc})"
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            return f"{self.directory / META_FILE} has another format"
        if meta.get("bundle_digest") != bundle.manifest.digest:
            return "they were written for another bundle"
        key = machine_key()
        if meta.get("onnxruntime") != key["onnxruntime"]:
            return f"they were written by onnxruntime {meta.get('onnxruntime')}, this is {key['onnxruntime']}"
        if meta.get("cpu") != key["cpu"]:
            return "they were written on a CPU with other features"
        recorded = meta.get("files", {}).get(name)
        if recorded is None:
            return f"they hold no {name}"
        copy = self.directory / name
        try:
            current = _identities(copy)
        except OSError as exc:
            return f"{exc.filename} is missing"
        if current != recorded:
            return f"{name} or its data changed since they were written"
        return None

    def digest(self) -> str:
        """A digest of the record (it changes whenever the copies are rewritten); empty when there is none."""
        try:
            return hashlib.sha256((self.directory / META_FILE).read_bytes()).hexdigest()
        except OSError:
            return ""

    def write(self, bundle: Bundle, graphs: list[Path], threads: int) -> None:
        """Write prepacked copies of `graphs` (files of `bundle`) and their record, replacing any earlier ones.

        A half-written directory is never left under the final name: the copies are written beside it first.
        """
        partial = self.directory.with_name(self.directory.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        try:
            self._write_into(partial, bundle, graphs, threads)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)  # gigabytes, of no use half written
            raise
        shutil.rmtree(self.directory, ignore_errors=True)
        partial.replace(self.directory)

    @staticmethod
    def _write_into(partial: Path, bundle: Bundle, graphs: list[Path], threads: int) -> None:
        import onnxruntime as ort

        from runtime.engine.tables import inference_session

        files: dict[str, dict[str, list[int]]] = {}
        for graph in graphs:
            target = partial / graph.name
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            options.log_severity_level = 3  # not the warning that the saved graph suits this machine only: it is why
            options.optimized_model_filepath = str(target)
            options.add_session_config_entry("session.prepack.enable_parallel", "1")
            options.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
            options.add_session_config_entry(
                "session.optimized_model_external_initializers_file_name", data_file(target).name
            )
            options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
            inference_session(graph, options, ["CPUExecutionProvider"], bundle)
            files[graph.name] = _identities(target)
        meta = {"format": FORMAT, "bundle_digest": bundle.manifest.digest, **machine_key(), "files": files}
        (partial / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
