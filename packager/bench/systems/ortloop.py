"""A bare ONNX Runtime loop over the bundle's graph: the ceiling of any engine driven from Python.

It does only what every decoder loop must: the KV cache bound once as shared past/present buffers (as
onnxfn and onnxruntime-genai bind it), one run per token, a greedy argmax per row. It does nothing an
engine adds: no scheduling, no sampling options, no detokenization, no stop checks, no streaming to a
consumer on another thread. Its session has onnxfn's options, and prompts run as one static batch
through model.onnx (as genai runs them), so its decode figure is what onnxfn's engine would reach if
its own work per step cost nothing.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from packager.bench.systems.base import PromptSpec, StreamTiming, SystemConfig, now, process_memory, timings_from_marks
from packager.decoder_facts import decoder_facts
from runtime.bundle import open_bundle
from runtime.engine.session_build import SessionOptions, create_session


class OrtLoopSystem:
    def __init__(self, config: SystemConfig) -> None:
        self.max_streams = config.max_batch
        self._bundle = open_bundle(config.bundle, verify=False)
        self._facts = decoder_facts(self._bundle.manifest)
        self._session = create_session(self._bundle.model_path, SessionOptions(threads=config.threads), self._bundle)
        self._kv_names = self._facts.io.cache_names(self._facts.num_layers)

    def run(self, prompts: list[PromptSpec], max_tokens: int) -> list[StreamTiming]:
        lengths = {len(p.ids) for p in prompts}
        if len(lengths) != 1:
            raise ValueError("a static batch needs prompts of one length")
        start = now()
        rows, prompt_length, vocab = len(prompts), lengths.pop(), self._facts.vocab_size
        binding, cache = self._bind_cache(rows, prompt_length + max_tokens)
        ones = np.ones(rows * (prompt_length + max_tokens), dtype=np.int64)
        io = self._facts.io
        # The prompt through the whole graph, logits at every position (genai's prefill).
        binding.bind_cpu_input(io.input_ids, np.array([p.ids for p in prompts], dtype=np.int64))
        binding.bind_cpu_input(io.attention_mask, ones[: rows * prompt_length].reshape(rows, prompt_length))
        prompt_logits = np.empty((rows, prompt_length, vocab), dtype=np.float32)
        binding.bind_output(io.logits, "cpu", 0, np.float32, prompt_logits.shape, prompt_logits.ctypes.data)
        self._session.run_with_iobinding(binding)
        tokens = prompt_logits[:, -1].argmax(axis=-1)
        marks, rows_tokens = [now()], [tokens]
        ids = np.empty((rows, 1), dtype=np.int64)
        logits = np.empty((rows, 1, vocab), dtype=np.float32)
        binding.bind_input(io.input_ids, "cpu", 0, np.int64, ids.shape, ids.ctypes.data)
        binding.bind_output(io.logits, "cpu", 0, np.float32, logits.shape, logits.ctypes.data)
        for length in range(prompt_length + 1, prompt_length + max_tokens):
            ids[:, 0] = tokens
            binding.bind_input(io.attention_mask, "cpu", 0, np.int64, (rows, length), ones.ctypes.data)
            self._session.run_with_iobinding(binding)
            tokens = logits[:, 0].argmax(axis=-1)
            marks.append(now())
            rows_tokens.append(tokens)
        del cache  # the binding pointed into these buffers until here
        by_row = np.stack(rows_tokens, axis=1).tolist()
        return [timings_from_marks(start, marks, row) for row in by_row]

    def _bind_cache(self, rows: int, context: int) -> tuple[ort.IOBinding, list[np.ndarray]]:
        """A binding with a fresh KV buffer per tensor, `context` positions long, bound as past and present;
        the buffers must outlive the binding's runs."""
        facts = self._facts
        binding = self._session.io_binding()
        cache = [np.zeros((rows, facts.num_kv_heads, context, facts.head_dim), facts.kv_dtype) for _ in self._kv_names]
        for (past, present), buffer in zip(self._kv_names, cache, strict=True):
            value = ort.OrtValue.ortvalue_from_numpy(buffer)
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)
        return binding, cache

    def first_token(self, text: str) -> dict[str, float]:
        ids = Tokenizer.from_file(str(self._bundle.tokenizer_path)).encode(text).ids
        tokenized = now()
        self.run([PromptSpec(ids=ids, text=text)], 1)
        return {"tokenizer": tokenized, "first_token": now()}

    def memory(self) -> dict[str, float]:
        return process_memory()

    def close(self) -> None:
        del self._session
