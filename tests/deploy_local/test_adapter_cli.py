"""`pkg adapter add|list|remove` against a function deployed on the local target, through the real CLI.

A tiny random-weight Llama (fp32) is built by the real `pkg build` with `[export] adapter_modules`, so its graph
takes adapters on q_proj and v_proj; the adapters are real PEFT folders (random A and B, so they change the
greedy tokens), converted by `pkg adapter add`. The server is never restarted by an add or a remove (its pid
stays); a redeploy keeps the added adapters (they live in the function's state folder), with and without the
CRIU process snapshot (whose key covers the adapter folder, so a snapshot taken before an add is not resumed).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from packager.targets.local.process_snapshot import Criu, SnapshotUnavailable
from tests.deploy_local.conftest import KEY_ENV, Workspace, client_for, pid_alive

NAME = "tiny-lora"
KEY = "adapter-test-key"


def _peft_adapter(hf_dir: Path, out: Path, modules: list[str], seed: int) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=modules, init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(out)
    return out


def _spec(hf_dir: Path, extra: str = "") -> str:
    return (
        f'name = "{NAME}"\n[model]\nsource = "hf:{hf_dir}"\n'
        '[export]\nprecision = "fp32"\nmax_context = 256\nadapter_modules = ["q_proj", "v_proj"]\n'
        f'[runtime]\nmax_adapters = 2\n[endpoint]\napi_key_env = "{KEY_ENV}"\n{extra}'
    )


def _build(root: Path, toml: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.conftest import tiny_model_cache
    from tests.packager.conftest import build_in

    folder = root / "functions" / NAME
    folder.mkdir(parents=True)
    (folder / "function.toml").write_text(toml)
    return build_in(root, folder, tiny_model_cache(tmp_path_factory))


@pytest.fixture(scope="module")
def lora_bundle(tmp_path_factory: pytest.TempPathFactory, tiny_hf_dir: Path) -> Path:
    bundle = _build(tmp_path_factory.mktemp("lora-build"), _spec(tiny_hf_dir), tmp_path_factory)
    assert json.loads((bundle / "manifest.json").read_text())["adapters"]["layout"]["rank"] >= 4
    return bundle


@pytest.fixture(scope="module")
def peft(tmp_path_factory: pytest.TempPathFactory, tiny_hf_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peft")
    return {
        "qv": _peft_adapter(tiny_hf_dir, root / "qv", ["q_proj", "v_proj"], seed=1),
        "o": _peft_adapter(tiny_hf_dir, root / "o", ["o_proj"], seed=2),  # a module the graph does not take
    }


@pytest.fixture
def lora_space(tmp_path: Path, lora_bundle: Path, tiny_hf_dir: Path) -> Iterator[Workspace]:
    space = Workspace(tmp_path, lora_bundle)
    space.env[KEY_ENV] = KEY
    space.add_function(NAME, _spec(tiny_hf_dir), lora_bundle)
    yield space
    for state_file in [*space.state_root.glob("functions/*/state.json"), *space.state_root.glob("gateway/*.json")]:
        with contextlib.suppress(ProcessLookupError, KeyError, ValueError):
            os.killpg(json.loads(state_file.read_text())["pid"], signal.SIGKILL)


def _ok(space: Workspace, *args: str) -> str:
    done = space.pkg(*args)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _fails(space: Workspace, *args: str) -> str:
    done = space.pkg(*args)
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    return done.stderr


def _reply(space: Workspace, model: str) -> str:
    client = client_for(space.state(NAME), KEY)
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello there"}], max_tokens=8, temperature=0
    )
    return answer.choices[0].message.content or ""


def _listed(space: Workspace) -> dict[str, dict[str, object]]:
    rows = json.loads(_ok(space, "adapter", "list", f"functions/{NAME}", "--json"))
    return {str(row["name"]): row for row in rows}


def test_add_serves_without_a_restart_survives_a_redeploy_and_remove(
    lora_space: Workspace, peft: dict[str, Path]
) -> None:
    space, function = lora_space, f"functions/{NAME}"
    _ok(space, "deploy", function, "--target", "local")
    pid = space.state(NAME)["pid"]
    assert "--adapter-dir" in space.state(NAME)["command"]  # type: ignore[operator]
    base = _reply(space, NAME)

    out = _ok(space, "adapter", "add", function, "qv", str(peft["qv"]))
    assert "added adapter qv" in out and "no restart" in out and f'"{NAME}:qv"' in out
    assert space.state(NAME)["pid"] == pid and pid_alive(int(str(pid)))
    adapted = _reply(space, f"{NAME}:qv")
    assert adapted != base  # random A and B: the adapter changes the greedy tokens
    assert _reply(space, NAME) == base
    assert space.state(NAME)["pid"] == pid  # still the same server
    row = _listed(space)["qv"]
    assert row["bundled"] is False and row["resident"] is True and str(row["digest"]).startswith("sha256:")
    table = _ok(space, "adapter", "list", function)
    assert "qv" in table and f"{NAME}:qv" in table
    assert (space.state_dir(NAME) / "adapters" / "qv.safetensors").is_file()

    _ok(space, "deploy", function, "--target", "local")  # a new server: the adapter folder stays
    assert space.state(NAME)["pid"] != pid
    assert "qv" in _listed(space)
    assert _reply(space, f"{NAME}:qv") == adapted

    out = _ok(space, "adapter", "remove", function, "qv")
    assert "removed adapter qv" in out
    assert _listed(space) == {}
    with pytest.raises(openai.NotFoundError):
        _reply(space, f"{NAME}:qv")
    assert "has no adapter 'qv'" in _fails(space, "adapter", "remove", function, "qv")


def test_errors_say_what_to_do(lora_space: Workspace, peft: dict[str, Path], tmp_path: Path) -> None:
    space, function = lora_space, f"functions/{NAME}"
    assert "pkg deploy" in _fails(space, "adapter", "add", function, "qv", str(peft["qv"]))  # not deployed yet
    assert "function.toml" in _fails(space, "adapter", "list", "functions/nope")
    _ok(space, "deploy", function, "--target", "local")
    assert "does not exist" in _fails(space, "adapter", "add", function, "x", str(tmp_path / "missing"))
    (tmp_path / "junk").mkdir()
    assert "neither a PEFT adapter folder" in _fails(space, "adapter", "add", function, "x", str(tmp_path / "junk"))
    assert "does not fit" in _fails(space, "adapter", "add", function, "o", str(peft["o"]))
    assert "is not valid" in _fails(space, "adapter", "add", function, "bad/name", str(peft["qv"]))
    assert "has no adapter 'ghost'" in _fails(space, "adapter", "remove", function, "ghost")
    assert _listed(space) == {}  # nothing half-added


def test_a_bundle_without_adapter_inputs_is_refused(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, tiny_hf_dir: Path, peft: dict[str, Path]
) -> None:
    toml = _spec(tiny_hf_dir).replace('adapter_modules = ["q_proj", "v_proj"]\n', "")
    bundle = _build(tmp_path / "plain", toml, tmp_path_factory)
    space = Workspace(tmp_path / "ws", bundle)
    space.root.mkdir()
    space.add_function(NAME, toml, bundle)
    space.pkg("deploy", f"functions/{NAME}", "--target", "local")  # the refusal comes from the bundle either way
    try:
        message = _fails(space, "adapter", "add", f"functions/{NAME}", "qv", str(peft["qv"]))
    finally:
        space.pkg("destroy", f"functions/{NAME}", "--target", "local")
        space.pkg("gateway", "stop")  # the deploy started this workspace's own gateway
    assert "takes no LoRA adapters" in message and "adapter_modules" in message


def test_process_snapshot_restores_with_the_adapters_added_since(lora_space: Workspace, peft: dict[str, Path]) -> None:
    try:
        Criu.find()
    except SnapshotUnavailable as exc:
        pytest.skip(f"no process snapshots here: {exc}")
    space, function = lora_space, f"functions/{NAME}"
    toml = space.root / "functions" / NAME / "function.toml"
    toml.write_text(toml.read_text() + "[targets.local]\nprocess_snapshot = true\n")
    _ok(space, "deploy", function, "--target", "local")
    _ok(space, "adapter", "add", function, "qv", str(peft["qv"]))
    adapted = _reply(space, f"{NAME}:qv")

    # The snapshot was taken before the add: resuming it would serve a catalog without `qv`.
    _ok(space, "deploy", function, "--target", "local")
    state = space.state(NAME)
    assert state["start"] == "fresh" and "adapters digest differs" in str(state["start_note"]), state
    assert _reply(space, f"{NAME}:qv") == adapted

    # A redeploy while it runs starts the new server beside it (the snapshot's port is the running server's),
    # and dumps that one; a deploy after a destroy resumes the snapshot taken with `qv`.
    _ok(space, "deploy", function, "--target", "local")
    assert "started fresh beside the running server" in str(space.state(NAME)["start_note"])
    _ok(space, "destroy", function)
    _ok(space, "deploy", function, "--target", "local")
    assert space.state(NAME)["start"] == "restored", space.state(NAME)
    assert _reply(space, f"{NAME}:qv") == adapted


def test_an_idle_function_gets_the_adapter_when_it_wakes(
    lora_space: Workspace, peft: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from packager.targets.local import idle

    space, function = lora_space, f"functions/{NAME}"
    _ok(space, "deploy", function, "--target", "local")
    monkeypatch.setenv(KEY_ENV, KEY)
    assert idle.suspend(space.state_dir(NAME)) is not None  # what the gateway does after idle_timeout

    out = _ok(space, "adapter", "add", function, "qv", str(peft["qv"]))
    assert "the server is idle" in out
    assert _listed(space)["qv"]["resident"] is False

    idle.resume(space.state_dir(NAME))  # what the gateway does on the next request
    assert _reply(space, f"{NAME}:qv") != _reply(space, NAME)
    out = _ok(space, "adapter", "remove", function, "qv")
    assert "no longer serves it" in out


def test_the_gateway_lists_the_adapters_of_an_idle_function_without_waking_it(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, tiny_hf_dir: Path, peft: dict[str, Path]
) -> None:
    """Issue 47, row 10: `/v1/models` at the gateway names each adapter (the bundle's, from its manifest, and the
    added ones, from the adapter folder) as a card whose `parent` is the function, even while it is idle."""
    toml = _spec(tiny_hf_dir, f'[[adapters]]\nname = "shipped"\nsource = "{peft["qv"]}"\n')
    bundle = _build(tmp_path_factory.mktemp("bundled-lora"), toml, tmp_path_factory)
    space = Workspace(tmp_path, bundle)
    space.env[KEY_ENV] = KEY
    space.add_function(NAME, toml + "[targets.local]\nidle_timeout = 2\n", bundle)
    function = f"functions/{NAME}"
    try:
        _ok(space, "deploy", function, "--target", "local")
        _ok(space, "adapter", "add", function, "added", str(peft["qv"]))
        deadline = time.monotonic() + 60
        while json.loads(_ok(space, "ps", "--json"))[0]["state"] != "idle":
            assert time.monotonic() < deadline, "the function never went idle"
            time.sleep(0.5)

        gateway = openai.OpenAI(base_url=f"{space.gateway_url}/v1", api_key=KEY, max_retries=0, timeout=30)
        cards = {card.id: card for card in gateway.models.list().data}
        assert list(cards) == [NAME, f"{NAME}:added", f"{NAME}:shipped"]
        assert [getattr(cards[f"{NAME}:{a}"], "parent", None) for a in ("added", "shipped")] == [NAME, NAME]
        assert getattr(gateway.models.retrieve(f"{NAME}:shipped"), "parent", None) == NAME
        with pytest.raises(openai.NotFoundError, match=f"serves these adapters: {NAME}:added, {NAME}:shipped"):
            gateway.models.retrieve(f"{NAME}:nope")
        [row] = json.loads(_ok(space, "ps", "--json"))
        assert row["state"] == "idle" and row["rss_bytes"] == 0  # looked at, not woken
        reply = gateway.chat.completions.create(
            model=f"{NAME}:shipped", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )  # and served once asked
        assert reply.choices[0].message.content is not None
    finally:
        for state_file in [*space.state_root.glob("functions/*/state.json"), *space.state_root.glob("gateway/*.json")]:
            with contextlib.suppress(ProcessLookupError, KeyError, ValueError):
                os.killpg(json.loads(state_file.read_text())["pid"], signal.SIGKILL)
