"""Decode at batch 1 on a synthetic MoE GGUF: onnxfn's engine against llama-cpp-python on the same file.

    .venv/bin/python scripts/bench_moe.py --layers 4 --rounds 15   # writes bench/moe/results.json (results.md: by hand)
    .venv/bin/python scripts/bench_moe.py --model qwen3-30b-a3b --mix q8_0   # bench/moe/qwen3-30b-a3b-q8_0/

`--model gpt-oss-20b` (the default) is packager/synthetic/gpt_oss.py's file (gpt-oss-20b's layer: 32 experts of
2880 x 2880, top 4, MXFP4 experts, Q8_0 matrices; `--layers` of them), its experts carried as int8 blocks for QMoE
(~2.1x their bytes). `--model qwen3-30b-a3b` is packager/synthetic/qwen3_moe.py's (Qwen3-30B-A3B's layer: 128
experts of 768 x 2048, top 8) in `--mix` q4_k_m (Q4_K gate/up experts re-quantized to int8 by onnxfn) or q8_0
(every expert carried exactly in the same bytes). onnxfn's bundle is `pkg build` of the file at precision `gguf`.
Both systems are loaded in one process, the same thread count each, and run in alternation, round by round, on the
same prompt ids (llama.cpp's tokenizer of the text): greedy, EOS ignored, decode tok/s = (tokens - 1) / (last
token's time - first token's). Random weights: speed only, no quality.

`--streams 8` adds concurrent streams over HTTP, as users reach each system: onnxfn's server (continuous batching)
against llama_cpp.server on the same file, all streams submitted at once, aggregate tok/s = tokens / time to the
last token, round by round in alternation. Each decode figure is set against the active-parameter bandwidth limit:
the machine's read bandwidth over the bytes one token must read (every weight but the experts and the embedding,
the routed top-k of n experts' share, one embedding row), for the GGUF (llama.cpp reads its blocks) and for the
bundle (its experts are int8 for QMoE).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from packager.bench.machine import read_bandwidth  # noqa: E402
from packager.bench.moe import active_bytes_per_token  # noqa: E402
from packager.bench.systems.base import PromptSpec, StreamTiming, SystemConfig  # noqa: E402
from packager.bench.systems.llamacpp import LlamaCppSystem  # noqa: E402
from packager.bench.systems.onnxfn import OnnxfnSystem  # noqa: E402
from packager.bench.systems.server import ServerSystem  # noqa: E402
from packager.synthetic.gpt_oss import GPT_OSS_20B, synthetic_gpt_oss  # noqa: E402
from packager.synthetic.qwen3_moe import MIXES, QWEN3_30B_A3B, synthetic_qwen3_moe  # noqa: E402

SHAPES = {"gpt-oss-20b": GPT_OSS_20B, "qwen3-30b-a3b": QWEN3_30B_A3B}

TEXT = (
    "The quick brown fox jumps over the lazy dog. Mixture-of-Experts layers route every token to a few of their "
    "experts, so a decode step reads only those experts' weights from memory."
)


def build(gguf: Path, root: Path, name: str) -> Path:
    from packager.build import build_function
    from packager.progress import StepProgress
    from packager.spec import load_spec

    folder = root / "functions" / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "function.toml").write_text(
        f'name = "{name}"\n[model]\nsource = "gguf:{gguf}"\n[export]\nprecision = "gguf"\nmax_context = 512\n'
        "[export.quality]\nmin_top1_agreement = 0.0\nmax_mean_kl = 100.0\nmax_perplexity_increase_pct = 100000.0\n"
    )
    os.chdir(root)
    result = build_function(load_spec(folder), StepProgress())
    return root / result.bundle


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(SHAPES), default="gpt-oss-20b")
    parser.add_argument("--mix", choices=sorted(MIXES), default="q4_k_m", help="qwen3-30b-a3b's type mix")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--streams", type=int, default=0, help="also N concurrent streams over HTTP (0: none)")
    parser.add_argument("--bundle", type=Path, help="a bundle already built from the same file")
    parser.add_argument("--out", type=Path, help="default: bench/moe (gpt-oss), bench/moe/qwen3-30b-a3b-MIX")
    args = parser.parse_args()

    if args.model == "gpt-oss-20b":
        gguf, out = synthetic_gpt_oss(layers=args.layers), REPO / "bench" / "moe"
    else:
        gguf = synthetic_qwen3_moe(args.mix, layers=args.layers)
        out = REPO / "bench" / "moe" / f"{args.model}-{args.mix}"
    out = args.out or out
    bundle = args.bundle or build(gguf, Path(tempfile.mkdtemp(prefix="bench-moe-")), f"{args.model}-synth")
    config = dict(bundle=str(bundle), gguf=str(gguf), hf_dir="", threads=args.threads, max_batch=1,
                  python=sys.executable, max_context=512)  # fmt: skip
    llama = LlamaCppSystem(SystemConfig(system="llamacpp", **config))
    onnxfn = OnnxfnSystem(SystemConfig(system="onnxfn", **config))
    ids = llama._llama.tokenize(TEXT.encode(), add_bos=False, special=False)
    prompt = [PromptSpec(ids=ids, text=TEXT)]
    systems: dict[str, OnnxfnSystem | LlamaCppSystem] = {"onnxfn": onnxfn, "llamacpp": llama}
    rates: dict[str, list[float]] = {name: [] for name in systems}
    first: dict[str, list[int]] = {}
    load = os.getloadavg()[0]
    started = time.time()
    for round_index in range(args.rounds + 1):  # round 0 warms up
        for name, system in systems.items():
            (timing,) = system.run(prompt, args.tokens)
            first[name] = timing.token_ids
            if round_index:
                rates[name].append((timing.tokens - 1) / (timing.last - timing.first))
    onnxfn.close()
    llama.close()
    ratios = [a / b for a, b in zip(rates["onnxfn"], rates["llamacpp"], strict=True)]
    bandwidth = max(read_bandwidth(repetitions=5, threads=args.threads).values())
    active = active_bytes_per_token(gguf, bundle)
    decode = {name: statistics.median(values) for name, values in rates.items()}
    reads = {"onnxfn": active["bundle"], "llamacpp": active["gguf"]}
    limits = {name: bandwidth / reads[name] for name in systems}
    streams = concurrent(config, args) if args.streams else None
    results = {
        "shape": {**SHAPES[args.model].__dict__, "num_hidden_layers": args.layers},
        "mix": args.mix if args.model != "gpt-oss-20b" else "mxfp4 experts, q8_0",
        "gguf": str(gguf), "gguf_bytes": gguf.stat().st_size, "bundle": str(bundle),
        "bundle_weights_bytes": sum(p.stat().st_size for p in bundle.glob("model.onnx*")),
        "threads": args.threads, "prompt_tokens": len(ids), "new_tokens": args.tokens, "rounds": args.rounds,
        "decode_tok_s": decode,
        "read_bandwidth_bytes_s": bandwidth, "active_bytes_per_token": active,
        "limit_tok_s": limits, "of_limit": {name: decode[name] / limits[name] for name in systems},
        "streams": streams,
        "decode_tok_s_rounds": rates, "onnxfn_x_rounds": ratios, "onnxfn_x_median": statistics.median(ratios),
        "same_first_16_tokens": first["onnxfn"] == first["llamacpp"],
        "load_average_at_start": load, "cpus": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
        "run_s": round(time.time() - started, 1), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    shown = ("decode_tok_s", "of_limit", "onnxfn_x_median", "onnxfn_x_rounds", "streams")
    print(json.dumps({k: results[k] for k in shown}, indent=2))


def concurrent(config: dict[str, object], args: argparse.Namespace) -> dict[str, object]:
    """`args.streams` streams at once over HTTP to each server, `args.rounds` rounds in alternation after a
    warm-up: aggregate decode tok/s per round (all tokens / time from submission to the last token)."""
    servers = {
        name: ServerSystem(SystemConfig(system=name, **{**config, "max_batch": args.streams}))  # type: ignore[arg-type]
        for name in ("onnxfn-http", "llamacpp-server")
    }
    prompts = [PromptSpec(ids=[], text=f"Stream {index}: {TEXT}") for index in range(args.streams)]
    rates: dict[str, list[float]] = {name: [] for name in servers}
    try:
        for round_index in range(args.rounds + 1):
            for name, server in servers.items():
                timings: list[StreamTiming] = server.run(prompts, args.tokens)
                if round_index:
                    rates[name].append(sum(t.tokens for t in timings) / max(t.last for t in timings))
    finally:
        for server in servers.values():
            server.close()
    ratios = [a / b for a, b in zip(rates["onnxfn-http"], rates["llamacpp-server"], strict=True)]
    return {
        "streams": args.streams, "aggregate_tok_s": {name: statistics.median(v) for name, v in rates.items()},
        "aggregate_tok_s_rounds": rates, "onnxfn_x_rounds": ratios, "onnxfn_x_median": statistics.median(ratios),
    }  # fmt: skip


if __name__ == "__main__":
    main()
