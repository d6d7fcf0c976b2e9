"""The throughput figures: decode, prefill/TTFT and concurrency, measured on long-lived workers.

Every figure is taken in interleaved rounds: one round runs each system once (in an order rotated
round by round), each job starting once the cores are quiet, the first round is a warm-up and is
discarded, and the reported value is the median over rounds. A system that fails is recorded with its
error and skipped for the rest of the figure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from packager.bench.machine import wait_until_quiet
from packager.bench.pool import Worker, WorkerError
from packager.bench.prompts import PromptFactory
from packager.bench.stats import median, percentile

WARMUP_ROUNDS = 1


@dataclass(frozen=True)
class Plan:
    repetitions: int
    decode_prompt: int
    decode_tokens: int
    prefill_lengths: tuple[int, ...]
    concurrency_levels: tuple[int, ...]
    concurrency_prompt: int
    concurrency_tokens: int


def interleave(
    workers: list[Worker], repetitions: int, job: Callable[[Worker, int], dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Run `job(worker, round)` for every worker, round after round; collect per-worker samples."""
    samples: dict[str, list[dict[str, Any]]] = {w.name: [] for w in workers}
    errors: dict[str, str] = {}
    for round_index in range(WARMUP_ROUNDS + repetitions):
        shift = round_index % len(workers)
        for worker in workers[shift:] + workers[:shift]:
            if worker.name in errors:
                continue
            wait_until_quiet()  # the previous system's leftover threads must not run into this one's figures
            try:
                sample = job(worker, round_index)
            except WorkerError as exc:
                errors[worker.name] = str(exc)
                continue
            if round_index >= WARMUP_ROUNDS:
                samples[worker.name].append(sample)
    results: dict[str, dict[str, Any]] = {name: {"samples": s} for name, s in samples.items() if name not in errors}
    results.update({name: {"error": message} for name, message in errors.items()})
    return results


def decode_rate(stream: dict[str, Any]) -> float:
    """Tokens per second after the first token: the decode phase alone, prefill excluded."""
    return (stream["tokens"] - 1) / (stream["last"] - stream["first"])


def measure_decode(workers: list[Worker], prompts: PromptFactory, plan: Plan) -> dict[str, Any]:
    rounds = [prompts.take(plan.decode_prompt) for _ in range(WARMUP_ROUNDS + plan.repetitions)]

    def job(worker: Worker, round_index: int) -> dict[str, Any]:
        (stream,) = worker.run([rounds[round_index]], plan.decode_tokens)
        if stream["tokens"] != plan.decode_tokens:
            raise WorkerError(f"{worker.name} produced {stream['tokens']} tokens, not {plan.decode_tokens}")
        return {"tok_s": decode_rate(stream), "ttft_s": stream["first"], "token_ids": stream.get("token_ids", [])}

    results = interleave(workers, plan.repetitions, job)
    for result in results.values():
        if "samples" in result:
            result["tok_s"] = median([s["tok_s"] for s in result["samples"]])
            result["ttft_s"] = median([s["ttft_s"] for s in result["samples"]])
            result["token_ids"] = result["samples"][0]["token_ids"]
    return {"prompt_tokens": plan.decode_prompt, "new_tokens": plan.decode_tokens, "systems": results}


def measure_prefill(workers: list[Worker], prompts: PromptFactory, plan: Plan) -> dict[str, Any]:
    figures = {}
    for length in plan.prefill_lengths:
        rounds = [prompts.take(length) for _ in range(WARMUP_ROUNDS + plan.repetitions)]

        def job(worker: Worker, round_index: int, rounds: list = rounds, length: int = length) -> dict[str, Any]:
            (stream,) = worker.run([rounds[round_index]], 1)
            # Each round's rate too: the report pairs rounds on it.
            return {"ttft_s": stream["first"], "tok_s": length / stream["first"]}

        results = interleave(workers, plan.repetitions, job)
        for result in results.values():
            if "samples" in result:
                result["ttft_s"] = median([s["ttft_s"] for s in result["samples"]])
                result["tok_s"] = length / result["ttft_s"]
        figures[str(length)] = results
    return {"lengths": list(plan.prefill_lengths), "systems_by_length": figures}


def measure_concurrency(workers: list[Worker], prompts: PromptFactory, plan: Plan) -> dict[str, Any]:
    figures = {}
    for level in plan.concurrency_levels:
        able = [w for w in workers if w.max_streams >= level]
        rounds = [prompts.batch(level, plan.concurrency_prompt) for _ in range(WARMUP_ROUNDS + plan.repetitions)]

        def job(worker: Worker, round_index: int, rounds: list = rounds) -> dict[str, Any]:
            streams = worker.run(rounds[round_index], plan.concurrency_tokens)
            tokens = sum(s["tokens"] for s in streams)
            return {
                "aggregate_tok_s": tokens / max(s["last"] for s in streams),
                "ttft_s": [s["first"] for s in streams],
                "tpot_s": [(s["last"] - s["first"]) / (s["tokens"] - 1) for s in streams],
            }

        results = interleave(able, plan.repetitions, job) if able else {}
        for result in results.values():
            if "samples" in result:
                ttft = [t for s in result["samples"] for t in s["ttft_s"]]
                tpot = [t for s in result["samples"] for t in s["tpot_s"]]
                result.update(
                    aggregate_tok_s=median([s["aggregate_tok_s"] for s in result["samples"]]),
                    ttft_p50_s=percentile(ttft, 50),
                    ttft_p99_s=percentile(ttft, 99),
                    tpot_p50_s=percentile(tpot, 50),
                    tpot_p99_s=percentile(tpot, 99),
                )
        for worker in workers:
            if worker.max_streams < level:
                results[worker.name] = {"unsupported": f"serves at most {worker.max_streams} stream(s) at once"}
        figures[str(level)] = results
    return {
        "levels": list(plan.concurrency_levels),
        "prompt_tokens": plan.concurrency_prompt,
        "new_tokens": plan.concurrency_tokens,
        "systems_by_level": figures,
    }
