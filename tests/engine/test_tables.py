"""Scale tables (runtime/engine/tables.py): a GGUF bundle ships its scales and residuals as the file's own factors,
and they are expanded once where it runs, bit for bit what the packager verified, handed to ONNX Runtime over a map
whose pages go once the session is built."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from packager.bundle import check_tables
from packager.errors import UserError
from runtime.bundle import Bundle, BundleError, open_bundle
from runtime.engine.tables import (
    TABLES_FILE,
    TABLES_RECIPE,
    graph_tables,
    inference_session,
    tables_path,
    write_tables_beside,
)
from runtime.verified import file_identity

pytestmark = pytest.mark.real_model


@pytest.fixture
def own_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A state directory of the test's own: its tables file is no other test's (or server's) to share."""
    state = tmp_path / "state"
    monkeypatch.setenv("ONNXFN_STATE_DIR", str(state))
    return state


def _recipe(bundle: Bundle) -> dict:
    return json.loads(bundle.file(TABLES_RECIPE).read_text())


def _factor_bytes(recipe: dict) -> int:
    """The bytes of the factors the recipe reads (each once), zero points excepted: those the graph uses as well."""
    seen: dict[tuple[str, int], int] = {}

    def visit(spec: dict) -> None:
        for key in ("super", "sub"):
            ref = spec.get(key)
            if ref is not None and "file" in ref:
                size = int(np.prod(ref["shape"])) * np.dtype(ref["dtype"]).itemsize
                seen[(ref["file"], int(ref["offset"]))] = size

    for tensor in recipe["tensors"]:
        visit(tensor["table"]["scales"])
        if "minimum" in tensor["table"]:
            visit(tensor["table"]["minimum"])
    return sum(seen.values())


def test_the_demo_bundle_ships_the_ggufs_factors_instead_of_float32_tables(bundle: Bundle) -> None:
    recipe = _recipe(bundle)
    assert bundle.manifest.table_bytes == recipe["size"] > 0
    assert TABLES_FILE not in bundle.manifest.files and not (bundle.path / TABLES_FILE).exists()
    model = onnx.load(str(bundle.model_path), load_external_data=False)
    in_tables = {t.name for t in model.graph.initializer if any(e.value == TABLES_FILE for e in t.external_data)}
    matmuls = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert matmuls and all(n.input[2] in in_tables for n in matmuls)  # every matmul's scales
    # Q4_1: a float16 scale and minimum per block of 32 stand for two float32 tables (scales, residual).
    assert _factor_bytes(recipe) * 1.95 < recipe["size"]


def test_the_tables_are_expanded_once_and_are_what_the_packager_verified(bundle: Bundle, own_state: Path) -> None:
    path = tables_path(bundle)
    assert own_state in path.parents
    assert hashlib.sha256(path.read_bytes()).hexdigest() == _recipe(bundle)["sha256"]
    identity = file_identity(path)
    assert tables_path(bundle) == path and file_identity(path) == identity  # not written again

    with path.open("r+b") as f:  # a changed file is noticed and written again
        f.seek(len(path.read_bytes()) // 2)
        f.write(b"\x7f\x7f\x7f\x7f")
    tables_path(bundle)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == _recipe(bundle)["sha256"]


def _tampered_copy(bundle: Bundle, directory: Path, change: str) -> Path:
    """A copy of the bundle with one scale factor of its first table changed (`factor`), or its recipe's digest."""
    copy = directory / "bundle"
    shutil.copytree(bundle.path, copy)
    recipe = _recipe(bundle)
    if change == "factor":
        ref = recipe["tensors"][0]["table"]["scales"]["super"]
        data = copy / ref["file"]
        data.unlink()  # the copy's data file may be a hard link of the cache's: never write through it
        shutil.copyfile(bundle.path / ref["file"], data)
        with data.open("r+b") as f:
            f.seek(int(ref["offset"]))
            f.write(np.float16(1234.5).tobytes())
    else:
        recipe["size"] += 1 << 40
        (copy / TABLES_RECIPE).write_text(json.dumps(recipe))
    return copy


def test_the_bundle_step_refuses_factors_that_expand_to_other_tables(bundle: Bundle, tmp_path: Path) -> None:
    check_tables(bundle.path)
    with pytest.raises(UserError, match="expand to other values than the export verified"):
        check_tables(_tampered_copy(bundle, tmp_path, "factor"))


def test_the_runtime_refuses_tables_other_than_the_verified_ones(
    bundle: Bundle, tmp_path: Path, own_state: Path
) -> None:
    tampered = open_bundle(_tampered_copy(bundle, tmp_path, "factor"), verify=False)
    with pytest.raises(BundleError, match="expands to other tables than the packager verified"):
        tables_path(tampered)
    assert not list(own_state.rglob(f"{TABLES_FILE}*"))  # nothing half-written is left to be trusted


def test_a_recipe_declaring_more_than_the_disk_holds_is_refused_before_writing(
    bundle: Bundle, tmp_path: Path, own_state: Path
) -> None:
    oversized = open_bundle(_tampered_copy(bundle, tmp_path / "size", "size"), verify=False)
    with pytest.raises(OSError, match="needs that much space"):
        tables_path(oversized)


def _rss_of(path: Path) -> int:
    """KiB of `path`'s mappings resident in this process (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):  # a mapping's first line: its range, ..., its file
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_a_session_over_the_mapped_tables_computes_as_one_reading_them_beside_the_graph(
    bundle: Bundle, tmp_path: Path, own_state: Path
) -> None:
    tables = graph_tables(bundle.model_path, bundle)
    assert tables is not None and len(tables.names) > 100
    del tables
    session = inference_session(bundle.model_path, ort.SessionOptions(), ["CPUExecutionProvider"], bundle)
    # Its pages were dropped once the session was built (the kernels hold what they packed).
    assert _rss_of(tables_path(bundle)) < 1024

    copy = tmp_path / "copy"  # the plain way: the tables file beside the graph, read by ONNX Runtime itself
    copy.mkdir()
    for name in ("model.onnx", "model.onnx.data", TABLES_RECIPE):
        shutil.copyfile(bundle.path / name, copy / name)
    assert write_tables_beside(copy) == copy / TABLES_FILE
    plain = ort.InferenceSession(str(copy / "model.onnx"), providers=["CPUExecutionProvider"])

    facts = bundle.manifest.decoder
    io = facts.io
    ids = np.array([[1, 504, 3458, 314, 260, 1789]], np.int64)
    feed = {io.input_ids: ids, io.attention_mask: np.ones_like(ids)}
    empty = np.zeros((1, facts.num_kv_heads, 0, facts.head_dim), facts.kv_dtype)
    feed |= {past: empty for past, _ in io.cache_names(facts.num_layers)}
    names = [o.name for o in session.get_outputs() if o.name == "logits"]
    (mapped,) = session.run(names, feed)
    (beside,) = plain.run(names, feed)
    np.testing.assert_array_equal(mapped, beside)
