"""The `ray` target's figures: what Ray Serve's proxy costs against the local gateway, and how soon a function
scaled to zero answers again.

    .venv/bin/python scripts/bench.py --sections ray --out bench/ray [--quick]

The bench's function is deployed twice by the real `pkg`, into a scratch folder without an API key: `local`
(`--target local`, never idle, behind the gateway on a free port) and `ray` (`--target ray` without an
address: the local Ray head `pkg` starts, one replica with the same engine settings and `num_cpus` =
`runtime.threads`, the bundle from a shared folder store). Then, in interleaved rounds (order swapped each
round, the first discarded, fresh prompts every run so the prefix cache never helps):

- **8 streams**: 8 streamed completions at once through each door; the figure is the median aggregate
  tokens/s and the paired rounds' median ratio ray / local with its interval.
- **Added time to first token**: one stream, warm replica and warm server; the median of each round's
  difference ray - local.
- **Wake from zero**: the ray function redeployed with `min_replicas = 0` and `idle_timeout = 1`; each round
  waits until Serve has removed the replica (`pkg status` says `idle`), then times one streamed completion
  from the request to its first token: replica start, bundle from the node's cache, model load, prefill.
  The local gateway's own wake figures (bench/gateway/results.json) stand beside it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from packager.bench.machine import wait_until_quiet
from packager.bench.models import BenchModel
from packager.bench.prompts import PromptFactory
from packager.bench.sections import WARMUP_ROUNDS, Plan
from packager.bench.stats import median, median_interval, percentile
from packager.targets.local.server_process import free_port, rss_bytes

STREAMS = 8
MIN_TOKENS = 64
IDLE_WAIT = 120.0  # Serve's autoscaler decides on averaged metrics: removing the last replica takes a while
REPO = Path(__file__).resolve().parents[2]


class Deployments:
    """`local` and `ray` in a scratch folder; `close` destroys both (which stops the Ray head) and the gateway."""

    def __init__(self, scratch: Path, model: BenchModel) -> None:
        self.scratch = scratch
        self.env = {
            **os.environ, "XDG_STATE_HOME": str(scratch / "xdg"), "ONNXFN_GATEWAY_PORT": str(free_port("127.0.0.1")),
            "COLUMNS": "250",
        }  # fmt: skip
        self.source = (model.spec.directory / "function.toml").read_text()
        self.threads = model.spec.runtime.threads
        for name in ("local", "ray"):
            (scratch / "build" / name).mkdir(parents=True)
            (scratch / "build" / name / "bundle").symlink_to(model.bundle)
        self.write("local", "[targets.local]\nprocess_snapshot = false\nidle_timeout = 0\n")
        self.write_ray(min_replicas=1)

    def write(self, name: str, table: str) -> None:
        """The bench function's spec under `name`, without a key, its own targets tables replaced by `table`."""
        text = re.sub(r"(?m)^name\s*=.*$", f'name = "{name}"', _without_targets(self.source))
        text = re.sub(r"(?m)^api_key_env\s*=.*\n", "", text)
        folder = self.scratch / "functions" / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "function.toml").write_text(f"{text}\n{table}")

    def write_ray(self, *, min_replicas: int, idle_timeout: int = 300) -> None:
        self.write("ray", f"[targets.ray]\nmin_replicas = {min_replicas}\nmax_replicas = 1\nnum_cpus = {self.threads}\n"
                          f"idle_timeout = {idle_timeout}\nhttp_port = {free_port('127.0.0.1')}\n")  # fmt: skip

    def pkg(self, *args: str) -> str:
        command = [sys.executable, "-m", "packager.cli", *args]
        done = subprocess.run(command, cwd=self.scratch, env=self.env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"pkg {' '.join(args)} failed: {done.stderr.strip()[-2000:]}")
        return done.stdout

    def deploy(self, name: str) -> dict[str, Any]:
        target = "ray" if name == "ray" else "local"
        return dict(json.loads(self.pkg("deploy", f"functions/{name}", "--target", target, "--json")))

    def status(self, name: str) -> dict[str, Any]:
        (row,) = json.loads(self.pkg("status", f"functions/{name}", "--target", name, "--json"))
        return dict(row)

    def wait_idle(self) -> None:
        deadline = time.monotonic() + IDLE_WAIT
        while self.status("ray")["state"] != "idle":
            if time.monotonic() > deadline:
                raise RuntimeError(f"Serve kept the replica for {IDLE_WAIT:.0f} s after idle_timeout")
            time.sleep(0.5)

    def close(self) -> None:
        for name in ("ray", "local"):
            target = "ray" if name == "ray" else "local"
            subprocess.run([sys.executable, "-m", "packager.cli", "destroy", f"functions/{name}", "--target", target],
                           cwd=self.scratch, env=self.env, capture_output=True, timeout=300, check=False)  # fmt: skip
        subprocess.run([sys.executable, "-m", "packager.cli", "gateway", "stop"], env=self.env, capture_output=True,
                       timeout=60, check=False)  # fmt: skip


def _without_targets(source: str) -> str:
    kept, inside = [], False
    for line in source.splitlines(keepends=True):
        if line.startswith("["):
            inside = line.startswith("[targets.")
        if not inside:
            kept.append(line)
    return "".join(kept)


def measure(model: BenchModel, prompts: PromptFactory, plan: Plan) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as scratch:
        functions = Deployments(Path(scratch), model)
        try:
            urls = {"local": functions.deploy("local")["url"], "ray": functions.deploy("ray")["url"]}
            return _measure(functions, urls, prompts, plan)
        except (RuntimeError, OSError, ValueError) as exc:
            return {"error": str(exc)}
        finally:
            functions.close()


def _measure(functions: Deployments, urls: dict[str, str], prompts: PromptFactory, plan: Plan) -> dict[str, Any]:
    from packager.bench.serving import run_streams  # aiohttp, a bench peer: the report imports this module too

    tokens = max(plan.concurrency_tokens, MIN_TOKENS)
    streams: dict[str, list[float]] = {"local": [], "ray": []}
    first: dict[str, list[float]] = {"local": [], "ray": []}
    for index in range(WARMUP_ROUNDS + max(2 * plan.repetitions, 6)):
        for door in ("local", "ray") if index % 2 == 0 else ("ray", "local"):
            wait_until_quiet()
            body: dict[str, object] = {"model": door, "ignore_eos": True, "stream_options": {"include_usage": True}}
            (one,) = asyncio.run(run_streams(urls[door], [prompts.take(plan.decode_prompt).text], 2, body))
            texts = [prompt.text for prompt in prompts.batch(STREAMS, plan.concurrency_prompt)]
            many = asyncio.run(run_streams(urls[door], texts, tokens, body))
            if index >= WARMUP_ROUNDS:
                first[door].append(one.first)
                streams[door].append(sum(s.tokens for s in many) / max(s.last for s in many))
    ratios = [r / loc for r, loc in zip(streams["ray"], streams["local"], strict=True)]
    added = [1000 * (r - loc) for r, loc in zip(first["ray"], first["local"], strict=True)]
    replica_rss = _replica_rss(functions)
    return {
        "streams": STREAMS,
        "tokens_per_stream": tokens,
        "local_tok_s": median(streams["local"]),
        "ray_tok_s": median(streams["ray"]),
        "paired_ratio": {"median": median(ratios), "interval": median_interval(ratios)},
        "first_token_ms": {door: 1000 * median(samples) for door, samples in first.items()},
        "added_ttft_ms": {"median": median(added), "interval": median_interval(added)},
        "replica_rss_bytes": replica_rss,
        "wake": _wake(functions, urls["ray"], prompts, plan),
        "local_wake_s": _local_wake(),
        "samples": {"streams": streams, "first_token_s": first},
    }


def _wake(functions: Deployments, url: str, prompts: PromptFactory, plan: Plan) -> dict[str, Any]:
    from packager.bench.serving import run_streams

    functions.write_ray(min_replicas=0, idle_timeout=1)
    functions.deploy("ray")
    body: dict[str, object] = {"model": "ray", "ignore_eos": True, "stream_options": {"include_usage": True}}
    samples = []
    for _ in range(max(plan.repetitions, 3)):
        functions.wait_idle()
        wait_until_quiet()
        (stream,) = asyncio.run(run_streams(url, [prompts.take(plan.decode_prompt).text], 2, body))
        samples.append(stream.first)
    return {"median": median(samples), "p90": percentile(samples, 90), "samples": samples}


def _replica_rss(functions: Deployments) -> int | None:
    """The replica's resident memory: its pid is in Serve's record, which `pkg status` does not show; the
    process whose title Ray set to the replica's."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                title = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if title.startswith(b"ray::ServeReplica:ray:ray"):
                return rss_bytes(int(entry.name))
    return None


def _local_wake() -> dict[str, float] | None:
    """The local gateway's wake (from its process snapshot, and fresh) as the committed gateway bench has it."""
    try:
        wake = json.loads((REPO / "bench" / "gateway" / "results.json").read_text())["gateway"]["wake_first_token_s"]
        return {kind: float(wake[kind]["median"]) for kind in ("snapshot", "fresh")}
    except (OSError, KeyError, TypeError, ValueError):
        return None


def render(results: dict[str, Any]) -> str:
    figures = results["ray"]
    if "error" in figures:
        return f"## Ray Serve target\n\nnot measured: {figures['error']}\n"
    low, high = figures["paired_ratio"]["interval"]
    added_low, added_high = figures["added_ttft_ms"]["interval"]
    wake = figures["wake"]
    local_wake = figures["local_wake_s"]
    beside = (
        f"; the local gateway (bench/gateway): {local_wake['snapshot']:.2f} s from its process snapshot, "
        f"{local_wake['fresh']:.2f} s fresh"
        if local_wake is not None
        else ""
    )
    rss = figures["replica_rss_bytes"]
    rows = [
        (f"{figures['streams']} streams x {figures['tokens_per_stream']} tokens through the local gateway",
         f"{figures['local_tok_s']:,.1f} tok/s", ""),
        (f"{figures['streams']} streams through Ray Serve's proxy", f"{figures['ray_tok_s']:,.1f} tok/s: "
         f"{figures['paired_ratio']['median']:.3f}x (95 % interval {low:.3f} to {high:.3f})", "≥ 0.85x"),
        ("first token, one stream, warm", f"local {figures['first_token_ms']['local']:.1f} ms, ray "
         f"{figures['first_token_ms']['ray']:.1f} ms", ""),
        ("added time to first token through Ray Serve", f"{figures['added_ttft_ms']['median']:+.1f} ms (95 % "
         f"interval {added_low:+.1f} to {added_high:+.1f})", "≤ 15 ms"),
        ("wake from zero replicas → first token", f"{wake['median']:.2f} s median (p90 {wake['p90']:.2f}, "
         f"{len(wake['samples'])} runs){beside}", "reported"),
        ("replica RSS (warm)", f"{rss / 2**20:,.0f} MiB" if rss else "not found", ""),
    ]  # fmt: skip
    lines = ["## Ray Serve target (issue 50)", "", "| figure | value | target |", "|---|---|---|"]
    lines += [f"| {label} | {value} | {goal} |" for label, value, goal in rows]
    return "\n".join(lines) + "\n"
