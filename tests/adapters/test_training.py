"""The two test adapters (training.py) are real: each visibly changes the demo model's answers as it was trained to."""

from __future__ import annotations

import json
import re
from pathlib import Path

HELD_OUT = (  # none of these is in training.py's data
    "What is the tallest mountain in the world?",
    "How do plants grow?",
    "Tell me something about dogs.",
)
FRENCH_WORDS = {"le", "la", "les", "est", "et", "de", "un", "une", "je", "vous", "bonjour"}
NEW_TOKENS = 24


def _answers(hf_dir: Path, adapter: Path | None) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    answers = []
    for question in HELD_OUT:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        answers.append(tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
    return answers


def _upper_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / max(len(letters), 1)


def _french_words(text: str) -> set[str]:
    return FRENCH_WORDS & set(re.findall(r"[a-zà-ÿ]+", text.lower()))


def test_adapters_change_the_answers_as_trained(smollm2_hf_dir: Path, peft_adapters: dict[str, Path]) -> None:
    from safetensors import safe_open

    for name, folder in peft_adapters.items():
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA", name
        with safe_open(str(folder / "adapter_model.safetensors"), "pt") as weights:
            dtypes = {str(weights.get_slice(key).get_dtype()) for key in weights.keys()}  # noqa: SIM118
        assert dtypes == {"F32"}, (name, dtypes)

    base = _answers(smollm2_hf_dir, None)
    upper = _answers(smollm2_hf_dir, peft_adapters["upper"])
    french = _answers(smollm2_hf_dir, peft_adapters["french"])
    for question, plain, shouting, translated in zip(HELD_OUT, base, upper, french, strict=True):
        context = f"{question!r}: base {plain!r}, upper {shouting!r}, french {translated!r}"
        assert _upper_share(plain) < 0.5, context
        assert len(_french_words(plain)) < 2, context
        assert _upper_share(shouting) > 0.8, context
        assert len(_french_words(translated)) >= 2, context
        assert translated != plain, context
