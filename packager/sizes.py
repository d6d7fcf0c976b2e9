"""What fits where: the limits of each deploy target and the published sizes of the models users bring.

One place for the numbers the targets check a bundle against before deploying (and docs/models.md prints): a
model is served from memory, so a target needs the weights (about the GGUF's size) plus the KV pool plus the
runtime (~0.3 GB), and some targets cap the files too.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1 << 30
MB = 1 << 20
RUNTIME_BYTES = 300 * MB  # the runtime process without weights or KV pool (python, onnxruntime, tokenizer)

LAMBDA_MAX_MEMORY = 10_240 * MB  # Lambda's largest memory setting
LAMBDA_MAX_IMAGE = 10 * GB  # a Lambda container image, uncompressed
LAMBDA_MAX_ZIP = 250 * MB  # a zip package with its layers, unzipped
SNAPSTART_TMP = 512 * MB  # SnapStart functions keep /tmp at its default size: the bundle cannot be staged there


@dataclass(frozen=True)
class TargetFit:
    model: str
    file: str
    memory: str
    targets: str


SIZE_NOTES = (
    "A bundle is about the GGUF's size (precision `gguf` keeps its blocks; `int4` from a Hugging Face folder is "
    "about the same). Serving holds the weights mapped from the bundle, the KV pool (`[runtime] kv_memory_mb`, "
    "default 512 MB) and ~0.3 GB of runtime. Each target refuses, before it deploys, a bundle that cannot fit it, "
    "with the sizes named. Figures for Q4_K_M files of the published models (their own 128k/152k vocabularies):\n"
)

TARGET_FITS: tuple[TargetFit, ...] = (
    TargetFit(
        "SmolLM2 135M (the demo, Q4_1)",
        "0.09 GB",
        "0.9 GB",
        "everything: Lambda zip or image (with SnapStart), any Jetson, any CPU box",
    ),
    TargetFit(
        "Llama 3.2 1B / Qwen 2.5 1.5B",
        "0.8-1.1 GB",
        "1.6-1.9 GB",
        "Lambda image (2-3 GB memory; too big for SnapStart's 512 MB /tmp and for a zip), Jetson Orin Nano 8 GB, "
        "any CPU box",
    ),
    TargetFit(
        "Llama 3.2 3B / Qwen 2.5 3B",
        "2.0 GB",
        "2.8 GB",
        "Lambda image (4 GB+ memory), Jetson Orin Nano 8 GB (shared with the GPU), CPU box with 4 GB+",
    ),
    TargetFit(
        "Llama 3.1 8B / Qwen 2.5 7B / Mistral 7B",
        "4.7-4.9 GB",
        "5.5-5.7 GB",
        "Lambda image at 8-10 GB memory (slow: CPU only), Jetson AGX Orin / Orin NX 16 GB, CPU box with 8 GB+, "
        "a GPU with 8 GB+ (SageMaker ml.g5)",
    ),
)


def serving_bytes(weights_bytes: int, kv_pool_bytes: int) -> int:
    """What a server needs in memory: its weights, its KV pool and the runtime itself."""
    return weights_bytes + kv_pool_bytes + RUNTIME_BYTES
