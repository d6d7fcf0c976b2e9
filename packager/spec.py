"""The function spec: `functions/NAME/function.toml` parsed into typed, validated objects.

The dataclasses below are the schema: each field's type, default and (in `metadata`) its allowed
values or range. One generic walker checks a TOML table against them and reports every problem at
once, each naming the key, the bad value and what is allowed.
"""

from __future__ import annotations

import hashlib
import tomllib
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from packager.errors import UserError

SPEC_FILE = "function.toml"


def choice(*allowed: str, default: str) -> Any:
    return field(default=default, metadata={"choices": allowed})


def bounded(default: float | int, *, lo: float | None = None, hi: float | None = None) -> Any:
    return field(default=default, metadata={"min": lo, "max": hi})


@dataclass(frozen=True)
class ModelSection:
    source: str
    task: str = choice("chat", "completion", default="chat")
    architecture: str | None = None  # override of config.json's `model_type`


@dataclass(frozen=True)
class QualitySection:
    min_top1_agreement: float = bounded(0.95, lo=0.0, hi=1.0)
    max_mean_kl: float = bounded(0.02, lo=0.0)
    max_perplexity_increase_pct: float = bounded(10.0, lo=0.0)


@dataclass(frozen=True)
class ExportSection:
    precision: str = choice("auto", "fp32", "int8", "int4", default="auto")
    block_size: int = field(default=32, metadata={"choices": (16, 32, 64, 128, 256)})
    accuracy_level: int = field(default=4, metadata={"choices": (1, 2, 3, 4)})
    max_context: int = bounded(2048, lo=16, hi=131072)
    quality: QualitySection = field(default_factory=QualitySection)


@dataclass(frozen=True)
class SamplingSection:
    temperature: float = bounded(0.0, lo=0.0, hi=2.0)
    top_p: float = bounded(1.0, lo=0.0, hi=1.0)
    max_tokens: int = bounded(256, lo=1)


@dataclass(frozen=True)
class RuntimeSection:
    max_batch: int = bounded(8, lo=1, hi=256)
    max_queue: int = bounded(64, lo=0)
    kv_memory_mb: int = bounded(512, lo=1)
    prefix_cache_mb: int = bounded(128, lo=0)
    prefill_chunk: int = bounded(64, lo=1)
    threads: int = bounded(2, lo=1, hi=256)
    providers: list[str] = field(
        default_factory=lambda: ["cpu"], metadata={"item_choices": ("cpu", "cuda", "tensorrt")}
    )
    system_prompt: str | None = None
    sampling: SamplingSection = field(default_factory=SamplingSection)


@dataclass(frozen=True)
class EndpointSection:
    max_tokens: int = bounded(1024, lo=1)
    max_prompt_tokens: int | None = None
    api_key_env: str | None = None


@dataclass(frozen=True)
class LocalTarget:
    host: str = "127.0.0.1"
    port: int = bounded(0, lo=0, hi=65535)  # 0 = pick a free port


@dataclass(frozen=True)
class TargetsSection:
    local: LocalTarget = field(default_factory=LocalTarget)


@dataclass(frozen=True)
class ImageSection:
    """Present in function.toml = `pkg build` also writes an OCI image (and pushes it when `registry` is set)."""

    platforms: list[str] = field(
        default_factory=lambda: ["linux/amd64"], metadata={"item_choices": ("linux/amd64", "linux/arm64")}
    )
    registry: str | None = None  # HOST[:PORT]/REPOSITORY[:TAG]; credentials come from the environment
    tag: str = "latest"


@dataclass(frozen=True)
class FunctionSpec:
    name: str
    model: ModelSection
    export: ExportSection = field(default_factory=ExportSection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    endpoint: EndpointSection = field(default_factory=EndpointSection)
    targets: TargetsSection = field(default_factory=TargetsSection)
    image: ImageSection | None = None
    # Where the spec was read from, and the sha256 of its bytes; not keys of the TOML file.
    directory: Path = field(default=Path("."), metadata={"internal": True})
    digest: str = field(default="", metadata={"internal": True})


class SpecError(UserError):
    def __init__(self, path: Path, problems: list[str]) -> None:
        listing = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{path} has {len(problems)} problem(s):\n{listing}", exit_code=2)
        self.problems = problems


def load_spec(function_dir: str | Path) -> FunctionSpec:
    """Read and validate `function_dir/function.toml`; raise `SpecError` listing every problem."""
    directory = Path(function_dir)
    path = directory / SPEC_FILE if directory.is_dir() else directory
    if path.name != SPEC_FILE or not path.is_file():
        raise UserError(f"no {SPEC_FILE} at {path}: pass a function folder such as functions/smollm2-chat", exit_code=2)
    raw = path.read_bytes()
    try:
        table = tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SpecError(path, [f"not valid TOML: {exc}"]) from exc
    table.setdefault("name", path.parent.resolve().name)
    problems: list[str] = []
    values = _parse_table(FunctionSpec, table, "", problems)
    if problems:
        raise SpecError(path, problems)
    values.update(directory=path.parent, digest="sha256:" + hashlib.sha256(raw).hexdigest())
    spec = FunctionSpec(**values)
    _check_cross_field(spec, path)
    return spec


def _check_cross_field(spec: FunctionSpec, path: Path) -> None:
    problems = []
    limit = spec.endpoint.max_prompt_tokens
    if limit is not None and limit >= spec.export.max_context:
        problems.append(
            f"endpoint.max_prompt_tokens = {limit} must be below export.max_context = {spec.export.max_context}"
        )
    if not spec.name.replace("-", "").replace("_", "").isalnum():
        problems.append(f"name = {spec.name!r}: use letters, digits, '-' and '_' only")
    if problems:
        raise SpecError(path, problems)


def _parse_table(cls: type, table: Any, prefix: str, problems: list[str]) -> dict[str, Any]:
    if not isinstance(table, dict):
        problems.append(f"[{prefix.rstrip('.')}] must be a table, got {table!r}")
        return {}
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls) if not f.metadata.get("internal")}
    for key in table.keys() - known.keys():
        problems.append(f"{prefix}{key}: unknown key; allowed keys here: {', '.join(sorted(known))}")
    values: dict[str, Any] = {}
    for name, spec_field in known.items():
        key = prefix + name
        if name not in table:
            if spec_field.default is MISSING and spec_field.default_factory is MISSING:
                problems.append(f"{key}: required key is missing")
            continue
        hint = _optional_section(hints[name])
        if isinstance(hint, type) and hasattr(hint, "__dataclass_fields__"):
            before = len(problems)
            nested = _parse_table(hint, table[name], key + ".", problems)
            if len(problems) == before:
                values[name] = hint(**nested)
        else:
            values[name] = _check_value(key, table[name], hint, spec_field.metadata, problems)
    return values


def _optional_section(hint: Any) -> Any:
    """`Section | None` → `Section`: an optional table is validated like a required one when present."""
    if isinstance(hint, types.UnionType):
        members = [t for t in typing.get_args(hint) if t is not type(None)]
        if len(members) == 1 and hasattr(members[0], "__dataclass_fields__"):
            return members[0]
    return hint


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}


def _check_value(key: str, value: Any, hint: Any, meta: Any, problems: list[str]) -> Any:
    allowed_types = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    allowed_types = tuple(t for t in allowed_types if t is not type(None))
    expected = allowed_types[0]
    if typing.get_origin(expected) is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            problems.append(f"{key} = {value!r}: expected a list of strings")
            return value
        bad = [v for v in value if meta.get("item_choices") and v not in meta["item_choices"]]
        if bad:
            problems.append(f"{key} = {value!r}: {bad} not allowed; choose from {', '.join(meta['item_choices'])}")
        return value
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, expected) or (expected is not bool and isinstance(value, bool)):
        problems.append(f"{key} = {value!r}: expected {_TYPE_NAMES.get(expected, expected.__name__)}")
        return value
    if meta.get("choices") and value not in meta["choices"]:
        problems.append(f"{key} = {value!r}: not allowed; choose from {', '.join(map(str, meta['choices']))}")
    lo, hi = meta.get("min"), meta.get("max")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        span = (
            f"between {lo} and {hi}"
            if lo is not None and hi is not None
            else (f">= {lo}" if lo is not None else f"<= {hi}")
        )
        problems.append(f"{key} = {value!r}: out of range; must be {span}")
    return value
