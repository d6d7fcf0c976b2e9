"""Hostile adapter uploads to a real `python -m runtime serve` process (issue 47: rows 2, 6 and 10).

- Row 2: an adapter holding NaN or inf, or whose `scale * b` overflows float32, was stored (201) and then turned
  every row batched with it into `<|endoftext|>`; now each is a 400 `invalid_adapter` and nothing is stored.
- Row 6: an adapter file whose safetensors `__metadata__` is a JSON string was an AttributeError (500).
- Row 10: a 250 MiB PUT took 2.8x its size in RSS (the body joined in memory, then every tensor loaded); now the
  body streams to disk and is checked a tensor at a time.

The server serves a tiny bundle whose graph takes adapters on q_proj and v_proj at rank 4 (tests/fixtures).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from runtime.adapters.files import FORMAT, AdapterFile, write_adapter_file
from runtime.adapters.layout import AdapterLayout
from tests.fixtures.adapter_bundle import TINY_FP32_SPEC, random_adapter, with_adapter_inputs
from tests.reliability.live import LiveServer, live_server

MODULES = ("q_proj", "v_proj")
RANK = 4
MIB = 1 << 20


@pytest.fixture(scope="module")
def adapter_bundle(tmp_path_factory: pytest.TempPathFactory, tiny_hf_dir: Path) -> tuple[Path, AdapterLayout]:
    from tests.conftest import tiny_model_cache
    from tests.packager.conftest import build_in, write_function

    root = tmp_path_factory.mktemp("tiny-uploads")
    function = write_function(root, "tiny-uploads", f"hf:{tiny_hf_dir}", TINY_FP32_SPEC)
    bundle = build_in(root, function, tiny_model_cache(tmp_path_factory))
    target = tmp_path_factory.mktemp("tiny-uploads-adapters")
    return target, with_adapter_inputs(bundle, target, MODULES, RANK, {})


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("uploaded")


@pytest.fixture(scope="module")
def server(adapter_bundle: tuple[Path, AdapterLayout], adapter_dir: Path) -> Iterator[LiveServer]:
    flags = ["--adapter-dir", str(adapter_dir), "--max-adapters", "2", "--max-context", "256", "--temperature", "0"]
    with live_server(adapter_bundle[0], adapter_dir.parent / "uploads-server.log", flags) as running:
        yield running


@pytest.fixture
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=server.auth, timeout=120) as client:
        yield client


def file_bytes(adapter: AdapterFile, scratch: Path) -> bytes:
    path = scratch / "adapter.safetensors"
    write_adapter_file(path, adapter)
    return path.read_bytes()


def poisoned(
    layout: AdapterLayout, key: str, value: float, *, scale: float = 2.0, dtype: type = np.float32
) -> AdapterFile:
    good = random_adapter(layout, seed=11, scale=scale)
    tensors = {k: v.astype(dtype) for k, v in good.tensors.items()}
    tensors[key][1, 2] = value
    return AdapterFile(good.rank, scale, good.base, tensors)


def put(http: httpx.Client, name: str, data: bytes) -> httpx.Response:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    return http.put(f"/v1/adapters/{name}", content=data, headers={"X-Onnxfn-Digest": digest})


def raw_safetensors(metadata: object, tensors: dict[str, np.ndarray]) -> bytes:
    """A safetensors file written by hand, so its header can hold what the library would never write."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset, blobs = 0, []
    for key, tensor in tensors.items():
        blob = np.ascontiguousarray(tensor, np.float32).tobytes()
        header[key] = {"dtype": "F32", "shape": list(tensor.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


Case = Callable[[AdapterLayout], AdapterFile]
HOSTILE_VALUES: dict[str, tuple[Case, str]] = {
    # The reproductions.
    "nan-in-a": (lambda lo: poisoned(lo, "layers.0.q_proj.a", np.nan), "1 NaN and 0 infinite values"),
    "inf-in-a": (lambda lo: poisoned(lo, "layers.0.q_proj.a", np.inf), "0 NaN and 1 infinite values"),
    "scale-times-b-overflows": (
        lambda lo: poisoned(lo, "layers.0.q_proj.b", 4.0, scale=1e38),
        "beyond float32's range",
    ),
    # Neighbours: the other side, the last tensor, float16, and the scale taking `a` past the range.
    "minus-inf-in-b": (lambda lo: poisoned(lo, "layers.0.v_proj.b", -np.inf), "0 NaN and 1 infinite values"),
    "nan-in-the-last-tensor": (
        lambda lo: poisoned(lo, f"layers.{lo.num_layers - 1}.v_proj.b", np.nan),
        "1 NaN and 0 infinite values",
    ),
    "float16-inf": (
        lambda lo: poisoned(lo, "layers.1.q_proj.a", np.inf, dtype=np.float16),
        "0 NaN and 1 infinite values",
    ),
    "scale-times-a-overflows": (
        lambda lo: poisoned(lo, "layers.0.v_proj.a", 3e30, scale=1e9),
        "beyond float32's range",
    ),
}


@pytest.mark.parametrize("case", HOSTILE_VALUES, ids=str)
def test_an_adapter_with_values_that_could_poison_a_batch_is_refused_and_nothing_is_stored(
    http: httpx.Client, adapter_bundle: tuple[Path, AdapterLayout], adapter_dir: Path, tmp_path: Path, case: str
) -> None:
    make, expected = HOSTILE_VALUES[case]
    response = put(http, case, file_bytes(make(adapter_bundle[1]), tmp_path))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("invalid_adapter", "body", "invalid_request_error")
    assert expected in error["message"], error
    assert case not in {a["name"] for a in http.get("/v1/adapters").json()["data"]}
    assert sorted(p.name for p in adapter_dir.iterdir()) == sorted(p.name for p in adapter_dir.glob("good*"))


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ("onnxfn-lora/1", "__metadata__ is a JSON str, not an object of strings"),  # the reproduction
        (["format", FORMAT], "__metadata__ is a JSON list"),
        ({"format": FORMAT, "rank": 4, "scale": "1.0", "base": "{}"}, "not an object of strings"),
        ({"format": FORMAT, "rank": "four", "scale": "1.0", "base": "{}"}, "its metadata lacks or garbles"),
        ({"format": FORMAT, "rank": "4", "scale": "1.0", "base": "[]"}, "base is not a JSON object"),
        ({"format": FORMAT, "rank": "4", "scale": "1.0"}, "its metadata lacks or garbles 'base'"),
    ],
    ids=["string", "list", "number-value", "bad-rank", "list-base", "no-base"],
)
def test_an_adapter_file_with_a_malformed_header_is_a_400(
    http: httpx.Client, adapter_bundle: tuple[Path, AdapterLayout], adapter_dir: Path, metadata: object, expected: str
) -> None:
    tensors = random_adapter(adapter_bundle[1], seed=12).tensors
    response = put(http, "crafted", raw_safetensors(metadata, tensors))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_adapter" and expected in error["message"], error
    assert not list(adapter_dir.glob("crafted*")) and not list(adapter_dir.glob(".incoming-*"))


def test_a_good_adapter_still_uploads_and_serves_beside_the_base(
    http: httpx.Client, server: LiveServer, adapter_bundle: tuple[Path, AdapterLayout], tmp_path: Path
) -> None:
    response = put(http, "good", file_bytes(random_adapter(adapter_bundle[1], seed=13), tmp_path))
    assert response.status_code == 201, response.text
    body = {"messages": [{"role": "user", "content": "Write a poem about the sea."}], "max_tokens": 8}
    base = http.post("/v1/chat/completions", json={**body, "model": server.model})
    adapted = http.post("/v1/chat/completions", json={**body, "model": f"{server.model}:good"})
    assert base.status_code == adapted.status_code == 200
    assert adapted.json()["choices"][0]["message"]["content"] != base.json()["choices"][0]["message"]["content"]


def peak_rss_growth(server: LiveServer, action: Callable[[], None]) -> int:
    """How far the server's peak RSS rose above its RSS before `action` (the peak is reset first)."""
    pid = server.process.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    before = server.rss_bytes()
    action()
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 - before
    raise AssertionError("no VmHWM")


def test_a_250_mib_upload_streams_to_disk_in_bounded_memory(
    http: httpx.Client, server: LiveServer, adapter_dir: Path, tmp_path: Path
) -> None:
    """250 MiB of well-formed adapter file (125 layers of rank 4096: not this bundle's), sent as it is read from
    disk: the server held 2.8x that in RSS before; now its peak grows by a few MiB at most, and it refuses the
    file from its header once stored (its rank exceeds the graph's) without loading a tensor."""
    big = tmp_path / "big.safetensors"
    wide = {"layers.0.q_proj.a": np.ones((64, 4096), np.float32), "layers.0.q_proj.b": np.ones((4096, 64), np.float32)}
    tensors = {f"layers.{n}.q_proj.{side}": wide[f"layers.0.q_proj.{side}"] for n in range(125) for side in "ab"}
    meta = {"format": FORMAT, "rank": "4096", "scale": "1.0", "base": "{}"}
    from safetensors.numpy import save_file

    save_file(tensors, str(big), metadata=meta)
    size = big.stat().st_size
    assert 250 * MIB <= size < 251 * MIB

    def upload() -> None:
        def chunks() -> Iterator[bytes]:
            with big.open("rb") as file:
                while chunk := file.read(MIB):
                    yield chunk

        response = http.put("/v1/adapters/big", content=chunks(), headers={"Content-Length": str(size)})
        assert response.status_code == 400, response.text
        assert "its rank 4096 exceeds the bundle's adapter rank 4" in response.json()["error"]["message"]

    growth = peak_rss_growth(server, upload)
    assert growth < 32 * MIB, f"peak RSS grew {growth / MIB:.1f} MiB for a {size / MIB:.0f} MiB upload"
    assert not list(adapter_dir.glob("big*")) and not list(adapter_dir.glob(".incoming-*"))
