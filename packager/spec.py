"""The function spec: `functions/NAME/function.toml` parsed into typed, validated objects.

The dataclasses below are the schema: each field's type, default and (in `metadata`) its allowed
values or range. One generic walker checks a TOML table against them and reports every problem at
once, each naming the key, the bad value and what is allowed.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from packager.adapters.weights import ADAPTABLE_MODULES
from packager.errors import UserError
from runtime.adapters.layout import NAME as ADAPTER_NAME
from runtime.adapters.layout import NAME_RULE as ADAPTER_NAME_RULE

SPEC_FILE = "function.toml"
ENCODER_PRECISIONS = ("auto", "fp32", "int8", "int8-mixed", "int8-nbits")
DECODER_PRECISIONS = ("auto", "gguf", "fp32", "int8", "int4")
ENCODER_TASKS = ("embedding", "classification")


def choice(*allowed: str, default: str) -> Any:
    return field(default=default, metadata={"choices": allowed})


def bounded(default: float | int, *, lo: float | None = None, hi: float | None = None) -> Any:
    return field(default=default, metadata={"min": lo, "max": hi})


@dataclass(frozen=True)
class ModelSection:
    source: str
    task: str = choice("chat", "completion", "embedding", "classification", default="chat")
    architecture: str | None = None  # override of config.json's `model_type`


@dataclass(frozen=True)
class QualitySection:
    min_top1_agreement: float = bounded(0.95, lo=0.0, hi=1.0)
    max_mean_kl: float = bounded(0.02, lo=0.0)
    max_perplexity_increase_pct: float = bounded(10.0, lo=0.0)
    # Embedding functions: cosine similarity to the fp32 embeddings on a fixed sentence set, and how often
    # each sentence's nearest neighbour in that set stays the same.
    min_mean_cosine: float = bounded(0.99, lo=0.0, hi=1.0)
    min_cosine: float = bounded(0.97, lo=0.0, hi=1.0)
    min_neighbour_agreement: float = bounded(0.9, lo=0.0, hi=1.0)
    # A row's embedding alone vs in a padded batch of others (concurrent requests share forwards).
    min_batch_cosine: float = bounded(0.9999, lo=0.0, hi=1.0)
    # Classifiers: the largest change of any label's probability against fp32, alone or batched
    # (`min_top1_agreement` is then the share of sentences whose top label stays fp32's).
    max_probability_delta: float = bounded(0.05, lo=0.0, hi=1.0)


@dataclass(frozen=True)
class ExportSection:
    # int8-mixed and int8-nbits are encoder schemes (`ENCODER_TASKS`), see `ENCODER_PRECISIONS`; `gguf` keeps a GGUF
    # source's own quantized blocks (packager/export/gguf/).
    precision: str = choice("auto", "gguf", "fp32", "int8", "int4", "int8-mixed", "int8-nbits", default="auto")
    block_size: int = field(default=32, metadata={"choices": (16, 32, 64, 128, 256)})
    accuracy_level: int = field(default=4, metadata={"choices": (1, 2, 3, 4)})
    max_context: int = bounded(2048, lo=16, hi=131072)
    # A second graph for prompts on the CPU: ~2.5x faster prefill for fp32 copies of the int8 weights.
    prefill_graph: bool = True
    # LoRA adapters (docs/adapters.md): the projections the graph takes adapters on (empty: those the [[adapters]]
    # target) and the largest rank it takes (0: the largest declared, 16 without any). Set them to add adapters
    # later (`pkg adapter add`) that the bundle's own do not cover.
    adapter_modules: list[str] = field(default_factory=list, metadata={"item_choices": ADAPTABLE_MODULES})
    adapter_rank: int = bounded(0, lo=0, hi=256)
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
    spin: bool = True
    decode: str = choice("latency", "throughput", default="latency")
    prefill_matmuls: str = choice("auto", "fp32", "quantized", default="auto")
    providers: list[str] = field(
        default_factory=lambda: ["cpu"], metadata={"item_choices": ("cpu", "cuda", "tensorrt")}
    )
    system_prompt: str | None = None
    # LoRA adapters resident at once (each a slot of the graph's adapter inputs); more are loaded on demand,
    # evicting the least recently used idle one.
    max_adapters: int = bounded(4, lo=1, hi=64)
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
    # Resume a CRIU snapshot of the warmed server instead of starting one (packager/targets/local/process_snapshot.py).
    process_snapshot: bool = False
    # Write the graphs with their weights packed for this CPU into build/NAME/local/prepacked/ (once per bundle,
    # ~2.5 s and ~1.5 GB for the demo) and serve from there: the weights are memory-mapped, not packed onto
    # the heap at every start (runtime/engine/prepacked.py). Decoder bundles on the CPU provider only.
    prepack: bool = True
    # Scale to zero through the gateway (packager/gateway/): after this many seconds without a request the
    # server is stopped (its process snapshot kept) and the next request starts it again. 0 = never.
    idle_timeout: int = bounded(300, lo=0)
    # Requests that may wait while an idle function starts again; more get 429 with Retry-After.
    max_waking_requests: int = bounded(32, lo=1)
    # The server's memory limit in MiB, enforced by a memory cgroup (packager/targets/local/memory_limit.py):
    # over it, the kernel ends this server alone and the gateway starts it again. 0 = no limit.
    memory_mb: int = bounded(0, lo=0)


# CloudWatch Logs accepts only these retention periods.
_LOG_RETENTION_DAYS = (1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731,
                       1096, 1827, 2192, 2557, 2922, 3288, 3653)  # fmt: skip
_GPU_SIZES = ("xlarge", "2xlarge", "4xlarge", "8xlarge", "12xlarge", "16xlarge", "24xlarge", "48xlarge")
SAGEMAKER_INSTANCE_TYPES = (
    *(f"ml.{family}.{size}" for family in ("g5", "g6", "g6e") for size in _GPU_SIZES),
    *(f"ml.inf2.{size}" for size in ("xlarge", "8xlarge", "24xlarge", "48xlarge")),
)


@dataclass(frozen=True)
class AwsLambdaTarget:
    """`pkg deploy --target aws-lambda`: the image in ECR, a function URL, and an SQS queue with a DLQ."""

    region: str | None = None  # default: $AWS_REGION, $AWS_DEFAULT_REGION, ~/.aws/config (aws.resolve_region)
    endpoint_url: str | None = None  # default: $AWS_ENDPOINT_URL, else AWS itself
    memory_mb: int = bounded(3008, lo=128, hi=10240)
    timeout_seconds: int = bounded(120, lo=1, hi=900)
    architecture: str = choice("x86_64", "arm64", default="x86_64")
    ephemeral_storage_mb: int = bounded(1024, lo=512, hi=10240)
    reserved_concurrency: int | None = field(default=None, metadata={"min": 0, "max": None})
    provisioned_concurrency: int = bounded(0, lo=0)
    # image: the container image (the bundle in a layer); zip: the runtime in a zip package, the bundle fetched
    # from S3 in the init phase (what SnapStart needs); auto: zip when snapstart is on, else image.
    package: str = choice("auto", "image", "zip", default="auto")
    snapstart: bool = False  # SnapStart on published versions; needs the zip package
    url_auth: str = choice("AWS_IAM", "NONE", default="AWS_IAM")
    batch_size: int = bounded(8, lo=1, hi=10000)
    batch_window_seconds: int = bounded(0, lo=0, hi=300)
    max_receive_count: int = bounded(3, lo=1, hi=1000)
    max_concurrency: int | None = field(default=None, metadata={"min": 2, "max": 1000})  # per event source
    log_retention_days: int = field(default=30, metadata={"choices": _LOG_RETENTION_DAYS})


@dataclass(frozen=True)
class NeuronSection:
    """Static shapes for `optimum-cli export neuron` (Inferentia compiles one graph per shape)."""

    batch_size: int = bounded(1, lo=1, hi=64)
    sequence_length: int = bounded(2048, lo=16, hi=32768)
    num_cores: int = bounded(2, lo=1, hi=24)
    auto_cast_type: str = choice("bf16", "fp16", "fp32", default="bf16")


@dataclass(frozen=True)
class AwsSageMakerTarget:
    """`pkg deploy --target aws-sagemaker`: a GPU (ml.g5 / ml.g6) or Inferentia (ml.inf2) endpoint with autoscaling.

    `min_instances = 0` (scale to zero) needs `mode = "async"`: requests wait in S3 while no instance runs.
    """

    region: str | None = None
    endpoint_url: str | None = None
    instance_type: str = field(default="ml.g5.xlarge", metadata={"choices": SAGEMAKER_INSTANCE_TYPES})
    mode: str = choice("realtime", "async", default="realtime")
    min_instances: int = bounded(1, lo=0, hi=100)
    max_instances: int = bounded(2, lo=1, hi=100)
    scaling_metric: str = choice("invocations", "concurrency", "backlog", default="invocations")
    scaling_target: float = bounded(8.0, lo=0.1)
    scale_in_cooldown_seconds: int = bounded(300, lo=0, hi=3600)
    scale_out_cooldown_seconds: int = bounded(60, lo=0, hi=3600)
    max_concurrent_invocations: int = bounded(4, lo=1, hi=1000)  # per instance, async mode
    startup_timeout_seconds: int = bounded(600, lo=60, hi=3600)
    log_retention_days: int = field(default=30, metadata={"choices": _LOG_RETENTION_DAYS})
    neuron: NeuronSection = field(default_factory=NeuronSection)


@dataclass(frozen=True)
class EdgeTarget:
    """`pkg push` / `pkg rollback`: devices running `python -m runtime agent`; flags override these."""

    devices: list[str] = field(default_factory=list)  # agent URLs, e.g. http://10.0.0.7:8470
    token_file: str | None = None  # default: $ONNXFN_EDGE_TOKEN
    ca_file: str | None = None  # CA of https agents
    client_cert: str | None = None  # for agents started with --client-ca (mutual TLS)
    client_key: str | None = None
    chunk_mb: int = bounded(8, lo=1, hi=512)


@dataclass(frozen=True)
class GreengrassTarget:
    """`pkg deploy --target greengrass`: a Greengrass v2 component (artifacts in S3) deployed to a thing group."""

    region: str | None = None
    endpoint_url: str | None = None  # every service; $AWS_ENDPOINT_URL_GREENGRASSV2 redirects Greengrass alone
    thing_group: str | None = None  # required to deploy
    component_name: str | None = None  # default: onnxfn.NAME
    mode: str = choice("agent", "worker", default="agent")
    bucket: str | None = None  # default: onnxfn-NAME-greengrass-ACCOUNT-REGION, created and owned by the deploy
    port: int = bounded(8470, lo=1, hi=65535)  # agent mode
    token_secret: str | None = None  # agent mode: Secrets Manager secret holding the agent token
    token_file: str | None = None  # agent mode: a file on the device holding it
    queue_url: str | None = None  # worker mode
    failure_handling: str = choice("ROLLBACK", "DO_NOTHING", default="ROLLBACK")
    update_timeout_seconds: int = bounded(60, lo=1, hi=86400)
    install_timeout_seconds: int = bounded(900, lo=30, hi=86400)


JETPACK_RELEASES = ("6.1", "6.0")


@dataclass(frozen=True)
class JetsonTarget:
    """`pkg deploy --target jetson`, run on the Jetson: the agent with TensorRT and CUDA, bundles pushed to it."""

    jetpack: str = choice(*JETPACK_RELEASES, default="6.1")
    wheel: str | None = None  # the aarch64 onnxruntime-gpu wheel for that JetPack (not on PyPI)
    bundle_root: str = "/var/lib/onnxfn"  # persistent: bundles and their TensorRT engine caches
    port: int = bounded(8470, lo=1, hi=65535)
    token_file: str | None = None  # default: $ONNXFN_EDGE_TOKEN, written to build/NAME/jetson/agent-token


@dataclass(frozen=True)
class RayTarget:
    """`pkg deploy --target ray`: a Ray Serve application on a Ray cluster (packager/targets/ray/); its replicas
    fetch the bundle by digest from `bundle_store` into each node's cache."""

    address: str | None = None  # a running cluster's GCS, HOST:PORT; unset: pkg starts a local head
    bundle_store: str | None = None  # s3://BUCKET/PREFIX or a folder every node mounts; unset: local head only
    endpoint_url: str | None = None  # the S3 store's endpoint (default: $AWS_ENDPOINT_URL, else AWS)
    region: str | None = None  # the S3 store's region
    cache_dir: str = "/tmp/onnxfn-bundles"  # on each node; $ONNXFN_BUNDLE_CACHE set on a node wins
    route_prefix: str | None = None  # default: /NAME
    min_replicas: int = bounded(1, lo=0, hi=1000)  # 0 = scale to zero
    max_replicas: int = bounded(2, lo=1, hi=1000)
    target_ongoing_requests: float = bounded(0.0, lo=0.0)  # per replica; 0 = runtime.max_batch
    idle_timeout: int = bounded(300, lo=1, hi=86400)  # seconds of lower load before replicas go
    upscale_delay: int = bounded(5, lo=0, hi=3600)  # seconds of higher load before replicas are added
    max_queued_requests: int = bounded(32, lo=1)  # waiting in the proxy for a replica; more get 429
    num_cpus: float = bounded(1.0, lo=0.0)  # per replica
    num_gpus: float = bounded(0.0, lo=0.0)
    resources: dict[str, float] = field(default_factory=dict)  # custom resources per replica
    http_host: str = "127.0.0.1"  # Serve's proxy, when pkg starts Serve
    http_port: int = bounded(8000, lo=1, hi=65535)
    allowed_hosts: list[str] = field(default_factory=list)  # DNS names clients reach the proxy by
    image: str | None = None  # --emit-kubernetes: a Ray 2.60 image with onnxfn's runtime


@dataclass(frozen=True)
class TargetsSection:
    local: LocalTarget = field(default_factory=LocalTarget)
    aws_lambda: AwsLambdaTarget = field(default_factory=AwsLambdaTarget, metadata={"key": "aws-lambda"})
    aws_sagemaker: AwsSageMakerTarget = field(default_factory=AwsSageMakerTarget, metadata={"key": "aws-sagemaker"})
    edge: EdgeTarget = field(default_factory=EdgeTarget)
    greengrass: GreengrassTarget = field(default_factory=GreengrassTarget)
    jetson: JetsonTarget = field(default_factory=JetsonTarget)
    ray: RayTarget = field(default_factory=RayTarget)


@dataclass(frozen=True)
class ImageSection:
    """Present in function.toml = `pkg build` also writes an OCI image (and pushes it when `registry` is set)."""

    platforms: list[str] = field(
        default_factory=lambda: ["linux/amd64"], metadata={"item_choices": ("linux/amd64", "linux/arm64")}
    )
    registry: str | None = None  # HOST[:PORT]/REPOSITORY[:TAG]; credentials come from the environment
    tag: str = "latest"


@dataclass(frozen=True)
class AdapterSection:
    """One `[[adapters]]` entry: a LoRA adapter served as `model: "FUNCTION:NAME"`."""

    name: str
    # A PEFT folder (adapter_config.json + adapter_model.safetensors) or a llama.cpp GGUF LoRA file,
    # relative to the function folder.
    source: str


@dataclass(frozen=True)
class FunctionSpec:
    name: str
    model: ModelSection
    export: ExportSection = field(default_factory=ExportSection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    endpoint: EndpointSection = field(default_factory=EndpointSection)
    targets: TargetsSection = field(default_factory=TargetsSection)
    image: ImageSection | None = None
    adapters: list[AdapterSection] = field(default_factory=list)
    # Where the spec was read from, and the sha256 of its parsed values; not keys of the TOML file.
    directory: Path = field(default=Path("."), metadata={"internal": True})
    digest: str = field(default="", metadata={"internal": True})


def spec_table(value: Any) -> Any:
    """A spec (or one of its sections) as the TOML table it resolves to: every key, defaults filled in, under its
    TOML name (`aws-lambda`); an absent optional table is None. What `pkg validate --json` reports."""
    if hasattr(value, "__dataclass_fields__"):
        return {
            f.metadata.get("key", f.name): spec_table(getattr(value, f.name))
            for f in fields(value)
            if not f.metadata.get("internal")
        }
    if isinstance(value, list | tuple):
        return [spec_table(item) for item in value]
    return value


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
    digest = _table_digest(table)
    problems: list[str] = []
    values = _parse_table(FunctionSpec, table, "", problems)
    if problems:
        raise SpecError(path, problems)
    values.update(directory=path.parent, digest=digest)
    spec = FunctionSpec(**values)
    _check_cross_field(spec, path)
    return spec


def _table_digest(table: dict[str, Any]) -> str:
    """The sha256 of the parsed table: editing a comment or the layout of the file changes no bundle."""
    canonical = json.dumps(table, sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def _check_cross_field(spec: FunctionSpec, path: Path) -> None:
    problems = []
    limit = spec.endpoint.max_prompt_tokens
    if limit is not None and limit >= spec.export.max_context:
        problems.append(
            f"endpoint.max_prompt_tokens = {limit} must be below export.max_context = {spec.export.max_context}"
        )
    allowed = ENCODER_PRECISIONS if spec.model.task in ENCODER_TASKS else DECODER_PRECISIONS
    if spec.export.precision not in allowed:
        problems.append(
            f"export.precision = {spec.export.precision!r} does not apply to model.task = {spec.model.task!r}; "
            f"choose from {', '.join(allowed)}"
        )
    if spec.runtime.decode == "throughput" and not (
        spec.model.task not in ENCODER_TASKS and spec.export.prefill_graph and spec.runtime.providers[:1] == ["cpu"]
    ):
        problems.append(
            "runtime.decode = 'throughput' decodes through the prefill graph: it needs a generative model.task, "
            "export.prefill_graph = true and 'cpu' first in runtime.providers"
        )
    problems += _adapter_problems(spec)
    if not spec.name.replace("-", "").replace("_", "").isalnum():
        problems.append(f"name = {spec.name!r}: use letters, digits, '-' and '_' only")
    if problems:
        raise SpecError(path, problems)


def _adapter_problems(spec: FunctionSpec) -> list[str]:
    problems = []
    names = [a.name for a in spec.adapters]
    if spec.adapters and spec.model.task in ENCODER_TASKS:
        problems.append(f"[[adapters]]: LoRA adapters serve text generation; model.task = {spec.model.task!r}")
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"adapters: the name {name!r} is declared twice; each adapter needs its own name")
    for name in names:
        if not ADAPTER_NAME.match(name):
            problems.append(f"adapters: name = {name!r} is not valid: {ADAPTER_NAME_RULE}")
    return problems


def _parse_table(cls: type, table: Any, prefix: str, problems: list[str]) -> dict[str, Any]:
    if not isinstance(table, dict):
        problems.append(f"[{prefix.rstrip('.')}] must be a table, got {table!r}")
        return {}
    hints = typing.get_type_hints(cls)
    # A TOML key that is not a Python name (`aws-lambda`) is given in the field's metadata.
    known = {f.metadata.get("key", f.name): f for f in fields(cls) if not f.metadata.get("internal")}
    for key in table.keys() - known.keys():
        problems.append(f"{prefix}{key}: unknown key; allowed keys here: {', '.join(sorted(known))}")
    values: dict[str, Any] = {}
    for name, spec_field in known.items():
        key = prefix + name
        if name not in table:
            if spec_field.default is MISSING and spec_field.default_factory is MISSING:
                problems.append(f"{key}: required key is missing")
            continue
        hint = _optional_section(hints[spec_field.name])
        item: Any = typing.get_args(hint)[0] if typing.get_origin(hint) is list else None
        if hasattr(item, "__dataclass_fields__"):  # an array of tables, [[adapters]]
            if not isinstance(table[name], list):
                problems.append(f"{key} must be an array of tables ([[{key}]]), got {table[name]!r}")
                continue
            before = len(problems)
            parsed = [_parse_table(item, entry, f"{key}[{i}].", problems) for i, entry in enumerate(table[name])]
            if len(problems) == before:
                values[spec_field.name] = [item(**entry) for entry in parsed]
        elif isinstance(hint, type) and hasattr(hint, "__dataclass_fields__"):
            before = len(problems)
            nested = _parse_table(hint, table[name], key + ".", problems)
            if len(problems) == before:
                values[spec_field.name] = hint(**nested)
        else:
            values[spec_field.name] = _check_value(key, table[name], hint, spec_field.metadata, problems)
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
    if typing.get_origin(expected) is dict:  # a table of numbers, such as [targets.ray] resources
        numbers = isinstance(value, dict) and all(
            isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in value.values()
        )
        if not numbers:
            problems.append(f"{key} = {value!r}: expected a table of numbers >= 0, e.g. {{ neuron_cores = 2 }}")
        return {k: float(v) for k, v in value.items()} if numbers else value
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
