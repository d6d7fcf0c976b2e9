"""What fits where: the limits of each deploy target and the published sizes of the models users bring.

One place for the numbers the targets check a bundle against before deploying (and docs/models.md prints): a
model is served from memory, so a target needs the packed weights (about 1.3x the bundle), the KV pool and the
prefix cache at their budgets, and the runtime (runtime/memory_need.py, checked against Lambda's memory setting and
against the free memory an edge agent reports); some targets cap the files too. Every check here runs before
anything is built, uploaded or created, and its refusal names the sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from packager.errors import UserError
from runtime.bundle import BundleError, Manifest, read_manifest
from runtime.memory_need import MIB, PACKED_WEIGHT_RATIO, RUNTIME_BYTES, MemoryNeed, gib, serving_need

GB = 1 << 30
MB = MIB

LAMBDA_MAX_MEMORY = 10_240 * MB  # Lambda's largest memory setting
LAMBDA_MAX_IMAGE = 10 * GB  # a Lambda container image, uncompressed
LAMBDA_MAX_ZIP = 250 * MB  # a zip package with its layers, unzipped
SNAPSTART_TMP = 512 * MB  # SnapStart functions keep /tmp at its default size: the bundle cannot be staged there
# The image's layers other than the bundle, unpacked (linux/amd64, measured): os 121 MB, python-deps 172 MB, code 2 MB.
IMAGE_BASE_BYTES = 300 * MB


@dataclass(frozen=True)
class BundleSize:
    """A built bundle's size on disk and what serving it needs in memory."""

    manifest: Manifest
    file_bytes: int  # every file the manifest lists, as the file system reports it
    need: MemoryNeed


def bundle_size(bundle: Path, kv_memory_mb: int, prefix_cache_mb: int) -> BundleSize:
    """The bundle's real size (its files as they are, which must be the sizes its manifest records) and its need."""
    try:
        manifest = read_manifest(bundle)
    except BundleError as exc:
        raise UserError(f"{exc}\nbuild it first with `pkg build`") from exc
    total = 0
    for name, entry in manifest.files.items():
        try:
            size = (bundle / name).stat().st_size
        except OSError as exc:
            raise UserError(f"bundle file {bundle / name} is missing ({exc.strerror}): rebuild the bundle") from exc
        if size != entry.size:
            raise UserError(
                f"bundle file {bundle / name} is {size} bytes, its manifest says {entry.size}: rebuild the bundle"
            )
        total += size
    return BundleSize(manifest, total, serving_need(manifest, kv_memory_mb * MB, prefix_cache_mb * MB))


def mb(size: int) -> str:
    return f"{math.ceil(size / MB)} MB"


def lambda_refusals(size: BundleSize, memory_mb: int, package: str, tmp_mb: int, snapstart: bool) -> list[str]:
    """Why a Lambda function with these settings cannot serve the bundle (empty: it fits). Lambda's MB are MiB."""
    need, problems = size.need, []
    if need.total > LAMBDA_MAX_MEMORY:
        problems.append(
            f"serving the bundle needs about {need.describe()}, more than Lambda's largest memory setting "
            f"({mb(LAMBDA_MAX_MEMORY)}): lower [runtime] kv_memory_mb if the KV pool is what does not fit, or deploy "
            "to aws-sagemaker, an edge device or a machine with more memory"
        )
    elif need.total > memory_mb * MB:
        problems.append(
            f"serving the bundle needs about {need.describe()}, more than [targets.aws-lambda] memory_mb = "
            f"{memory_mb} gives: set memory_mb = {math.ceil(need.total / MB)} or more (at most 10240)"
        )
    if package == "image" and size.file_bytes + IMAGE_BASE_BYTES > LAMBDA_MAX_IMAGE:
        problems.append(
            f"the image would be {gib(size.file_bytes + IMAGE_BASE_BYTES)} unpacked (the bundle {gib(size.file_bytes)}"
            f" + the runtime's layers {gib(IMAGE_BASE_BYTES)}), over Lambda's {gib(LAMBDA_MAX_IMAGE)} limit for a "
            "container image"
        )
    tables = size.manifest.table_bytes  # expanded into /tmp where the function runs (runtime/engine/tables.py)
    staged = size.file_bytes + tables if package == "zip" else tables
    if staged > tmp_mb * MB:
        what = (
            f"the bundle is {mb(size.file_bytes)} and its scale tables {mb(tables)}"
            if package == "zip"
            else f"the bundle's scale tables are {mb(tables)}"
        )
        where = "fetches the bundle there and expands" if package == "zip" else "expands"
        image_tmp = f" and ephemeral_storage_mb = {math.ceil(tables / MB) + 64} or more" if tables > tmp_mb * MB else ""
        fix = (
            f"SnapStart keeps /tmp at {mb(SNAPSTART_TMP)} at most, so a bundle this size cannot use it: set "
            f'snapstart = false with package = "image"{image_tmp} (provisioned_concurrency keeps instances warm '
            "instead)"
            if snapstart
            else f"raise ephemeral_storage_mb to {math.ceil(staged / MB) + 64} or more"
            + (', or use package = "image"' if package == "zip" and not image_tmp else "")
        )
        problems.append(
            f"{what}, and /tmp (ephemeral_storage_mb = {tmp_mb}) holds {tmp_mb} MB; the init phase {where} "
            f"the tables there: {fix}"
        )
    return problems


def device_refusal(manifest: Manifest, memory: dict[str, object]) -> str | None:
    """Why a device whose agent reports `memory` (the "memory" of its `/agent/status`: what is available to it, and
    the KV and prefix cache budgets it serves with) cannot load the bundle; None: it can, or the agent does not say.

    The agent loads a new bundle beside the one it serves and switches once the new one answered, so the new
    bundle must fit in what is available now.
    """
    keys = ("available_bytes", "total_bytes", "kv_pool_bytes", "prefix_cache_bytes")
    numbers = [value for value in (memory.get(key) for key in keys) if isinstance(value, int)]
    if len(numbers) != len(keys):
        return None
    available, total, kv_pool, prefix_cache = numbers
    need = serving_need(manifest, kv_pool, prefix_cache)
    if need.total <= available:
        return None
    return (
        f"serving the bundle needs about {need.describe()} and the device has {gib(available)} available of "
        f"{gib(total)} ({memory.get('source', 'its memory')}; the bundle it serves keeps its memory until the new one "
        "answers): free memory there, or lower the agent's --kv-memory-mb"
    )


# The weights ONNX Runtime packs per byte of a Q4_K_M GGUF: precision `gguf` keeps its blocks, and its operators take
# a float32 scale per block (and a float32 residual per block of a type with a minimum), which the bundle ships as
# the file's own factors and the runtime expands where it runs (runtime/engine/tables.py). Measured as bundles
# holding the float32 tables: 1.43 at Llama-3.2-1B's shape, 1.40 at Llama-3.1-8B's.
BUNDLE_PER_FILE = 1.43


@dataclass(frozen=True)
class PublishedFit:
    """A published model's Q4_K_M file and what serving it needs by the same estimate the targets refuse with."""

    model: str
    file_bytes: tuple[int, int]  # the smallest and largest file of the models in the row
    targets: str  # the devices and machines it fits, besides the Lambda memory setting computed here

    def need(self, kv_memory_mb: int = 512, prefix_cache_mb: int = 128) -> tuple[MemoryNeed, MemoryNeed]:
        """The row's smallest and largest need at the default [runtime] budgets."""
        low, high = (
            MemoryNeed(int(size * BUNDLE_PER_FILE * PACKED_WEIGHT_RATIO), kv_memory_mb * MB, prefix_cache_mb * MB)
            for size in self.file_bytes
        )
        return low, high


GB_FILE = 1_000_000_000  # published file sizes are in decimal GB

SIZE_NOTES = (
    "A bundle of a Q4_K_M GGUF is about 1.1x the file (precision `gguf` keeps its blocks and the file's own scale "
    "factors: 1.11x measured at Llama-3.1-8B's shape; `int4` from a Hugging Face folder is about 1.4x). Where it runs, "
    "the runtime expands those factors once into float32 scale tables, about 0.4x the file (on Lambda: in /tmp, "
    "counted against ephemeral_storage_mb). Serving holds the weights packed by ONNX Runtime from the bundle and its "
    f"tables ({PACKED_WEIGHT_RATIO}x their bytes, measured: {BUNDLE_PER_FILE * PACKED_WEIGHT_RATIO:.2f}x the file), "
    "the KV "
    "pool (`[runtime] kv_memory_mb`, default 512 MB), the prefix cache (`prefix_cache_mb`, default 128 MB) and "
    f"{RUNTIME_BYTES / GB:.2f} GiB of runtime: the estimate "
    "(runtime/memory_need.py) that aws-lambda and `pkg push` check before they deploy, refusing with the sizes named "
    "a bundle that cannot fit. Shipping it takes little memory whatever its size: `pkg image build --push`, "
    "`pkg image push` and `pkg push` stream the files in chunks (95, 89 and 55 MiB peak RSS for Llama-3.1-8B's "
    "4.97 GB bundle, bench/synthetic-8b). "
    f"Lambda: at most {mb(LAMBDA_MAX_MEMORY)} of memory, a container image of {gib(LAMBDA_MAX_IMAGE)} unpacked "
    f"(the bundle + {mb(IMAGE_BASE_BYTES)} of runtime layers), a zip package of {mb(LAMBDA_MAX_ZIP)} unpacked whose "
    f"bundle is fetched into /tmp, which SnapStart keeps at {mb(SNAPSTART_TMP)}. An edge device: the memory its agent "
    "reports available, checked by `pkg push` before it uploads. Figures for Q4_K_M files of the published models "
    "(their own 128k/152k vocabularies):\n"
)

TARGET_FITS: tuple[PublishedFit, ...] = (
    PublishedFit(
        "SmolLM2 135M (the demo, Q4_1)",
        (90_000_000, 90_000_000),
        "everything: Lambda zip or image (with SnapStart), any Jetson, any CPU box",
    ),
    PublishedFit(
        "Llama 3.2 1B / Qwen 2.5 1.5B",
        (800_000_000, 1_100_000_000),
        "Lambda image (too big for SnapStart's 512 MB /tmp and for a zip), Jetson Orin Nano 8 GB, any CPU box",
    ),
    PublishedFit(
        "Llama 3.2 3B / Qwen 2.5 3B",
        (2_000_000_000, 2_000_000_000),
        "Lambda image (ephemeral_storage_mb >= 1024 for its tables), Jetson Orin Nano 8 GB (shared with the GPU), "
        "CPU box with 6 GB+",
    ),
    PublishedFit(
        "Llama 3.1 8B / Qwen 2.5 7B / Mistral 7B",
        (4_700_000_000, 4_900_000_000),
        "Lambda image (slow: CPU only; ephemeral_storage_mb >= 2560 for its tables), Jetson AGX Orin / Orin NX 16 GB, "
        "CPU box with 12 GB+, a GPU with 16 GB+ "
        "(SageMaker ml.g5)",
    ),
)
