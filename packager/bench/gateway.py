"""The gateway figures: what an idle function costs, how soon it answers again, and what the hop costs.

    .venv/bin/python scripts/bench.py --sections gateway [--quick]

The bench's function is deployed three times by the real `pkg deploy --target local`, into a scratch state
folder with its own gateway on a free port and no API key: `snapshot` (`process_snapshot`, `idle_timeout`
1 s), `fresh` (no snapshot, `idle_timeout` 1 s) and `steady` (never idle). Then:

- **Idle RSS**: each idle function's resident memory as `pkg ps --json` reports it (0: it has no process),
  beside its RSS when ready and the gateway's own.
- **Wake → first token**: a streamed completion through the gateway to a function the gateway has stopped,
  from the request to its first token; rounds alternate `snapshot` and `fresh`, each waiting until the
  gateway stopped the function. `running` is the same request to a function that runs.
- **The hop**: 8 streams at once straight to `steady`'s own port and through the gateway, in interleaved
  rounds (order swapped each round, the first discarded, fresh prompts every run: no prefix-cache help);
  the figure is the median aggregate tokens/s, the cost `1 - through / direct`, and the paired rounds'
  median ratio with its interval; beside it the gateway's CPU time per relayed token against the server's
  (from /proc), which a machine shared with other work disturbs less.
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

NAMES = {"snapshot": (True, 1), "fresh": (False, 1), "steady": (False, 0)}  # process_snapshot, idle_timeout
STREAMS = 8
MIN_TOKENS = 64  # per stream in the hop rounds: enough decode for a 3 % difference to show
IDLE_WAIT = 30.0
GOALS = {"idle_rss_mib": 0.0, "wake_snapshot_s": 0.5, "hop_cost_pct": 3.0}


class Deployments:
    """The three functions and their gateway, in a scratch folder; `close` destroys them and stops it."""

    def __init__(self, scratch: Path, model: BenchModel) -> None:
        self.scratch = scratch
        self.state = scratch / "xdg" / "onnxfn"
        self.env = {
            **os.environ, "XDG_STATE_HOME": str(scratch / "xdg"), "ONNXFN_GATEWAY_PORT": str(free_port("127.0.0.1")),
            "COLUMNS": "250",
        }  # fmt: skip
        source = (model.spec.directory / "function.toml").read_text()
        for name, (snapshot, idle) in NAMES.items():
            folder = scratch / "functions" / name
            folder.mkdir(parents=True)
            (folder / "function.toml").write_text(_spec(source, name, snapshot, idle))
            (scratch / "build" / name).mkdir(parents=True)
            (scratch / "build" / name / "bundle").symlink_to(model.bundle)

    def pkg(self, *args: str) -> str:
        command = [sys.executable, "-m", "packager.cli", *args]
        done = subprocess.run(command, cwd=self.scratch, env=self.env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"pkg {' '.join(args)} failed: {done.stderr.strip()[-2000:]}")
        return done.stdout

    def deploy(self) -> None:
        for name in NAMES:
            self.pkg("deploy", f"functions/{name}")

    def processes(self) -> dict[str, dict[str, Any]]:
        return {row["name"]: row for row in json.loads(self.pkg("ps", "--json"))}

    def record(self, name: str) -> dict[str, Any]:
        (state_file,) = self.state.glob(f"functions/{name}-*/state.json")
        return dict(json.loads(state_file.read_text()))

    def gateway(self) -> dict[str, Any]:
        return dict(json.loads((self.state / "gateway" / "gateway.json").read_text()))

    def wait_idle(self, name: str) -> None:
        deadline = time.monotonic() + IDLE_WAIT
        while self.record(name).get("idle_since") is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not stop {name} within {IDLE_WAIT:.0f} s")
            time.sleep(0.1)

    def close(self) -> None:
        for name in NAMES:
            subprocess.run([sys.executable, "-m", "packager.cli", "destroy", f"functions/{name}"], cwd=self.scratch,
                           env=self.env, capture_output=True, timeout=120, check=False)  # fmt: skip
        subprocess.run([sys.executable, "-m", "packager.cli", "gateway", "stop"], env=self.env, capture_output=True,
                       timeout=60, check=False)  # fmt: skip


def _spec(source: str, name: str, snapshot: bool, idle: int) -> str:
    """The bench function's spec under another name, with no key, and the idle settings of this variant."""
    text = re.sub(r"(?m)^name\s*=.*$", f'name = "{name}"', source)
    text = re.sub(r"(?m)^(api_key_env|process_snapshot|idle_timeout)\s*=.*\n", "", text)
    settings = f"process_snapshot = {'true' if snapshot else 'false'}\nidle_timeout = {idle}\n"
    if "[targets.local]" in text:
        return text.replace("[targets.local]\n", f"[targets.local]\n{settings}", 1)
    return f"{text}\n[targets.local]\n{settings}"


def _first_token(url: str, name: str, text: str) -> float:
    from packager.bench.serving import run_streams  # aiohttp, a bench peer: the report imports this module too

    body = {"model": name, "ignore_eos": True, "stream_options": {"include_usage": True}}
    (stream,) = asyncio.run(run_streams(url, [text], 2, body))
    return stream.first


def measure(model: BenchModel, prompts: PromptFactory, plan: Plan) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as scratch:
        functions = Deployments(Path(scratch), model)
        try:
            functions.deploy()
            return _measure(functions, prompts, plan)
        except (RuntimeError, OSError, ValueError) as exc:
            return {"error": str(exc)}
        finally:
            functions.close()


def _measure(functions: Deployments, prompts: PromptFactory, plan: Plan) -> dict[str, Any]:
    gateway = functions.gateway()
    url = f"http://127.0.0.1:{gateway['port']}"
    running_rss = functions.processes()["steady"]["rss_bytes"]  # the same bundle, never idle
    rounds = max(plan.repetitions, 5)
    wake: dict[str, list[float]] = {"snapshot": [], "fresh": [], "running": []}
    for index in range(WARMUP_ROUNDS + rounds):
        for name in ("snapshot", "fresh") if index % 2 == 0 else ("fresh", "snapshot"):
            functions.wait_idle(name)
            woken = _first_token(url, name, prompts.take(plan.decode_prompt).text)
            running = _first_token(url, name, prompts.take(plan.decode_prompt).text)
            if index >= WARMUP_ROUNDS:
                wake[name].append(woken)
                wake["running"].append(running)
    functions.wait_idle("snapshot")
    functions.wait_idle("fresh")
    idle = functions.processes()
    results: dict[str, Any] = {
        "idle_rss_bytes": {name: idle[name]["rss_bytes"] for name in ("snapshot", "fresh")},
        "idle_states": {name: f"{idle[name]['state']} ({idle[name]['wake']})" for name in ("snapshot", "fresh")},
        "running_rss_bytes": running_rss,
        "gateway_rss_bytes": rss_bytes(int(gateway["pid"])),
        "wake_first_token_s": {name: _summary(samples) for name, samples in wake.items()},
        "hop": _hop(functions, url, prompts, plan),
    }
    return results


def _summary(samples: list[float]) -> dict[str, Any]:
    return {"median": median(samples), "p90": percentile(samples, 90), "samples": samples}


def _hop(functions: Deployments, gateway_url: str, prompts: PromptFactory, plan: Plan) -> dict[str, Any]:
    from packager.bench.serving import run_streams  # aiohttp, a bench peer: the report imports this module too

    server = functions.record("steady")
    routes = {"direct": server["url"], "gateway": gateway_url}
    pids = {"gateway": int(functions.gateway()["pid"]), "server": int(server["pid"])}
    tokens = max(plan.concurrency_tokens, MIN_TOKENS)
    body = {"model": "steady", "ignore_eos": True, "stream_options": {"include_usage": True}}
    samples: dict[str, list[float]] = {route: [] for route in routes}
    cpu = {"gateway": 0.0, "server": 0.0, "tokens": 0.0}  # over the rounds through the gateway
    for index in range(WARMUP_ROUNDS + max(2 * plan.repetitions, 6)):
        for route in list(routes) if index % 2 == 0 else list(routes)[::-1]:
            wait_until_quiet()
            texts = [prompt.text for prompt in prompts.batch(STREAMS, plan.concurrency_prompt)]
            before = {name: cpu_seconds(pid) for name, pid in pids.items()}
            streams = asyncio.run(run_streams(routes[route], texts, tokens, body))
            if index < WARMUP_ROUNDS:
                continue
            samples[route].append(sum(s.tokens for s in streams) / max(s.last for s in streams))
            if route == "gateway":
                for name, pid in pids.items():
                    cpu[name] += cpu_seconds(pid) - before[name]
                cpu["tokens"] += sum(s.tokens for s in streams)
    direct, through = median(samples["direct"]), median(samples["gateway"])
    ratios = [g / d for g, d in zip(samples["gateway"], samples["direct"], strict=True)]
    return {
        "streams": STREAMS,
        "tokens_per_stream": tokens,
        "direct_tok_s": direct,
        "gateway_tok_s": through,
        "cost_pct": 100 * (1 - through / direct),
        "paired_ratio": {"median": median(ratios), "interval": median_interval(ratios)},
        # The gateway's CPU per relayed token against the server's: what it takes from the engine's cores,
        # steadier than the throughput ratio on a machine shared with other work.
        "gateway_cpu_us_per_token": 1e6 * cpu["gateway"] / cpu["tokens"],
        "server_cpu_us_per_token": 1e6 * cpu["server"] / cpu["tokens"],
        "samples": samples,
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of `pid` (its threads included) from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def render(results: dict[str, Any]) -> str:
    figures = results["gateway"]
    if "error" in figures:
        return f"## Gateway\n\nnot measured: {figures['error']}\n"
    wake, hop = figures["wake_first_token_s"], figures["hop"]
    idle_mib = max(figures["idle_rss_bytes"].values()) / 2**20
    running = figures["running_rss_bytes"] / 2**20
    low, high = hop["paired_ratio"]["interval"]
    share = 100 * hop["gateway_cpu_us_per_token"] / hop["server_cpu_us_per_token"]
    rows = [
        ("idle function RSS", f"{idle_mib:,.0f} MiB ({', '.join(figures['idle_states'].values())}; running: "
         f"{running:,.0f} MiB)", "0"),
        ("gateway RSS", f"{(figures['gateway_rss_bytes'] or 0) / 2**20:,.0f} MiB", ""),
        ("wake → first token, process snapshot", _seconds(wake["snapshot"]), "≤ 0.5 s"),
        ("wake → first token, fresh start", _seconds(wake["fresh"]), "reported"),
        ("first token, function running (through the gateway)", _seconds(wake["running"]), ""),
        (f"{hop['streams']} streams x {hop['tokens_per_stream']} tokens, straight to the server",
         f"{hop['direct_tok_s']:,.1f} tok/s", ""),
        (f"{hop['streams']} streams through the gateway", f"{hop['gateway_tok_s']:,.1f} tok/s: cost "
         f"{hop['cost_pct']:.1f} % (paired ratio {hop['paired_ratio']['median']:.3f}, 95 % interval {low:.3f} to "
         f"{high:.3f})", "≤ 3 %"),
        ("gateway CPU per relayed token / the server's", f"{hop['gateway_cpu_us_per_token']:.0f} µs / "
         f"{hop['server_cpu_us_per_token']:,.0f} µs = {share:.1f} %", "≤ 3 %"),
    ]  # fmt: skip
    lines = ["## Gateway (one endpoint, scale to zero)", "", "| figure | value | target |", "|---|---|---|"]
    lines += [f"| {label} | {value} | {goal} |" for label, value, goal in rows]
    return "\n".join(lines) + "\n"


def _seconds(summary: dict[str, Any]) -> str:
    return f"{summary['median']:.3f} s median (p90 {summary['p90']:.3f}, {len(summary['samples'])} runs)"
