"""transformers fp32 on PyTorch CPU: the naive baseline (`generate`, batched when streams > 1)."""

from __future__ import annotations

from typing import cast

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

from packager.bench.systems.base import PromptSpec, StreamTiming, SystemConfig, now, process_memory, timings_from_marks


class _TokenClock(StoppingCriteria):
    """Called once per generated token for the whole batch: records when each token existed."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: object) -> torch.BoolTensor:
        self.marks.append(now())
        # transformers' own criteria return plain bool tensors too; BoolTensor is only its annotation's name for one
        return cast(torch.BoolTensor, torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device))


class TransformersSystem:
    def __init__(self, config: SystemConfig) -> None:
        self.max_streams = config.max_batch
        torch.set_num_threads(config.threads)
        self._hf_dir = config.hf_dir
        self._model = AutoModelForCausalLM.from_pretrained(config.hf_dir, dtype=torch.float32).eval()

    def _generate(self, input_ids: torch.Tensor, max_tokens: int) -> tuple[torch.Tensor, list[float]]:
        clock = _TokenClock()
        with torch.inference_mode():
            output = self._model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,  # EOS suppressed: ignore_eos
                do_sample=False,
                pad_token_id=self._model.config.eos_token_id,
                stopping_criteria=StoppingCriteriaList([clock]),
            )
        return output, clock.marks

    def run(self, prompts: list[PromptSpec], max_tokens: int) -> list[StreamTiming]:
        start = now()
        input_ids = torch.tensor([p.ids for p in prompts], dtype=torch.long)
        output, marks = self._generate(input_ids, max_tokens)
        rows = output[:, input_ids.shape[1] :].tolist()
        return [timings_from_marks(start, marks, row) for row in rows]

    def first_token(self, text: str) -> dict[str, float]:
        tokenizer = AutoTokenizer.from_pretrained(self._hf_dir)
        input_ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        tokenized = now()
        _, marks = self._generate(input_ids, 1)
        return {"tokenizer": tokenized, "first_token": marks[0]}

    def memory(self) -> dict[str, float]:
        return process_memory()

    def close(self) -> None:
        del self._model
