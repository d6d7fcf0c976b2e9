"""The Inferentia artifact: the model compiled for AWS Neuron by optimum-neuron, packed as SageMaker model data.

ONNX Runtime has no Neuron execution provider, so an `ml.inf2` endpoint cannot serve the ONNX bundle.
Instead the function's Hugging Face folder is compiled with `optimum-cli export neuron` for the static
shapes in `[targets.aws-sagemaker.neuron]` (Neuron compiles one graph per shape), into
`build/NAME/neuron/`, and packed as `model.tar.gz`, which SageMaker unpacks into `/opt/ml/model`
for the runtime's Neuron backend. The Neuron SDK (compiler and torch-neuronx) installs only from AWS'
own package index on Linux x86_64: without it the build stops and says what to install where. A
folder compiled elsewhere and copied to `build/NAME/neuron/` is used as it is.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

from packager.errors import UserError
from packager.paths import build_dir
from packager.progress import StepProgress
from packager.spec import FunctionSpec, NeuronSection

NEURON_INDEX = "https://pip.repos.neuron.amazonaws.com"
SDK_MODULES = {"torch_neuronx": "torch-neuronx", "optimum.neuron": "optimum-neuron"}
COMPILER = "neuronx-cc"
TASKS = {"chat": "text-generation", "completion": "text-generation"}


@dataclass(frozen=True)
class NeuronArtifact:
    compiled_dir: Path
    archive: Path  # model.tar.gz: the compiled folder's files at the archive's root
    sha256: str


def compiled_dir(spec: FunctionSpec) -> Path:
    return build_dir(spec) / "neuron"


def export_command(hf_dir: Path, out_dir: Path, shapes: NeuronSection, task: str) -> list[str]:
    """`optimum-cli export neuron` with the spec's static shapes."""
    return [
        "optimum-cli", "export", "neuron", "--model", str(hf_dir), "--task", TASKS[task],
        "--batch_size", str(shapes.batch_size), "--sequence_length", str(shapes.sequence_length),
        "--num_cores", str(shapes.num_cores), "--auto_cast_type", shapes.auto_cast_type, str(out_dir),
    ]  # fmt: skip


def missing_sdk() -> list[str]:
    """The Neuron SDK parts this machine lacks, as pip distribution names (plus the compiler binary)."""
    missing = [dist for module, dist in SDK_MODULES.items() if not _importable(module)]
    if shutil.which(COMPILER) is None:
        missing.append(COMPILER)
    if shutil.which("optimum-cli") is None and "optimum-neuron" not in missing:
        missing.append("optimum-neuron")
    return missing


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package (optimum) is absent
        return False


def sdk_message(spec: FunctionSpec, missing: list[str]) -> str:
    target = compiled_dir(spec)
    return (
        f"instance_type {spec.targets.aws_sagemaker.instance_type} runs on AWS Inferentia2, which serves models "
        f"compiled by the AWS Neuron SDK (ONNX Runtime has no Neuron provider); this machine lacks "
        f"{', '.join(missing)}.\n"
        f"Compile on Linux x86_64 with Python 3.10 or 3.11, ideally an inf2/trn1 instance or the "
        f"'Deep Learning AMI Neuron' (compiling needs the SDK, not an Inferentia device):\n"
        f"  pip install --extra-index-url {NEURON_INDEX} neuronx-cc torch-neuronx 'optimum[neuronx]'\n"
        f"then run this deploy there, or compile with\n"
        f"  {' '.join(export_command(Path('HF_DIR'), target, spec.targets.aws_sagemaker.neuron, spec.model.task))}\n"
        f"and copy the folder to {target} here"
    )


def check_compiled(folder: Path) -> None:
    """A folder written by `optimum-cli export neuron`: config.json with its neuron settings, compiled graphs."""
    config = folder / "config.json"
    if not config.is_file():
        raise UserError(f"{folder} is not an optimum-neuron export: no config.json")
    try:
        has_neuron = "neuron" in json.loads(config.read_text())
    except ValueError as exc:
        raise UserError(f"{config} is not valid JSON: {exc}") from exc
    graphs = [p for pattern in ("*.neff", "*.pt") for p in folder.rglob(pattern)]
    if not has_neuron or not graphs:
        raise UserError(
            f"{folder} is not an optimum-neuron export: config.json "
            f"{'has' if has_neuron else 'lacks'} its `neuron` section and {len(graphs)} compiled graphs "
            f"(*.neff / *.pt) were found; compile it again"
        )


def build_artifact(spec: FunctionSpec, progress: StepProgress) -> NeuronArtifact:
    """Compile (unless `build/NAME/neuron/` holds a compiled folder) and pack the artifact."""
    folder = compiled_dir(spec)
    if not (folder / "config.json").is_file():
        missing = missing_sdk()
        if missing:
            raise UserError(sdk_message(spec, missing))
        _compile(spec, folder, progress)
    check_compiled(folder)
    return _pack(folder, build_dir(spec) / "neuron-model.tar.gz")


def _compile(spec: FunctionSpec, folder: Path, progress: StepProgress) -> None:
    from packager.sources import resolve_source

    source = resolve_source(spec.model.source, spec.directory, progress)
    command = export_command(source.hf_dir, folder, spec.targets.aws_sagemaker.neuron, spec.model.task)
    with progress.step("neuron compile", "compile for AWS Neuron (optimum-neuron)"):
        result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        raise UserError(f"{' '.join(command)} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")


def _pack(folder: Path, archive: Path) -> NeuronArtifact:
    """A reproducible tar.gz (sorted, zeroed owners and times), so an unchanged folder keeps its digest."""
    temporary = archive.with_suffix(".tmp")
    with (
        temporary.open("wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=6) as zipped,
        tarfile.open(fileobj=zipped, mode="w") as tar,
    ):
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            info = tar.gettarinfo(str(path), arcname=str(path.relative_to(folder)))
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            with path.open("rb") as handle:
                tar.addfile(info, handle)
    digest = hashlib.sha256()
    with temporary.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    temporary.replace(archive)
    return NeuronArtifact(folder, archive, digest.hexdigest())
