"""What serving a bundle needs in memory, and what this machine (or the memory cgroup this process runs in) has free.

One estimate for every place that refuses a bundle before deploying it (packager/sizes.py: Lambda's memory setting,
and a device's free memory, which its edge agent reports in `/agent/status` from `free_memory`).
A server holds:
- the weights, mapped from the bundle and packed by ONNX Runtime into its kernels' layouts. MatMulNBits with int8
  compute keeps an fp32 scale and an fp32 block sum per block of 32 weights, and a GGUF type with a block minimum adds
  its fp32 residual term: measured, the packed weights are `PACKED_WEIGHT_RATIO` x the bundle's weight files;
- the KV pool and the prefix cache, up to their budgets (their pages become resident as tokens are written);
- the runtime itself: the interpreter, onnxruntime, the tokenizer, the engine's buffers (`RUNTIME_BYTES`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runtime.bundle import Manifest

GIB = 1 << 30
MIB = 1 << 20
# Resident packed weights / the bundle's weight files, measured with the server's prepacked graphs mapped
# (runtime/engine/prepacked.py): Llama-3.2-1B's shape at Q4_1, 1088 / 828 MiB = 1.31 (its tied embedding is both a
# Gather table and the packed lm_head). Larger models have a smaller share of embedding, so their ratio is no larger
# (not yet measured at 8B): a refusal made with this one never lets through what then cannot load.
PACKED_WEIGHT_RATIO = 1.31
# The server's anonymous memory after its first token without weights or KV: 175-190 MiB measured at 1B and 8B
# (vocabulary 49,152); a 128k vocabulary's tokenizer and logits buffers take more.
RUNTIME_BYTES = 300 * MIB
WEIGHT_SUFFIXES = (".onnx", ".onnx.data")


@dataclass(frozen=True)
class MemoryNeed:
    """The resident memory a server of one bundle needs, by part (bytes)."""

    weights: int
    kv_pool: int
    prefix_cache: int
    runtime: int = RUNTIME_BYTES

    @property
    def total(self) -> int:
        return self.weights + self.kv_pool + self.prefix_cache + self.runtime

    def describe(self) -> str:
        """`2.05 GiB (weights 1.07, KV pool 0.50, prefix cache 0.12, runtime 0.29)`."""
        parts = {"weights": self.weights, "KV pool": self.kv_pool, "prefix cache": self.prefix_cache}
        shown = ", ".join(f"{name} {size / GIB:.2f}" for name, size in parts.items() if size)
        return f"{gib(self.total)} ({shown}, runtime {self.runtime / GIB:.2f})"


def gib(size: int) -> str:
    return f"{size / GIB:.2f} GiB"


def weight_bytes(manifest: Manifest) -> int:
    """The bytes of the bundle's graphs and their weight files (what the engine maps), with the scale tables its
    graphs expand where they run (the ratio was measured with float32 tables in the files; their factors, also
    counted, make this ~9 % high at Llama-3.1-8B's shape: the safe side)."""
    files = sum(entry.size for name, entry in manifest.files.items() if name.endswith(WEIGHT_SUFFIXES))
    return files + manifest.table_bytes


def serving_need(manifest: Manifest, kv_pool_bytes: int, prefix_cache_bytes: int) -> MemoryNeed:
    """What a server of the bundle needs with these KV and prefix cache budgets (an encoder has neither)."""
    decoder = manifest.model is not None
    return MemoryNeed(
        weights=int(weight_bytes(manifest) * PACKED_WEIGHT_RATIO),
        kv_pool=kv_pool_bytes if decoder else 0,
        prefix_cache=prefix_cache_bytes if decoder else 0,
    )


@dataclass(frozen=True)
class FreeMemory:
    """Memory this process may still use: the machine's MemAvailable, or less under a memory cgroup's limit."""

    total: int  # the machine's memory, or the cgroup's limit when it is lower
    available: int
    source: str  # "/proc/meminfo", or the cgroup limit file that capped it

    def to_json(self) -> dict[str, int | str]:
        return {"total_bytes": self.total, "available_bytes": self.available, "source": self.source}


def free_memory() -> FreeMemory | None:
    """What this process could still allocate; None where /proc/meminfo cannot be read (not Linux)."""
    try:
        meminfo = _fields(Path("/proc/meminfo").read_text())
    except OSError:
        return None
    free = FreeMemory(meminfo.get("MemTotal", 0) * 1024, meminfo.get("MemAvailable", 0) * 1024, "/proc/meminfo")
    limit = _cgroup_limit()
    if limit is not None and limit.available < free.available:
        return FreeMemory(min(limit.total, free.total), limit.available, limit.source)
    return free


def _fields(text: str) -> dict[str, int]:
    """`Key: 123 kB` / `key 123` lines as {key: first number}."""
    fields = {}
    for line in text.splitlines():
        key, _, value = line.replace(":", " ", 1).partition(" ")
        number = value.split()[0] if value.split() else ""
        if number.isdigit():
            fields[key] = int(number)
    return fields


def _cgroup_limit() -> FreeMemory | None:
    """The tightest memory limit among this process's cgroup and its ancestors, with what is left under it.

    Used memory counts the page cache charged to the cgroup; its inactive part is reclaimed before the OOM killer
    acts, so it counts as free, as MemAvailable counts it for the machine.
    """
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    tightest: FreeMemory | None = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            base, files = Path("/sys/fs/cgroup"), ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory")
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        folder = base / path.lstrip("/")
        while True:  # a limit on any ancestor binds too
            found = _limit_in(folder, *files)
            if found is not None and (tightest is None or found.available < tightest.available):
                tightest = found
            if folder == base or base not in folder.parents:
                break
            folder = folder.parent
    return tightest


def _limit_in(folder: Path, limit_file: str, usage_file: str, inactive_key: str) -> FreeMemory | None:
    try:
        raw = (folder / limit_file).read_text().strip()
        if raw == "max" or int(raw) >= 1 << 60:  # v1 writes "no limit" as a number near 2^63
            return None
        limit, usage = int(raw), int((folder / usage_file).read_text())
        inactive = _fields((folder / "memory.stat").read_text()).get(inactive_key, 0)
    except (OSError, ValueError):
        return None
    return FreeMemory(limit, max(0, limit - usage + inactive), str(folder / limit_file))
