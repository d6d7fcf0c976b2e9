"""The `ray` target's parts that need no cluster: its settings, the Serve options it derives, the bundle fetch a
replica runs, the proxy middleware (driven as Serve's proxy drives it: raw ASGI), and the KubeRay RayService,
checked offline against Kubernetes' schemas and by Ray's own Serve config model."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
import yaml

from packager.errors import UserError
from packager.spec import SpecError, load_spec
from packager.targets.ray.application import check_settings, deployment_options, max_ongoing_requests
from runtime.bundle import BundleError, read_manifest
from runtime.bundle_fetch import fetch_bundle, folder_opener
from runtime.ray_serve.proxy_errors import ServeErrorsAsOpenAI
from runtime.ray_serve.settings import ReplicaSettings
from tests.conftest import REPO


def spec_with(tmp_path: Path, ray: str, extra: str = ""):  # type: ignore[no-untyped-def]
    folder = tmp_path / "functions" / "fn"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "function.toml").write_text(f'name = "fn"\n[model]\nsource = "hf:x"\n{extra}\n[targets.ray]\n{ray}\n')
    return load_spec(folder)


def test_the_settings_say_every_problem_at_once(tmp_path: Path) -> None:
    spec = spec_with(tmp_path, 'address = "10.0.0.1:6379"\nmin_replicas = 3\nmax_replicas = 2\nroute_prefix = "x/"\n'
                     'resources = { CPU = 1 }')  # fmt: skip
    with pytest.raises(UserError) as refused:
        check_settings(spec)
    message = str(refused.value)
    for expected in ("min_replicas = 3 is above max_replicas = 2", "route_prefix = 'x/'", "bundle_store is not",
                     "'CPU' is Ray's own"):  # fmt: skip
        assert expected in message
    assert refused.value.exit_code == 2
    with pytest.raises(SpecError, match="expected a table of numbers >= 0"):
        spec_with(tmp_path, 'resources = { neuron_cores = "two" }')


def test_serve_options_follow_the_runtime_and_the_target(tmp_path: Path) -> None:
    spec = spec_with(
        tmp_path,
        'min_replicas = 0\nmax_replicas = 5\nidle_timeout = 30\nnum_gpus = 1\nresources = { neuron_cores = 2 }',
        "[runtime]\nmax_batch = 6\nmax_queue = 2",
    )  # fmt: skip
    options = deployment_options(spec)
    assert max_ongoing_requests(spec) == options["max_ongoing_requests"] == 2  # the engine queues only 2
    scaling = options["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"], scaling["target_ongoing_requests"]) == (0, 5, 6.0)
    assert scaling["downscale_delay_s"] == 30.0
    assert options["backpressure_config"]["status_code"] == 429 and options["backpressure_config"]["retry_after_s"]
    assert options["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1.0, "resources": {"neuron_cores": 2.0}}
    # The application's args are plain JSON and read back the same.
    settings = ReplicaSettings("fn", "sha256:" + "a" * 64, "s3://b/p", ["--max-batch", "6"], options)
    assert ReplicaSettings.from_args(json.loads(json.dumps(settings.to_args()))) == settings
    assert settings.bundle_location() == f"s3://b/p/bundles/{'a' * 64}/"
    with pytest.raises(ValueError, match="unknown \\['extra'\\]"):
        ReplicaSettings.from_args({**settings.to_args(), "extra": 1})


def _fetch(store: str, digest: str, cache: str) -> str:
    return str(fetch_bundle(store, folder_opener(Path(store)), digest, Path(cache)))


def test_a_shared_folder_store_is_fetched_once_per_cache_and_verified(demo_bundle: Path, tmp_path: Path) -> None:
    digest = read_manifest(demo_bundle).digest
    store = tmp_path / "store"
    shutil.copytree(demo_bundle, store, symlinks=False)
    cache = tmp_path / "cache"
    # Two replicas starting on one node at once: one fetch, the other finds it.
    context = multiprocessing.get_context("spawn")
    with context.Pool(2) as pool:
        paths = pool.starmap(_fetch, [(str(store), digest, str(cache))] * 2)
    assert len(set(paths)) == 1 and [p.name for p in cache.iterdir()] == [Path(paths[0]).name]
    assert read_manifest(Path(paths[0])).digest == digest
    with pytest.raises(BundleError, match="has digest"):
        _fetch(str(store), "sha256:" + "0" * 64, str(tmp_path / "other"))
    (store / "tokenizer.json").write_text("{}")  # the store holds no trust: a changed file is refused
    with pytest.raises(BundleError, match="tokenizer.json .* does not match the manifest"):
        _fetch(str(store), digest, str(tmp_path / "tampered"))
    assert list((tmp_path / "tampered").iterdir()) == []


def _drive(app: Any, accept: str = "application/json") -> tuple[list[dict[str, Any]], bytes]:
    """One request through the middleware around `app`, as Serve's proxy's ASGI server would send it."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/fn/v1/chat/completions",
        "headers": [(b"accept", accept.encode())],
    }
    asyncio.run(ServeErrorsAsOpenAI(app)(scope, receive, send))
    return sent, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_serve_s_own_answers_become_openai_errors_and_a_broken_stream_ends_with_one() -> None:
    async def queue_full(scope: Any, receive: Any, send: Any) -> None:
        headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"retry-after", b"1")]
        await send({"type": "http.response.start", "status": 429, "headers": headers})
        await send({"type": "http.response.body", "body": b"Request dropped due to backpressure", "more_body": False})

    sent, body = _drive(queue_full)
    assert sent[0]["status"] == 429 and (b"retry-after", b"1") in sent[0]["headers"]
    assert json.loads(body)["error"] == {
        "message": "Ray Serve: Request dropped due to backpressure",
        "type": "rate_limit_error",
        "param": None,
        "code": "serve_queue_full",
    }
    sent, body = _drive(queue_full, accept="application/msgpack")
    assert msgpack.unpackb(body)["error"]["code"] == "serve_queue_full"

    async def replica_dies_mid_stream(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b'data: {"choices": []}\n\n', "more_body": True})
        # Serve's proxy stops here: its replica is gone, and it sends nothing more

    sent, body = _drive(replica_dies_mid_stream)
    assert sent[-1] == {"type": "http.response.body", "body": sent[-1]["body"], "more_body": False}
    last = body.decode().strip().split("\n\n")[-1]
    assert last.startswith("data: ") and json.loads(last[6:])["error"]["code"] == "replica_lost"
    assert "[DONE]" not in body.decode()

    async def nothing_answered(scope: Any, receive: Any, send: Any) -> None:
        return None  # a replica lost before it answered: Serve's proxy sends no response at all

    sent, body = _drive(nothing_answered)
    assert sent[0]["status"] == 502 and json.loads(body)["error"]["code"] == "replica_lost"

    async def replica_answer(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 429, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"error": {"code": "engine_overloaded"}}'})

    sent, body = _drive(replica_answer)  # the replica's own errors pass untouched
    assert json.loads(body)["error"]["code"] == "engine_overloaded" and len(sent) == 2


RAY_TABLE = """address = "10.1.2.3:6379"
bundle_store = "s3://models/onnxfn"
endpoint_url = "{endpoint}"
region = "us-east-1"
min_replicas = 0
max_replicas = 4
num_gpus = 1
resources = {{ neuron_cores = 2 }}
image = "registry.example.com/onnxfn/ray-runtime:2.60.0"
"""


@pytest.fixture
def emitting(tmp_path: Path, demo_bundle: Path, moto_server: Any) -> Path:
    moto_server.client("s3").create_bucket(Bucket="models")
    folder = tmp_path / "functions" / "smollm2-chat"
    folder.mkdir(parents=True)
    toml = (REPO / "functions" / "smollm2-chat" / "function.toml").read_text()
    (folder / "function.toml").write_text(
        toml + "\n[targets.ray]\n" + RAY_TABLE.format(endpoint=moto_server.endpoint_url)
    )
    (tmp_path / "build" / "smollm2-chat").mkdir(parents=True)
    (tmp_path / "build" / "smollm2-chat" / "bundle").symlink_to(demo_bundle.resolve())
    return tmp_path


def test_emit_kubernetes_writes_a_rayservice_that_checks_offline(emitting: Path, moto_server: Any) -> None:
    import kubernetes_validate
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.schema import ServeDeploySchema

    out = emitting / "k8s"
    result = subprocess.run(
        [sys.executable, "-m", "packager.cli", "deploy", "functions/smollm2-chat", "--target", "ray",
         "--emit-kubernetes", str(out), "--json"],
        cwd=emitting, capture_output=True, text=True, env={**os.environ, **moto_server.env, "COLUMNS": "250"},
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["kubernetes"] == [str(out / "rayservice.yaml")]
    document = yaml.safe_load((out / "rayservice.yaml").read_text())
    assert (document["apiVersion"], document["kind"]) == ("ray.io/v1", "RayService")
    cluster = document["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == "2.60.0" and cluster["enableInTreeAutoscaling"] is True
    (workers,) = cluster["workerGroupSpecs"]
    assert (workers["minReplicas"], workers["maxReplicas"]) == (0, 4)
    assert json.loads(json.loads(workers["rayStartParams"]["resources"])) == {"neuron_cores": 2.0}
    limits = workers["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "1" and limits["aws.amazon.com/neuroncore"] == "2"
    # The pod templates are Kubernetes' own PodTemplateSpec: its schema (strict: no unknown field) accepts them.
    for group in (cluster["headGroupSpec"], workers):
        template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": group["template"]}
        kubernetes_validate.validate(template, "1.33", strict=True)
    # The API key is a reference to a Secret, never a value.
    env = {e["name"]: e for e in workers["template"]["spec"]["containers"][0]["env"]}
    assert env["ONNXFN_API_KEY"] == {"name": "ONNXFN_API_KEY", "valueFrom": {"secretKeyRef": {
        "name": "onnxfn-smollm2-chat-api-key", "key": "api-key"}}}  # fmt: skip
    # The Serve config is Ray's own schema, and Ray builds the application from it (its deployment options too).
    config = ServeDeploySchema.model_validate(yaml.safe_load(document["spec"]["serveConfigV2"]))
    (app,) = config.applications
    assert app.import_path == "runtime.ray_serve.app:build" and app.route_prefix == "/smollm2-chat"
    from ray._common.utils import import_attr

    built = call_user_app_builder_with_args_if_necessary(import_attr(app.import_path), app.args)
    assert built._bound_deployment.name == "smollm2-chat"
    assert built._bound_deployment._deployment_config.autoscaling_config.max_replicas == 4
    # The bundle the pods fetch is in the store.
    digest = app.args["bundle_digest"].removeprefix("sha256:")
    s3 = moto_server.client("s3")
    assert s3.head_object(Bucket="models", Key=f"onnxfn/bundles/{digest}/manifest.json")


def test_emit_kubernetes_refuses_without_an_image(emitting: Path, moto_server: Any) -> None:
    spec_file = emitting / "functions" / "smollm2-chat" / "function.toml"
    spec_file.write_text(spec_file.read_text().replace('image = "registry.example.com/onnxfn/ray-runtime:2.60.0"', ""))
    result = subprocess.run(
        [sys.executable, "-m", "packager.cli", "deploy", "functions/smollm2-chat", "--target", "ray",
         "--emit-kubernetes", "k8s"],
        cwd=emitting, capture_output=True, text=True, env={**os.environ, **moto_server.env, "COLUMNS": "250"},
    )  # fmt: skip
    assert result.returncode == 2 and "targets.ray.image is not set" in result.stderr
    assert "Traceback" not in result.stderr


def test_other_targets_refuse_emit_kubernetes(emitting: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "packager.cli", "deploy", "functions/smollm2-chat", "--emit-kubernetes", "k8s"],
        cwd=emitting, capture_output=True, text=True, env={**os.environ, "COLUMNS": "250"},
    )  # fmt: skip
    assert result.returncode == 2 and "use --target ray" in result.stderr


def test_ray_is_imported_only_by_the_ray_target_and_host() -> None:
    from tests.cli.test_import_graph import module_files
    from tests.cli.test_runtime_layers import imported_names, within

    users = sorted(
        name
        for name, path in module_files().items()
        if any(within(imported, "ray") for imported in imported_names(path))
    )
    assert users and all(within(u, "runtime.ray_serve") or within(u, "packager.targets.ray") for u in users), users
    # The runtime's other rooms never reach the Ray host either.
    outside = [name for name, path in module_files().items() if within(name, "runtime") and not within(
        name, "runtime.ray_serve") and any(within(i, "runtime.ray_serve") for i in imported_names(path))]  # fmt: skip
    assert outside == []
