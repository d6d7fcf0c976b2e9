"""onnxruntime-genai on a folder with a genai_config.json (the bundle or a builder export): batch 1, static batch."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime_genai as og

from packager.bench.systems.base import PromptSpec, StreamTiming, SystemConfig, now, process_memory, timings_from_marks


class GenaiSystem:
    def __init__(self, config: SystemConfig) -> None:
        self.max_streams = config.max_batch
        genai_config = og.Config(config.bundle)
        options = {"intra_op_num_threads": config.threads, "inter_op_num_threads": 1}
        genai_config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
        self._model = og.Model(genai_config)

    def run(self, prompts: list[PromptSpec], max_tokens: int) -> list[StreamTiming]:
        """A static batch: every row shares one generator, so every row's tokens arrive together."""
        lengths = {len(p.ids) for p in prompts}
        if len(lengths) != 1:
            raise ValueError("a static batch needs prompts of one length")
        prompt_len = lengths.pop()
        total = prompt_len + max_tokens
        start = now()
        params = og.GeneratorParams(self._model)
        # min_length == max_length: EOS cannot end a row early (ignore_eos).
        params.set_search_options(max_length=total, min_length=total, do_sample=False, batch_size=len(prompts))
        generator = og.Generator(self._model, params)
        generator.append_tokens(np.array([p.ids for p in prompts], dtype=np.int32))
        marks = []
        for _ in range(max_tokens):
            generator.generate_next_token()
            marks.append(now())
        rows = [generator.get_sequence(i)[prompt_len:].tolist() for i in range(len(prompts))]
        return [timings_from_marks(start, marks, row) for row in rows]

    def first_token(self, text: str) -> dict[str, float]:
        tokenizer = og.Tokenizer(self._model)
        ids = tokenizer.encode(text)
        tokenized = now()
        params = og.GeneratorParams(self._model)
        params.set_search_options(max_length=len(ids) + 1, do_sample=False)
        generator = og.Generator(self._model, params)
        generator.append_tokens(ids)
        generator.generate_next_token()
        return {"tokenizer": tokenized, "first_token": now()}

    def memory(self) -> dict[str, float]:
        return process_memory()

    def close(self) -> None:
        del self._model
