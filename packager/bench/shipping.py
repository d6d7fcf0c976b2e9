"""Shipping a bundle at size: `pkg image build --push`, `pkg image push` and `pkg push`, each timed, the peak RSS of
its process tree sampled from outside, against the build's memory bound (issue 48: they stream a multi-GB bundle).

A docker-registry on 127.0.0.1 (local_registry.py) receives the image, twice: `pkg image build --push`, then
`pkg image push` of the same layout to a second repository (the registry has none of its blobs there, so every
byte goes again). An edge agent (`python -m runtime agent`) on 127.0.0.1 receives `pkg push` and installs the bundle
as a device would: digest, unpack, verify, load and a smoke request. The image is built in a cache of its own that
shares only the runtime's base layers, so the bundle's layer is written by the command measured. What those
commands leave beside the bundle (the image layout, the Docker context, the push's archive: gigabytes each) and
the registry and agent folders are removed afterwards.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from packager.bench import report
from packager.bench.local_registry import run_registry
from packager.memory import run_sampled
from packager.paths import build_dir, bundle_dir, cache_root
from packager.spec import FunctionSpec
from packager.targets.local.server_process import free_port

BASE_LAYERS = ("image-os", "image-deps", "image-debs")  # cache kinds of the runtime's base layers, shared
TOKEN = "bench-agent-token"
AGENT_START_TIMEOUT = 60.0
MIB = 1 << 20
INSTALL_PHASES = ("digest", "unpack", "verify", "commit", "load_and_smoke", "switch")  # the agent's order


def measure_shipping(repo: Path, spec: FunctionSpec, bundle: Path, bound: float, threads: int) -> dict[str, Any]:
    """The three commands on `spec`'s bundle, run from `repo` as a user runs them; each one's figures."""
    if bundle.resolve() != (repo / bundle_dir(spec)).resolve():
        return {"skipped": f"the bundle was given with --bundle ({bundle}): pkg ships {bundle_dir(spec)} only"}
    size = sum(path.stat().st_size for path in bundle.iterdir() if path.is_file())
    commands: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-ship-", dir=repo / build_dir(spec)) as scratch_dir:
        scratch = Path(scratch_dir)
        env = {**os.environ, "ONNXFN_CACHE_DIR": str(image_cache(scratch / "cache")), "ONNXFN_EDGE_TOKEN": TOKEN}
        function = str(spec.directory)
        try:
            with run_registry(scratch / "registry") as registry:
                image = f"{registry.address}/onnxfn/{spec.name}"
                commands.append(_run(repo, env, scratch, ["image", "build", function, "--push", image]))
                commands.append(_run(repo, env, scratch, ["image", "push", function, f"{image}-copy"]))
            with _Agent(repo, scratch, threads) as device:
                commands.append(_run(repo, env, scratch, ["push", function, "--device", device]))
                history = _agent_status(device).get("history", [])
        finally:
            for leftover in ("image", "image-work", "docker", "edge"):
                shutil.rmtree(repo / build_dir(spec) / leftover, ignore_errors=True)
    return {"bundle_bytes": size, "bound_bytes": bound, "commands": commands, "install": history[-1:]}


def image_cache(cache: Path) -> Path:
    """A cache that shares the user's runtime base layers (built once per machine) and nothing else."""
    cache.mkdir()
    for kind in BASE_LAYERS:
        if (cache_root() / kind).is_dir():
            (cache / kind).symlink_to((cache_root() / kind).resolve(), target_is_directory=True)
    return cache


def _run(repo: Path, env: dict[str, str], scratch: Path, argv: list[str]) -> dict[str, Any]:
    name = "pkg " + " ".join(argv[:2] if argv[0] == "image" else argv[:1])
    print(f"bench: {name}", flush=True)
    log_path = scratch / f"{name.replace(' ', '-')}.log"
    with log_path.open("w+") as log:
        run = run_sampled([sys.executable, "-m", "packager.cli", *argv], cwd=repo, env=env, stdout=log)
        log.seek(0)
        output = log.read()
    entry: dict[str, Any] = {"command": name, "seconds": run.seconds, "peak_rss_bytes": run.peak_rss}
    if run.returncode != 0:  # the CLI's message starts at "error:"; before it, progress bars and tables
        message = output[output.rfind("error:") :] if "error:" in output else output[-600:]
        entry["error"] = f"exit {run.returncode}: {' '.join(message.split())[:600]}"
    return entry


class _Agent:
    """`python -m runtime agent` on a free 127.0.0.1 port with its own bundle root, for the length of a `with`."""

    def __init__(self, repo: Path, scratch: Path, threads: int) -> None:
        self.repo, self.scratch, self.threads = repo, scratch, threads
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> str:
        token = self.scratch / "agent-token"
        token.write_text(TOKEN)
        port = free_port("127.0.0.1")
        command = [
            sys.executable, "-m", "runtime", "agent", "--bundle-root", str(self.scratch / "agent"),
            "--token-file", str(token), "--host", "127.0.0.1", "--port", str(port),
            # One slot holding the whole context (an 8B model's fp32 KV is 256 KiB a token): its smoke request fits.
            "--max-batch", "1", "--kv-memory-mb", "256", "--threads", str(self.threads), "--log-level", "warning",
        ]  # fmt: skip
        with (self.scratch / "agent.log").open("wb") as log:
            self.process = subprocess.Popen(command, cwd=self.repo, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + AGENT_START_TIMEOUT
        while True:
            try:
                _agent_status(url)
                return url
            except httpx.TransportError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.__exit__()
                    log_text = (self.scratch / "agent.log").read_text(errors="replace")[-1500:]
                    raise RuntimeError(f"the edge agent did not start: {log_text}") from None
                time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=60)


def _agent_status(url: str) -> dict[str, Any]:
    response = httpx.get(f"{url}/agent/status", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    response.raise_for_status()
    return response.json()


def target_row(shipping: dict[str, Any]) -> list[str]:
    """The targets table's row: the largest peak of the three commands against the build's bound."""
    label = "image build, image push, pkg push: peak RSS of the process tree / bound"
    measured = [c for c in shipping.get("commands", []) if "error" not in c]
    if not measured:
        reason = shipping.get("skipped") or "; ".join(c["error"] for c in shipping.get("commands", [])) or "not run"
        return [label, "<= 1.00", "-", "-", "not measured", reason[:300]]
    peak, bound = max(c["peak_rss_bytes"] for c in measured), shipping["bound_bytes"]
    shown = f"{peak / MIB:,.0f} MiB of {bound / 1e9:.2f} GB"
    note = ", ".join(f"{c['command']} {c['peak_rss_bytes'] / MIB:,.0f} MiB" for c in measured)
    note += f"; the bundle is {shipping['bundle_bytes'] / 1e6:,.0f} MB"
    verdict = "met" if peak <= bound and len(measured) == len(shipping["commands"]) else "**missed**"
    return [label, "<= 1.00", shown, "-", verdict, note]


def render(results: dict[str, Any]) -> str:
    shipping = results["shipping"]
    if "skipped" in shipping:
        return f"## Shipping the bundle\n\nNot run: {shipping['skipped']}.\n"
    size = shipping["bundle_bytes"]
    rows = []
    for command in shipping["commands"]:
        if "error" in command:
            rows.append([command["command"], "-", "-", "-", command["error"][:300]])
            continue
        seconds = command["seconds"]
        rows.append([
            command["command"], report.fmt(seconds), report.fmt(command["peak_rss_bytes"] / MIB, 0),
            report.fmt(size / 1e6 / seconds, 0), "",
        ])  # fmt: skip
    install = ""
    phases = shipping["install"][-1].get("phases", {}) if shipping.get("install") else {}
    if phases:  # a refused install has none
        ordered = sorted(phases, key=lambda k: INSTALL_PHASES.index(k) if k in INSTALL_PHASES else len(INSTALL_PHASES))
        install = " The agent's install: " + ", ".join(f"{k} {phases[k]:.1f} s" for k in ordered) + "."
    note = (
        f"The {size / 1e6:,.0f} MB bundle through the commands a user ships it with, run from the checkout as their "
        "own processes, each process tree's resident memory sampled every 50 ms (as the build's is), against the "
        f"build's bound ({shipping['bound_bytes'] / 1e9:.2f} GB). Registry: Debian's docker-registry on 127.0.0.1; "
        "`pkg image push` sends the same layout to a second repository (every blob again). Device: the edge agent on "
        f"127.0.0.1 (upload, then digest, unpack, verify, load and a smoke request).{install} MB/s is the bundle's "
        "size over the command's time.\n\n"
    )
    header = ["command", "seconds", "peak RSS MiB", "bundle MB/s", "error"]
    return (
        "## Shipping the bundle (`pkg image build --push`, `pkg image push`, `pkg push`)\n\n"
        + note
        + report.table(header, rows)
    )
