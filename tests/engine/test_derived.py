"""Derived graphs (runtime/engine/derived.py): a quantized bundle's fp32 prefill weights, written where they run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from packager.export.prefill import PREFILL_DATA_FILE
from runtime.bundle import Bundle, BundleError, Manifest
from runtime.engine.derived import RECORD, DerivedGraphs
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.graphs import PREFILL_MODEL_FILE
from runtime.engine.request import GenerationRequest, SamplingParams

pytestmark = pytest.mark.real_model


def test_the_weights_are_written_once_and_again_only_when_they_changed(bundle: Bundle, tmp_path: Path) -> None:
    derived = DerivedGraphs(tmp_path / "derived")
    assert derived.problem(bundle, PREFILL_MODEL_FILE) == "none was written yet"
    graph = derived.graph(bundle, PREFILL_MODEL_FILE)
    data = graph.with_name(PREFILL_DATA_FILE)
    recipe = json.loads(bundle.file(PREFILL_MODEL_FILE + ".derive.json").read_text())
    assert data.stat().st_size == recipe["size"] > bundle.manifest.files["model.onnx.data"].size
    assert derived.problem(bundle, PREFILL_MODEL_FILE) is None
    written = data.stat().st_mtime_ns
    assert derived.graph(bundle, PREFILL_MODEL_FILE) == graph and data.stat().st_mtime_ns == written  # reused

    with data.open("r+b") as f:  # altered after it was written: derived again
        f.write(b"\xff" * 16)
    assert derived.problem(bundle, PREFILL_MODEL_FILE) == "its files changed since they were written"
    derived.graph(bundle, PREFILL_MODEL_FILE)
    assert derived.problem(bundle, PREFILL_MODEL_FILE) is None

    other = Bundle(bundle.path, Manifest(**{**bundle.manifest.__dict__, "build_key": "another build"}))
    assert derived.problem(other, PREFILL_MODEL_FILE) == "it was written for another bundle"
    assert json.loads((tmp_path / "derived" / RECORD).read_text())["bundle_digest"] == bundle.manifest.digest


def test_an_interrupted_derivation_leaves_no_record(
    bundle: Bundle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import runtime.engine.derived as derived_module

    def fail(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(derived_module, "write_data", fail)
    derived = DerivedGraphs(tmp_path / "derived")
    with pytest.raises(OSError, match="No space"):
        derived.graph(bundle, PREFILL_MODEL_FILE)
    assert derived.problem(bundle, PREFILL_MODEL_FILE) == "none was written yet"
    assert not list((tmp_path / "derived").glob("*.partial"))


def test_an_engine_whose_derived_weights_cannot_be_written_serves_prompts_through_the_decode_graph(
    bundle: Bundle, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A full disk or a read-only folder costs the fp32 prefill graph, not the server (built in the background)."""

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    config = EngineConfig(
        max_batch=1, max_context=128, prefill_matmuls="fp32", defer_prefill_graph=True, derived=blocker / "derived"
    )
    engine = Engine(bundle, config)
    try:
        engine.wait_for_prefill_graph()
        assert engine.prefill_graph == "decode graph"
        assert "the prefill graph failed to load" in caplog.text
        request = GenerationRequest("fallback", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert len(engine.generate(request)[0].token_ids) == 4
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("tamper", "refusal"),
    [
        (lambda r: r["tensors"][0]["copy"].update(file="../../../../etc/passwd"), "is not part of the bundle"),
        (lambda r: r["tensors"][0]["copy"].update(offset=1 << 40), "reads past the end of model.onnx.data"),
        (lambda r: r["tensors"][-1].update(offset=r["size"]), "writes past the size it declares"),
    ],
    ids=["outside the bundle", "past a file's end", "past the declared size"],
)
def test_a_recipe_that_reads_or_writes_outside_its_bounds_is_refused(
    bundle: Bundle, tmp_path: Path, tamper: object, refusal: str
) -> None:
    """The recipe steers reads and writes: a tampered one (a pushed bundle whose manifest was rewritten too) must
    not read other files or write more than it declares."""
    recipe_file = PREFILL_MODEL_FILE + ".derive.json"
    copy = tmp_path / "bundle"
    copy.mkdir()
    for entry in bundle.path.iterdir():
        if entry.name != recipe_file:
            (copy / entry.name).symlink_to(entry)
    recipe = json.loads(bundle.file(recipe_file).read_text())
    tamper(recipe)  # type: ignore[operator]
    (copy / recipe_file).write_text(json.dumps(recipe))
    derived = DerivedGraphs(tmp_path / "derived")
    with pytest.raises(BundleError, match=refusal):
        derived.graph(Bundle(copy, bundle.manifest), PREFILL_MODEL_FILE)
    assert derived.problem(bundle, PREFILL_MODEL_FILE) == "none was written yet"


_PEAK_OF_WRITE_DATA = """
import json, sys, tempfile
from pathlib import Path
from runtime.bundle import open_bundle
from runtime.engine.recipes import write_data
from runtime.engine.tables import bundle_files, has_tables, tables_path

def status(key):  # VmHWM, not ru_maxrss: that one keeps the forking parent's peak across exec
    return int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith(key))) * 1024

bundle = open_bundle(Path(sys.argv[1]))
recipe = json.loads(bundle.file(sys.argv[2]).read_text())
if has_tables(bundle):
    tables_path(bundle)  # the scale tables the recipe reads, expanded first (tests/engine/test_tables.py measures it)
before = status("VmRSS:")
with tempfile.TemporaryDirectory() as folder:
    write_data(recipe, bundle_files(bundle), Path(folder) / "weights", sys.argv[2])
print(json.dumps({"size": recipe["size"], "growth": status("VmHWM:") - before}))
"""


def test_the_weights_are_derived_one_tensor_at_a_time_in_bounded_memory(bundle: Bundle) -> None:
    """The process holds one weight and its sources, not the copy nor the bundle's files: deriving the demo's
    0.43 GiB of fp32 weights raised the peak RSS by 27 MiB (through a mapping of the whole source file, whose
    pages stayed resident, by 130 MiB)."""
    recipe_file = PREFILL_MODEL_FILE + ".derive.json"
    if recipe_file not in bundle.manifest.files:
        pytest.skip("the test bundle ships its fp32 prefill weights")
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_OF_WRITE_DATA, str(bundle.path), recipe_file],
        capture_output=True,
        text=True,
        check=True,
    )
    measured = json.loads(out.stdout)
    source = bundle.manifest.files["model.onnx.data"].size
    print(f"\nderived {measured['size'] / 2**20:.0f} MiB, peak RSS +{measured['growth'] / 2**20:.0f} MiB")
    assert measured["growth"] < min(measured["size"] / 8, source / 2), measured


def test_no_room_for_the_derived_weights_is_refused_before_a_byte_is_written(bundle: Bundle, tmp_path: Path) -> None:
    """A file system too small for the fp32 copy fails at once, naming both sizes, not gigabytes into the write."""
    if PREFILL_MODEL_FILE + ".derive.json" not in bundle.manifest.files:
        pytest.skip("the test bundle ships its fp32 prefill weights")
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(small)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        derived = DerivedGraphs(small / "derived")
        with pytest.raises(OSError, match=r"deriving 0\.\d\d GiB of fp32 prefill weights needs that much space in "):
            derived.graph(bundle, PREFILL_MODEL_FILE)
        assert derived.problem(bundle, PREFILL_MODEL_FILE) == "none was written yet"
        assert list((small / "derived").iterdir()) == []
    finally:
        subprocess.run(["umount", str(small)], check=True)
