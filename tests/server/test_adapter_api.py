"""LoRA adapters through the OpenAI API: `model: "FUNCTION:ADAPTER"`, their `/v1/models` cards, and the admin
routes that add and remove them on a running server (runtime/http/adapters.py).

Served from a tiny random-weight Llama (fp32) whose graph is given adapter inputs here, as the packager does
(packager/export/lora.py), with one bundled adapter; the others are written as onnxfn adapter files and PUT.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import numpy as np
import onnx
import pytest

from runtime.adapters.files import AdapterFile, write_adapter_file
from runtime.adapters.layout import AdapterLayout
from runtime.api.service import ModelService
from runtime.bundle import read_manifest
from runtime.engine.engine import EngineConfig
from runtime.events.handler import generate
from runtime.events.schema import Envelope
from runtime.http.state import ServerSettings
from tests.fixtures.adapter_bundle import TINY_FP32_SPEC, random_adapter, with_adapter_inputs
from tests.server.conftest import API_KEY, RunningServer, engine_loader, policy_for, serve_in_thread

AUTH = {"Authorization": f"Bearer {API_KEY}"}
RANK = 4
MODULES = ("q_proj", "v_proj")
BUNDLED = "shipped"


@pytest.fixture(scope="module")
def tiny_bundle(tmp_path_factory: pytest.TempPathFactory, tiny_hf_dir: Path) -> Path:
    """The tiny Llama as an fp32 bundle (plain MatMuls), built by the real `pkg build` pipeline."""
    from tests.conftest import tiny_model_cache
    from tests.packager.conftest import build_in, write_function

    root = tmp_path_factory.mktemp("tiny-lora")
    function = write_function(root, "tiny-lora", f"hf:{tiny_hf_dir}", TINY_FP32_SPEC)
    return build_in(root, function, tiny_model_cache(tmp_path_factory))


@pytest.fixture(scope="module")
def adapter_bundle(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, AdapterLayout]:
    """`tiny_bundle` with adapter inputs on q_proj and v_proj at rank 4, and one bundled adapter, `shipped`."""
    from packager.export.lora import plan_layout

    target = tmp_path_factory.mktemp("tiny-lora-adapters")
    manifest = read_manifest(tiny_bundle)
    model = onnx.load(str(tiny_bundle / manifest.model_file), load_external_data=False)
    shipped = random_adapter(plan_layout(model, manifest.model, MODULES, rank=RANK), seed=7)
    layout = with_adapter_inputs(tiny_bundle, target, MODULES, RANK, {BUNDLED: shipped})
    return target, layout


def adapter_bytes(layout: AdapterLayout, directory: Path, **kwargs: Any) -> bytes:
    path = directory / "adapter.safetensors"
    write_adapter_file(path, random_adapter(layout, **kwargs))
    return path.read_bytes()


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("added-adapters")


@pytest.fixture(scope="module")
def lora_server(adapter_bundle: tuple[Path, AdapterLayout], adapter_dir: Path) -> Iterator[RunningServer]:
    bundle, _ = adapter_bundle
    settings = ServerSettings(policy=policy_for(bundle), api_key=API_KEY, fingerprint="fp_test")
    config = EngineConfig(max_batch=4, max_context=256, max_adapters=2, adapter_dir=adapter_dir)
    with serve_in_thread(settings, engine_loader(bundle, config)) as running:
        yield running


@pytest.fixture(scope="module")
def http(lora_server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=lora_server.url, headers=AUTH, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def function(adapter_bundle: tuple[Path, AdapterLayout]) -> str:
    return read_manifest(adapter_bundle[0]).function


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    return tmp_path


def chat(http: httpx.Client, model: str, text: str = "Write a short poem about the sea.") -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 12, "temperature": 0}
    return http.post("/v1/chat/completions", json=body)


def put(http: httpx.Client, name: str, data: bytes, digest: str | None = None) -> httpx.Response:
    headers = {"Content-Type": "application/octet-stream", **({"X-Onnxfn-Digest": digest} if digest else {})}
    return http.put(f"/v1/adapters/{name}", content=data, headers=headers)


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def test_an_unknown_adapter_is_a_404_naming_the_models_served(http: httpx.Client, function: str) -> None:
    response = chat(http, f"{function}:nope")
    assert response.status_code == 404
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model", "invalid_request_error")
    assert f"{function}:nope" in error["message"] and f"{function}:{BUNDLED}" in error["message"]
    # The function part is checked first, as before adapters.
    response = chat(http, f"other:{BUNDLED}")
    assert response.status_code == 404 and f"serves {function!r}" in response.json()["error"]["message"]
    completion = http.post("/v1/completions", json={"model": f"{function}:nope", "prompt": "The", "max_tokens": 2})
    assert completion.status_code == 404 and completion.json()["error"]["code"] == "model_not_found"


def test_models_lists_the_base_and_a_card_per_adapter(http: httpx.Client, function: str) -> None:
    cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
    assert "parent" not in cards[function]
    shipped = cards[f"{function}:{BUNDLED}"]
    assert (shipped["object"], shipped["parent"], shipped["owned_by"]) == ("model", function, "onnxfn")
    assert http.get(f"/v1/models/{function}:{BUNDLED}").json() == shipped
    assert http.get(f"/v1/models/{function}:nope").status_code == 404


def test_a_put_adapter_serves_requests_and_changes_the_output(
    http: httpx.Client, function: str, adapter_bundle: tuple[Path, AdapterLayout], adapter_dir: Path, scratch: Path
) -> None:
    layout = adapter_bundle[1]
    loud, silent = adapter_bytes(layout, scratch, seed=1), adapter_bytes(layout, scratch, seed=2, zero_b=True)
    added = put(http, "loud", loud, sha256(loud))
    assert added.status_code == 201, added.text
    assert added.json() == {"id": f"{function}:loud", "name": "loud", "digest": sha256(loud), "bytes": len(loud)}
    assert put(http, "silent", silent).status_code == 201
    assert (adapter_dir / "loud.safetensors").read_bytes() == loud

    listed = {a["name"]: a for a in http.get("/v1/adapters").json()["data"]}
    assert listed["loud"] == {**added.json(), "bundled": False, "resident": False}
    assert listed[BUNDLED]["bundled"] is True
    assert {f"{function}:loud", f"{function}:silent"} <= {c["id"] for c in http.get("/v1/models").json()["data"]}

    base = chat(http, function).json()
    with_loud = chat(http, f"{function}:loud").json()
    with_silent = chat(http, f"{function}:silent").json()
    assert with_loud["model"] == f"{function}:loud" and base["model"] == function
    assert with_loud["choices"][0]["message"]["content"] != base["choices"][0]["message"]["content"]
    # A zero B adds exact zeros: the base's greedy tokens.
    assert with_silent["choices"][0]["message"]["content"] == base["choices"][0]["message"]["content"]
    resident = {a["name"]: a["resident"] for a in http.get("/v1/adapters").json()["data"]}
    assert resident["loud"] and resident["silent"]  # two slots (max_adapters=2), both used last

    body = {"model": f"{function}:loud", "prompt": "The river", "max_tokens": 6, "temperature": 0}
    completion = http.post("/v1/completions", json=body)
    assert completion.status_code == 200 and completion.json()["model"] == f"{function}:loud"
    base_completion = http.post("/v1/completions", json={**body, "model": function}).json()
    assert completion.json()["choices"][0]["text"] != base_completion["choices"][0]["text"]


def test_a_wrong_digest_or_a_bad_file_stores_nothing(
    http: httpx.Client, adapter_bundle: tuple[Path, AdapterLayout], adapter_dir: Path, scratch: Path
) -> None:
    data = adapter_bytes(adapter_bundle[1], scratch, seed=3)
    response = put(http, "mangled", data, sha256(b"something else"))
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_adapter"
    assert "resend" in response.json()["error"]["message"]
    response = put(http, "garbage", b"\x00not an adapter file" * 10)
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_adapter"
    response = put(http, "bad name!", data)
    assert response.status_code == 400
    names = {a["name"] for a in http.get("/v1/adapters").json()["data"]}
    assert not names & {"mangled", "garbage"}
    assert not list(adapter_dir.glob("mangled*")) and not list(adapter_dir.glob("garbage*"))
    assert not list(adapter_dir.glob(".incoming-*"))


def test_an_adapter_that_does_not_fit_is_refused(
    http: httpx.Client, adapter_bundle: tuple[Path, AdapterLayout], scratch: Path
) -> None:
    layout = adapter_bundle[1]
    adapter = random_adapter(layout, seed=4)
    wide = AdapterFile(
        RANK * 2,
        1.0,
        adapter.base,
        {k: np.tile(v, (1, 2) if k.endswith(".a") else (2, 1)) for k, v in adapter.tensors.items()},
    )
    write_adapter_file(scratch / "wide.safetensors", wide)
    response = put(http, "wide", (scratch / "wide.safetensors").read_bytes())
    assert response.status_code == 400 and "rank" in response.json()["error"]["message"]


def test_delete_removes_an_added_adapter_and_keeps_bundled_ones(
    http: httpx.Client, function: str, adapter_bundle: tuple[Path, AdapterLayout], adapter_dir: Path, scratch: Path
) -> None:
    assert put(http, "doomed", adapter_bytes(adapter_bundle[1], scratch, seed=5)).status_code == 201
    assert chat(http, f"{function}:doomed").status_code == 200
    response = http.delete("/v1/adapters/doomed")
    assert response.status_code == 200
    assert response.json() == {"id": f"{function}:doomed", "name": "doomed", "deleted": True}
    assert not (adapter_dir / "doomed.safetensors").exists()
    assert chat(http, f"{function}:doomed").status_code == 404
    assert http.get(f"/v1/models/{function}:doomed").status_code == 404
    assert "doomed" not in {a["name"] for a in http.get("/v1/adapters").json()["data"]}
    again = http.delete("/v1/adapters/doomed")
    assert again.status_code == 404 and again.json()["error"]["code"] == "adapter_not_found"

    for response in (http.delete(f"/v1/adapters/{BUNDLED}"), put(http, BUNDLED, b"x")):
        assert response.status_code == 409 and response.json()["error"]["code"] == "adapter_conflict"
    assert chat(http, f"{function}:{BUNDLED}").status_code == 200


def test_the_admin_routes_need_the_key(lora_server: RunningServer, function: str) -> None:
    url = lora_server.url
    for response in (
        httpx.get(f"{url}/v1/adapters"),
        httpx.put(f"{url}/v1/adapters/sneaky", content=b"x"),
        httpx.delete(f"{url}/v1/adapters/{BUNDLED}"),
        httpx.get(f"{url}/v1/adapters", headers={"Authorization": "Bearer wrong"}),
    ):
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert "sneaky" not in {a["name"] for a in httpx.get(f"{url}/v1/adapters", headers=AUTH).json()["data"]}


def test_the_queue_frontend_takes_the_same_model_field(lora_server: RunningServer, function: str) -> None:
    service = cast(ModelService, lora_server.state)
    messages = [{"role": "user", "content": "Hi"}]

    def run(model: str) -> Any:
        body = {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0}
        envelope = Envelope(f"req-{model}", "chat", body, cast(Any, None))
        return asyncio.run(generate(service, envelope))  # the queue worker's own event loop

    shipped = run(f"{function}:{BUNDLED}")
    assert shipped.status == 200 and shipped.body["model"] == f"{function}:{BUNDLED}"
    unknown = run(f"{function}:nope")
    assert unknown.status == 404 and unknown.body["error"]["code"] == "model_not_found"


@pytest.fixture(scope="module")
def plain_server(tiny_bundle: Path) -> Iterator[RunningServer]:
    """The same model without adapter inputs."""
    settings = ServerSettings(policy=policy_for(tiny_bundle), api_key=API_KEY)
    with serve_in_thread(settings, engine_loader(tiny_bundle, EngineConfig(max_batch=2, max_context=256))) as running:
        yield running


def test_a_bundle_without_adapters_says_how_to_get_them(plain_server: RunningServer, tiny_bundle: Path) -> None:
    function = read_manifest(tiny_bundle).function
    with httpx.Client(base_url=plain_server.url, headers=AUTH, timeout=60) as client:
        response = chat(client, f"{function}:upper")
        assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
        assert "[[adapters]]" in response.json()["error"]["message"]
        assert chat(client, function).status_code == 200
        assert client.get("/v1/adapters").json() == {"object": "list", "data": []}
        assert [c["id"] for c in client.get("/v1/models").json()["data"]] == [function]
        added = put(client, "upper", b"x")
        assert added.status_code == 404 and "adapter_modules" in added.json()["error"]["message"]
