"""Constrained decoding overhead: JSON-schema decode tokens/s against unconstrained, batch 1 and 8.

    .venv/bin/python scripts/bench_structured.py [BUNDLE] [--tokens 64] [--repeats 5]

Both modes generate exactly `--tokens` tokens per sequence (greedy, `ignore_eos`; the schema is an
array with `minItems` far beyond that, so the grammar never ends early) from the same prompts, with
repetitions interleaved; decode tokens/s counts decode steps only (no prefill). The mask time is
llguidance's bitmask fill plus applying it plus advancing the matchers, per step and per row.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from runtime.bundle import open_bundle
from runtime.engine import constraints, sampling
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.reports import StepReport
from runtime.engine.request import GenerationRequest, SamplingParams

DEFAULT_BUNDLE = Path(__file__).resolve().parents[1] / "build" / "smollm2-chat" / "bundle"
SCHEMA = {
    "type": "array",
    "minItems": 1000,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    },
}
QUESTIONS = [f"Describe {n} people as JSON." for n in ("three", "four", "five", "six", "seven", "eight", "two", "ten")]


class MaskClock:
    """Times the engine's constraint hooks by wrapping the functions sampling.py calls."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.rows = 0
        self.calls = 0

    def wrap(self, function: Callable[..., None], counts_rows: bool) -> Callable[..., None]:
        def timed(*args: Any) -> None:
            started = time.perf_counter()
            function(*args)
            self.seconds += time.perf_counter() - started
            if counts_rows:
                self.rows += len(args[1])
                self.calls += 1

        return timed


def run(engine: Engine, steps: list[StepReport], batch: int, tokens: int, grammar: str | None) -> float:
    """Decode tokens/s of `batch` concurrent sequences of `tokens` tokens each."""
    tokenizer = engine.tokenizer
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, grammar=grammar)
    streams = []
    for i in range(batch):
        prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i]}]))
        streams.append(engine.submit(GenerationRequest(f"r{time.monotonic_ns()}-{i}", tuple(prompt), params)))
    steps.clear()
    for stream in streams:
        for _ in stream:
            pass
    decode = [s for s in steps if s.prefill_tokens == 0 and s.decode_tokens == batch]
    return sum(s.decode_tokens for s in decode) / sum(s.duration for s in decode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", nargs="?", type=Path, default=DEFAULT_BUNDLE)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    clock = MaskClock()
    sampling.mask_logits = clock.wrap(constraints.mask_logits, counts_rows=True)  # type: ignore[assignment]
    sampling.advance = clock.wrap(constraints.advance, counts_rows=False)  # type: ignore[assignment]
    steps: list[StepReport] = []
    engine = Engine(open_bundle(args.bundle), EngineConfig(max_batch=8, max_context=512), on_step=steps.append)
    engine.start()
    grammar = constraints.json_schema_grammar(SCHEMA)
    run(engine, steps, 8, 8, grammar)  # warm-up: llguidance import, tokenizer, grammar cache
    table = Table(title=f"JSON schema vs unconstrained, {args.tokens} greedy tokens, median of {args.repeats}")
    for column in ("batch", "unconstrained tok/s", "json_schema tok/s", "overhead", "mask ms/step", "mask µs/row"):
        table.add_column(column, justify="right")
    for batch in (1, 8):
        plain, constrained, mask_step, mask_row = [], [], [], []
        for _ in range(args.repeats):
            plain.append(run(engine, steps, batch, args.tokens, None))
            clock.seconds, clock.rows, clock.calls = 0.0, 0, 0
            constrained.append(run(engine, steps, batch, args.tokens, grammar))
            mask_step.append(clock.seconds / clock.calls)
            mask_row.append(clock.seconds / clock.rows)
        p, c = statistics.median(plain), statistics.median(constrained)
        table.add_row(
            str(batch),
            f"{p:.1f}",
            f"{c:.1f}",
            f"{(p / c - 1) * 100:+.1f} %",
            f"{statistics.median(mask_step) * 1e3:.2f}",
            f"{statistics.median(mask_row) * 1e6:.0f}",
        )
    engine.shutdown()
    Console().print(table)


if __name__ == "__main__":
    main()
