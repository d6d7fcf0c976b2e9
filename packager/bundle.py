"""Write a bundle atomically: assemble it in a temporary folder beside the target, then rename.

An interrupted build leaves at most a `.bundle-tmp-*` folder (removed by the next build), never a
folder named `bundle` with a manifest that does not match its files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packager.adapters.build import ADAPTER_DIR, DeclaredAdapter, adapt_graph, bundled_files, manifest_entry
from packager.errors import UserError
from packager.export.builder import CARRY_REPORT
from packager.export.prefill import write_prefill_graphs
from packager.snapshot import add_snapshot
from packager.spec import FunctionSpec
from runtime.adapters.files import write_adapter_file
from runtime.adapters.layout import AdapterLayout
from runtime.bundle import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    BundleError,
    DecoderIO,
    FileEntry,
    Manifest,
    ModelFacts,
    file_digest,
    manifest_bytes,
    open_bundle,
)
from runtime.engine.recipes import write_data
from runtime.engine.tables import TABLES_FILE, TABLES_RECIPE

MODEL_FILES = ("model.onnx", "model.onnx.data")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
GENAI_CONFIG = "genai_config.json"
QUALITY_FILE = "quality.json"


@dataclass(frozen=True)
class BundleInputs:
    spec: FunctionSpec
    export_dir: Path  # the chosen precision's export
    export_digests: dict[str, dict[str, int | str]]
    hf_dir: Path
    architecture: str
    precision: str
    quality_json: bytes
    build_key: str
    adapters: BundledAdapters | None = None


@dataclass(frozen=True)
class BundledAdapters:
    """The graph's adapter layout and the function's own adapters, written into the bundle's `adapters/`."""

    layout: AdapterLayout
    declared: list[DeclaredAdapter]


def model_facts(inputs: BundleInputs) -> ModelFacts:
    return decoder_facts_of(inputs.spec, inputs.export_dir, inputs.hf_dir, inputs.architecture, inputs.precision)


def decoder_facts_of(
    spec: FunctionSpec, export_dir: Path, hf_dir: Path, architecture: str, precision: str
) -> ModelFacts:
    """The facts the bundle of `export_dir` declares (before the bundle is written: adapters are checked with them)."""
    genai = json.loads((export_dir / GENAI_CONFIG).read_text())["model"]
    decoder = genai["decoder"]
    hf_config = json.loads((hf_dir / "config.json").read_text())
    template_path = export_dir / "chat_template.jinja"
    template = template_path.read_text() if template_path.is_file() else _template_from_config(export_dir)
    return ModelFacts(
        task=spec.model.task,
        architecture=architecture,
        precision=precision,
        num_layers=decoder["num_hidden_layers"],
        num_heads=decoder["num_attention_heads"],
        num_kv_heads=decoder["num_key_value_heads"],
        head_dim=decoder["head_size"],
        hidden_size=decoder["hidden_size"],
        vocab_size=genai["vocab_size"],
        context_length=min(genai["context_length"], spec.export.max_context),
        kv_dtype="float32",
        bos_token_id=genai.get("bos_token_id"),
        eos_token_ids=_eos_ids(hf_dir, genai.get("eos_token_id"), hf_config.get("eos_token_id")),
        pad_token_id=genai.get("pad_token_id"),
        chat_template=template,
        io=DecoderIO(
            input_ids=decoder["inputs"]["input_ids"],
            attention_mask=decoder["inputs"]["attention_mask"],
            past_key=decoder["inputs"]["past_key_names"],
            past_value=decoder["inputs"]["past_value_names"],
            logits=decoder["outputs"]["logits"],
            present_key=decoder["outputs"]["present_key_names"],
            present_value=decoder["outputs"]["present_value_names"],
        ),
    )


def _template_from_config(export_dir: Path) -> str | None:
    config_path = export_dir / "tokenizer_config.json"
    return json.loads(config_path.read_text()).get("chat_template") if config_path.is_file() else None


def _eos_ids(hf_dir: Path, *declared: object) -> tuple[int, ...]:
    """EOS ids from genai_config, config.json and generation_config.json (each an int or a list)."""
    values = list(declared)
    generation = hf_dir / "generation_config.json"
    if generation.is_file():
        values.append(json.loads(generation.read_text()).get("eos_token_id"))
    ids: list[int] = []
    for value in values:
        for token_id in value if isinstance(value, list) else [value]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return tuple(ids)


def existing_bundle_key(target: Path) -> str | None:
    try:
        return json.loads((target / MANIFEST_NAME).read_text()).get("build_key")
    except (OSError, ValueError):
        return None


def reusable_bundle(target: Path, build_key: str) -> Manifest | None:
    """The manifest of the bundle at `target` if it was built from `build_key` and is intact, else None."""
    if existing_bundle_key(target) != build_key:
        return None
    try:
        return open_bundle(target).manifest
    except BundleError:
        return None  # altered since it was built: write it again


def write_bundle(inputs: BundleInputs, target: Path) -> Manifest:
    """Assemble the bundle in a temporary sibling folder and rename it onto `target`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(".bundle-tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=".bundle-tmp-", dir=target.parent))
    try:
        manifest = _assemble(inputs, tmp)
        _replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _assemble(inputs: BundleInputs, out: Path) -> Manifest:
    files: dict[str, FileEntry] = {}
    # CARRY_REPORT: a `gguf` export's record of the GGUF rows each weight holds, so anyone can check it.
    for name in (*MODEL_FILES, TABLES_RECIPE, *TOKENIZER_FILES, GENAI_CONFIG, CARRY_REPORT):
        source = inputs.export_dir / name
        if not source.is_file():
            if name in MODEL_FILES or name == "tokenizer.json":
                raise UserError(f"the export at {inputs.export_dir} lacks {name}; delete it and rebuild")
            continue
        if name == "model.onnx.data":
            _link_or_copy(source, out / name)  # the export's weights, not a second copy on disk
        else:
            shutil.copyfile(source, out / name)
        if name == "model.onnx" and inputs.adapters is not None:
            adapt_graph(out / name, inputs.adapters.layout)  # before the prefill graphs are derived from it
            files[name] = file_digest(out / name)
            continue
        known = inputs.export_digests.get(name)
        # Digests recorded when the export was cached; re-hash only files without one.
        files[name] = FileEntry(**known) if known else file_digest(out / name)  # type: ignore[arg-type]
    if TABLES_RECIPE in files:
        check_tables(out)
    if inputs.spec.export.prefill_graph and inputs.spec.runtime.providers[:1] == ["cpu"]:
        # The runtime prefills through these graphs on the CPU (last-position logits; export/prefill.py).
        for name in write_prefill_graphs(out, "model.onnx"):
            files[name] = file_digest(out / name)
    if TABLES_RECIPE in files:
        record_table_users(out)
        files[TABLES_RECIPE] = file_digest(out / TABLES_RECIPE)
    adapters = inputs.adapters
    if adapters is not None:
        bundled = bundled_files(adapters.declared)
        (out / ADAPTER_DIR).mkdir()
        for adapter in adapters.declared:
            write_adapter_file(out / bundled[adapter.name], adapter.file)
            files[bundled[adapter.name]] = file_digest(out / bundled[adapter.name])
    (out / QUALITY_FILE).write_bytes(inputs.quality_json)
    files[QUALITY_FILE] = file_digest(out / QUALITY_FILE)
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        function=inputs.spec.name,
        spec_digest=inputs.spec.digest,
        model_file="model.onnx",
        tokenizer_file="tokenizer.json",
        model=model_facts(inputs),
        files=files,
        created_by={name: metadata.version(name) for name in ("onnxfn", "onnxruntime", "onnxruntime-genai")},
        build_key=inputs.build_key,
        adapters=manifest_entry(adapters.layout, adapters.declared) if adapters is not None else None,
        table_bytes=_table_bytes(out),
    )
    manifest = add_snapshot(out, manifest, inputs.spec)
    manifest_path = out / MANIFEST_NAME
    manifest_path.write_bytes(manifest_bytes(manifest.to_json()))
    for path in out.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    return manifest


def _table_bytes(bundle_dir: Path) -> int:
    recipe = bundle_dir / TABLES_RECIPE
    return int(json.loads(recipe.read_text())["size"]) if recipe.is_file() else 0


def check_tables(bundle_dir: Path) -> None:
    """Expand the scale tables from the bundle's own files, as the runtime will (runtime/engine/tables.py), and refuse
    a bundle whose tables differ by a bit from those the export wrote and verified (the recipe's sha256)."""
    recipe = json.loads((bundle_dir / TABLES_RECIPE).read_text())
    try:
        digest = write_data(recipe, lambda name: bundle_dir / name, None, TABLES_RECIPE)
    except (BundleError, OSError, ValueError, KeyError) as exc:
        raise UserError(f"the bundle's scale tables cannot be expanded ({exc}); delete the export and rebuild") from exc
    if digest != recipe.get("sha256"):
        raise UserError("the bundle's scale tables expand to other values than the export verified; rebuild it")


def record_table_users(bundle_dir: Path) -> None:
    """Write into the tables recipe which of the bundle's graphs names which tables (the runtime hands those to each
    graph's session, and reads no graph itself)."""
    import onnx

    recipe_path = bundle_dir / TABLES_RECIPE
    recipe = json.loads(recipe_path.read_text())
    users: dict[str, list[str]] = {}
    for graph in sorted(bundle_dir.glob("*.onnx")):
        model = onnx.load(str(graph), load_external_data=False)
        names = [t.name for t in model.graph.initializer if any(e.value == TABLES_FILE for e in t.external_data)]
        if names:
            users[graph.name] = names
    recipe["graphs"] = users
    recipe_path.write_text(json.dumps(recipe) + "\n")


def _link_or_copy(source: Path, target: Path) -> None:
    """A hard link where the cache and the bundle share a filesystem (both files are only ever replaced, never
    written in place), else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def _replace_dir(new: Path, target: Path) -> None:
    """Swap `new` into `target`; at every instant `target` is the old bundle, absent, or the new one."""
    if target.exists():
        old = target.with_name(f".bundle-old-{os.getpid()}")
        target.rename(old)
        new.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        new.rename(target)
