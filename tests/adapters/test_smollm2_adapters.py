"""The demo model with two real LoRA adapters trained by PEFT (training.py), end to end through the real CLI.

The function is the demo's, built at fp32 (so onnxfn's outputs can equal PyTorch's token for token) with `upper`
declared in function.toml and `french` added to the running endpoint by `pkg adapter add`. One concurrent batch
of base, `upper` and `french` chats goes through the official OpenAI client and the gateway; every answer must
equal the same request alone and PyTorch's greedy answer with the PEFT adapter merged.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from runtime.bundle import open_bundle
from runtime.engine.tokenizer import Tokenizer
from tests.conftest import DEMO_FUNCTION
from tests.deploy_local.conftest import KEY_ENV, Workspace

NAME = "smollm2-lora"
KEY = "lora-e2e-key"
SYSTEM = "You are a helpful assistant."
MAX_TOKENS = 20
# Held out: none of these is in training.py's pairs.
PROMPTS = ("What is the capital of Italy?", "How many wheels does a bicycle have?", "What do cows eat?")


def _spec(upper: Path) -> str:
    text = (DEMO_FUNCTION / "function.toml").read_text()
    for old, new in (
        ('name = "smollm2-chat"', f'name = "{NAME}"'),
        ('precision = "auto"', 'precision = "fp32"\nadapter_modules = ["q_proj", "k_proj", "v_proj", "o_proj"]'),
        ("process_snapshot = true", "process_snapshot = false"),
    ):
        assert old in text, old
        text = text.replace(old, new)
    return f'{text}\n[[adapters]]\nname = "upper"\nsource = "{upper}"\n'


@pytest.fixture(scope="module")
def lora_bundle(peft_adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.packager.conftest import build_in

    root = tmp_path_factory.mktemp("smollm2-lora")
    folder = root / "functions" / NAME
    folder.mkdir(parents=True)
    (folder / "function.toml").write_text(_spec(peft_adapters["upper"]))
    return build_in(root, folder)


@pytest.fixture
def space(tmp_path: Path, lora_bundle: Path, peft_adapters: dict[str, Path]) -> Iterator[Workspace]:
    space = Workspace(tmp_path, lora_bundle)
    space.env[KEY_ENV] = KEY
    space.add_function(NAME, _spec(peft_adapters["upper"]), lora_bundle)
    yield space
    for state_file in [*space.state_root.glob("functions/*/state.json"), *space.state_root.glob("gateway/*.json")]:
        with contextlib.suppress(ProcessLookupError, KeyError, ValueError):
            os.killpg(json.loads(state_file.read_text())["pid"], signal.SIGKILL)


def test_the_build_records_the_bundled_adapters_parity_with_peft(lora_bundle: Path) -> None:
    figures = json.loads((lora_bundle / "quality.json").read_text())["adapters"]["upper"]
    assert figures["parity"]["identical_greedy"] == figures["parity"]["prompts"] == 8
    assert figures["rank"] == 8 and figures["modules"] == ["q_proj", "v_proj"]
    assert figures["quality"]["precision"] == "fp32" and figures["quality"]["failures"] == []


def test_base_and_two_adapters_in_one_batch_equal_pytorch_with_peft(
    space: Workspace, peft_adapters: dict[str, Path], smollm2_hf_dir: Path
) -> None:
    function = f"functions/{NAME}"
    deployed = space.pkg("deploy", function, "--target", "local")
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    pid = space.state(NAME)["pid"]
    added = space.pkg("adapter", "add", function, "french", str(peft_adapters["french"]))
    assert added.returncode == 0, added.stdout + added.stderr
    assert space.state(NAME)["pid"] == pid  # added to the running server, no restart

    client = openai.OpenAI(base_url=f"{space.gateway_url}/v1", api_key=KEY, max_retries=0, timeout=120)
    assert {m.id for m in client.models.list()} >= {NAME}
    jobs = [(adapter, prompt) for adapter in (None, "upper", "french") for prompt in PROMPTS[:2]]

    def chat(job: tuple[str | None, str]) -> str:
        adapter, prompt = job
        model = NAME if adapter is None else f"{NAME}:{adapter}"
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
        answer = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        assert answer.model == model
        return answer.choices[0].message.content or ""

    with ThreadPoolExecutor(len(jobs)) as pool:  # one concurrent batch: base, upper and french rows together
        together = list(pool.map(chat, jobs))
    alone = [chat(job) for job in jobs]
    assert together == alone

    expected = _pytorch_answers(lora_bundle_of(space), smollm2_hf_dir, peft_adapters, jobs)
    assert together == expected
    answers = list(zip(jobs, together, strict=True))
    by_adapter = {a: [t for (job_adapter, _), t in answers if job_adapter == a] for a, _ in jobs}
    assert by_adapter["upper"] != by_adapter[None] != by_adapter["french"]  # test_training.py checks what they learnt
    assert any(sum(c.isupper() for c in t) > sum(c.islower() for c in t) for t in by_adapter["upper"]), by_adapter
    with pytest.raises(openai.NotFoundError, match="french"):  # the 404 lists what is there
        client.chat.completions.create(model=f"{NAME}:german", messages=[{"role": "user", "content": "Hi"}])


def lora_bundle_of(space: Workspace) -> Path:
    return (space.root / "build" / NAME / "bundle").resolve()


def _pytorch_answers(
    bundle_path: Path, hf_dir: Path, adapters: dict[str, Path], jobs: list[tuple[str | None, str]]
) -> list[str]:
    """Greedy answers of PyTorch with each PEFT adapter merged, from the same prompt token ids the server used."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    facts = open_bundle(bundle_path, verify=False).manifest.decoder
    tokenizer = Tokenizer(bundle_path / "tokenizer.json", facts.chat_template, facts.bos_token_id, facts.eos_token_ids)
    torch.set_num_threads(1)
    answers: dict[tuple[str | None, str], str] = {}
    for adapter in dict.fromkeys(a for a, _ in jobs):
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, str(adapters[adapter])).merge_and_unload()
        model.eval()
        for job_adapter, prompt in jobs:
            if job_adapter != adapter:
                continue
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
            ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))  # as chat.py
            with torch.inference_mode():
                out = model.generate(
                    torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                    eos_token_id=list(facts.eos_token_ids), pad_token_id=facts.pad_token_id,
                )  # fmt: skip
            new = [t for t in out[0, len(ids) :].tolist() if t not in facts.eos_token_ids]
            answers[(adapter, prompt)] = tokenizer.decode(new)
    return [answers[job] for job in jobs]
