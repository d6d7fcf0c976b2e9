"""`pkg adapter add|list|remove --device` against real agents on network-namespace devices.

The bundle is a tiny random-weight Llama built by the real `pkg build` with `[export] adapter_modules`, and the
adapter a real PEFT folder (random A and B, so it changes the greedy tokens). The agent checks the digest, its
runtime stores the file in the agent's `adapters/` folder and serves `MODEL:NAME` at once; the adapter outlives
a bundle swap and an agent restart.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from packager.cli import build_parser
from packager.edge.client import AgentClient, AgentError, DeviceAuth
from packager.errors import UserError
from runtime.adapters.files import write_adapter_file
from runtime.adapters.layout import AdapterLayout
from runtime.bundle import read_manifest
from tests.edge.bundles import derive_bundle
from tests.edge.conftest import MODEL, TOKEN, Device, Workspace
from tests.fixtures.adapter_bundle import random_adapter

SPEC = '[export]\nprecision = "fp32"\nmax_context = 256\nadapter_modules = ["q_proj", "v_proj"]\n'


@pytest.fixture(scope="module")
def lora_pair(tmp_path_factory: pytest.TempPathFactory, tiny_hf_dir: Path) -> tuple[Path, Path]:
    """Two valid bundles (different digests) of the tiny Llama whose graph takes adapters on q and v."""
    from tests.conftest import tiny_model_cache
    from tests.packager.conftest import build_in, write_function

    root = tmp_path_factory.mktemp("lora-edge")
    function = write_function(root, "lora-edge", f"hf:{tiny_hf_dir}", SPEC)
    built = build_in(root, function, tiny_model_cache(tmp_path_factory))
    return derive_bundle(built, root / "a"), derive_bundle(built, root / "b", function="lora-edge-v2")


@pytest.fixture(scope="module")
def peft_qv(tmp_path_factory: pytest.TempPathFactory, tiny_hf_dir: Path) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_hf_dir, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    out = tmp_path_factory.mktemp("peft") / "qv"
    get_peft_model(model, config).save_pretrained(out)
    return out


@pytest.fixture
def project(tmp_path: Path) -> Workspace:
    function = tmp_path / "project" / "functions" / MODEL
    function.mkdir(parents=True)
    (function / "function.toml").write_text(f'name = "{MODEL}"\n\n[model]\nsource = "hf:unused"\n')
    return Workspace(tmp_path / "project")


def pkg(workspace: Workspace, monkeypatch: pytest.MonkeyPatch, *argv: str) -> int:
    monkeypatch.chdir(workspace.root)
    args = build_parser().parse_args(list(argv))
    return int(args.run(args) or 0)


def chat(device: Device, model: str) -> str:
    response = httpx.post(
        f"{device.url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "temperature": 0},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


def test_adapter_add_list_remove_on_two_devices(
    devices, project, lora_pair, peft_qv, tmp_path, monkeypatch, capsys
) -> None:
    a, b = lora_pair
    first, second = devices(2)
    urls = f"{first.url},{second.url}"
    token = tmp_path / "token-file"
    token.write_text(TOKEN)
    project.select(a)
    assert pkg(project, monkeypatch, "push", project.function, "--device", urls, "--token-file", str(token)) == 0
    base = chat(first, MODEL)

    edge = ("--device", urls, "--token-file", str(token))
    assert pkg(project, monkeypatch, "adapter", "add", project.function, "qv", str(peft_qv), *edge) == 0
    assert "added" in capsys.readouterr().out
    adapted = chat(first, f"{MODEL}:qv")
    assert adapted != base
    assert chat(second, f"{MODEL}:qv") == adapted  # same base, same adapter, greedy
    for device in (first, second):
        stored = device.root / "adapters" / "qv.safetensors"
        assert stored.is_file()
        assert [p.name for p in stored.parent.iterdir()] == ["qv.safetensors"]  # no temporary file left

    assert pkg(project, monkeypatch, "adapter", "list", project.function, "--json", *edge) == 0
    listed = capsys.readouterr().out
    assert listed.count('"name": "qv"') == 2 and first.url in listed and second.url in listed

    # A new bundle: the adapter folder is the agent's, not the bundle's, so the new runtime serves it too.
    project.select(b)
    assert pkg(project, monkeypatch, "push", project.function, "--device", first.url, "--token-file", str(token)) == 0
    assert chat(first, f"{MODEL}:qv") == adapted
    # And after a restart of the agent.
    first.kill()
    first.start()
    first.wait_settled()
    assert chat(first, f"{MODEL}:qv") == adapted

    assert pkg(project, monkeypatch, "adapter", "remove", project.function, "qv", *edge) == 0
    for device in (first, second):
        assert not (device.root / "adapters" / "qv.safetensors").exists()
        response = httpx.post(
            f"{device.url}/v1/chat/completions",
            json={"model": f"{MODEL}:qv", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
            timeout=60,
        )
        assert response.status_code == 404, response.text
    with pytest.raises(UserError, match="adapter_not_found"):
        pkg(project, monkeypatch, "adapter", "remove", project.function, "qv", *edge)


def test_agent_refuses_bad_digests_tokens_and_a_device_without_a_bundle(
    devices, project, lora_pair, peft_qv, tmp_path, monkeypatch
) -> None:
    a, _ = lora_pair
    (device,) = devices(1)
    project.select(a)
    token = tmp_path / "token-file"
    token.write_text(TOKEN)
    with AgentClient(device.url, DeviceAuth(TOKEN)) as client, pytest.raises(AgentError, match="no bundle is serving"):
        client.adapters()
    edge = ("--device", device.url, "--token-file", str(token))
    with pytest.raises(UserError, match="no bundle is serving"):
        pkg(project, monkeypatch, "adapter", "add", project.function, "qv", str(peft_qv), *edge)
    assert pkg(project, monkeypatch, "push", project.function, *edge) == 0

    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-token")
    with pytest.raises(UserError, match="unauthorized"):
        pkg(project, monkeypatch, "adapter", "add", project.function, "qv", str(peft_qv), "--device", device.url,
            "--token-file", str(wrong))  # fmt: skip

    data = b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "
    with AgentClient(device.url, DeviceAuth(TOKEN)) as client:
        with pytest.raises(AgentError, match="digest_mismatch"):
            client.put_adapter("qv", data, "sha256:" + "0" * 64)
        with pytest.raises(AgentError, match="invalid_adapter"):  # the runtime's own check: not an adapter file
            client.put_adapter("qv", data, "sha256:" + hashlib.sha256(data).hexdigest())
        # Issue 47, row 2: an adapter holding a NaN would spoil every row batched with it; the agent refuses it.
        poisoned = random_adapter(AdapterLayout.from_json((read_manifest(a).adapters or {})["layout"]), seed=4)
        next(iter(poisoned.tensors.values()))[0, 0] = float("nan")
        write_adapter_file(tmp_path / "nan.safetensors", poisoned)
        nan = (tmp_path / "nan.safetensors").read_bytes()
        with pytest.raises(AgentError, match=r"invalid_adapter.*1 NaN and 0 infinite values"):
            client.put_adapter("nan", nan, "sha256:" + hashlib.sha256(nan).hexdigest())
        assert client.adapters() == []
    assert not list((device.root / "adapters").iterdir())


def test_a_250_mib_adapter_through_the_agent_streams_in_bounded_memory(
    devices, project, lora_pair, tmp_path, monkeypatch
) -> None:
    """Issue 47, row 10, on a device: the agent spooled the body into memory, then handed it on as one buffer; it
    now streams it to disk and from there into the runtime's route, so its peak RSS grows by a few MiB, not 250+."""
    from safetensors.numpy import save_file

    from runtime.adapters.files import FORMAT

    a, _ = lora_pair
    (device,) = devices(1)
    project.select(a)
    token = tmp_path / "token-file"
    token.write_text(TOKEN)
    assert pkg(project, monkeypatch, "push", project.function, "--device", device.url, "--token-file", str(token)) == 0
    big = tmp_path / "big.safetensors"
    wide = {"a": np.ones((64, 4096), np.float32), "b": np.ones((4096, 64), np.float32)}
    meta = {"format": FORMAT, "rank": "4096", "scale": "1.0", "base": "{}"}
    save_file({f"layers.{n}.q_proj.{side}": wide[side] for n in range(125) for side in "ab"}, str(big), metadata=meta)
    size = big.stat().st_size
    digest = hashlib.sha256()
    with big.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)

    def chunks() -> Iterator[bytes]:
        with big.open("rb") as file:
            while chunk := file.read(1 << 20):
                yield chunk

    status = Path(f"/proc/{device.process.pid}/status")  # `ip netns exec` execs the agent: its pid
    Path(f"/proc/{device.process.pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = int(next(line for line in status.read_text().splitlines() if line.startswith("VmRSS:")).split()[1])
    headers = {"Authorization": f"Bearer {TOKEN}", "X-Onnxfn-Digest": "sha256:" + digest.hexdigest(),
               "Content-Length": str(size)}  # fmt: skip
    response = httpx.put(f"{device.url}/agent/adapters/big", content=chunks(), headers=headers, timeout=300)
    assert response.status_code == 400 and "exceeds the bundle's adapter rank" in response.text, response.text
    peak = int(next(line for line in status.read_text().splitlines() if line.startswith("VmHWM:")).split()[1])
    assert (peak - before) << 10 < 32 << 20, f"the agent's peak RSS grew {(peak - before) / 1024:.1f} MiB"
    assert not [p for p in (device.root / "adapters").iterdir()]
