"""llama.cpp through llama-cpp-python, in-process, on the function's own GGUF (one sequence at a time)."""

from __future__ import annotations

from collections.abc import Callable

import llama_cpp
from llama_cpp import Llama

from packager.bench.systems.base import (
    PromptSpec,
    StreamTiming,
    SystemConfig,
    now,
    process_memory,
    timings_from_marks,
)


def gguf_tokenizer(gguf: str) -> Callable[[str], list[int]]:
    """llama.cpp's own tokenizer for `gguf` (vocabulary only), as its server tokenizes a text prompt: with the
    `<bos>` the file asks for (Gemma's; SmolLM2's asks for none)."""
    vocab = Llama(model_path=gguf, vocab_only=True, verbose=False)
    return lambda text: vocab.tokenize(text.encode(), add_bos=True, special=True)


def end_tokens(gguf: str) -> list[int]:
    """Every token llama.cpp ends a generation at: the file's EOS and the end-of-turn markers it recognises by
    name (SmolLM2: <|endoftext|>, <|im_end|> and one more; Gemma: <eos>, <end_of_turn> and one more)."""
    model = Llama(model_path=gguf, vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(model.model)
    return [token for token in range(model.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, token)]


class LlamaCppSystem:
    def __init__(self, config: SystemConfig) -> None:
        self.max_streams = 1
        # Default settings: the AMX/repack crash in FIELD-NOTES needs AMX kernels, which scripts/setup_bench.sh
        # compiles only where its probe ran AMX instructions; llama.cpp repacks no Q4_1 tensor anyway.
        self._llama = Llama(
            model_path=config.gguf,
            n_ctx=config.max_context,
            n_threads=config.threads,
            n_threads_batch=config.threads,
            verbose=False,
        )

    def _stream(self, ids: list[int], max_tokens: int) -> tuple[list[float], list[int]]:
        # reset() forgets the previous prompt, so no prefix of it is reused: every run prefills fully.
        self._llama.reset()
        marks: list[float] = []
        tokens: list[int] = []
        # generate() never stops at EOS by itself (create_completion does): ignore_eos for free.
        for token in self._llama.generate(ids, temp=0.0, repeat_penalty=1.0, reset=True):
            marks.append(now())
            tokens.append(token)
            if len(tokens) == max_tokens:
                break
        return marks, tokens

    def run(self, prompts: list[PromptSpec], max_tokens: int) -> list[StreamTiming]:
        if len(prompts) != 1:
            raise ValueError("llama-cpp-python's Llama runs one sequence at a time")
        start = now()
        marks, tokens = self._stream(prompts[0].ids, max_tokens)
        return [timings_from_marks(start, marks, tokens)]

    def first_token(self, text: str) -> dict[str, float]:
        ids = self._llama.tokenize(text.encode(), add_bos=False, special=False)
        tokenized = now()
        marks, _ = self._stream(ids, 1)
        return {"tokenizer": tokenized, "first_token": marks[0]}

    def memory(self) -> dict[str, float]:
        return process_memory()

    def close(self) -> None:
        self._llama.close()
