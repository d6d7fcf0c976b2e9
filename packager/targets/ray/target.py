"""The `ray` target: the function as a Ray Serve application on a Ray cluster (`pip install onnxfn[ray]`).

Resources, in order: the local head (only when `[targets.ray] address` is unset: `local_head.py`), the bundle
in the store every node fetches from (`store.py`), and the Serve application (`cluster.py`), whose replicas
fetch the bundle by digest into their node's cache and serve the runtime's HTTP app behind Serve's proxy
(`runtime/ray_serve/`). The record is `build/NAME/ray/state.json`; the API key, when generated, `api-key`
beside it (handed to the replicas in their runtime environment, never written into a Serve config).

`--emit-kubernetes DIR` writes the same application as a KubeRay RayService instead (`kubernetes.py`).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from packager.errors import UserError
from packager.paths import build_dir, bundle_dir
from packager.progress import StepProgress
from packager.spec import FunctionSpec
from packager.targets.base import HttpEndpoint, LogLine, Removal, Target, TargetStatus
from packager.targets.local.records import ApiKey
from packager.targets.ray import cluster, local_head, store
from packager.targets.ray.application import (
    TARGET,
    check_settings,
    describe_scaling,
    replica_settings,
    route_prefix,
)
from packager.targets.ray.records import RayDeployment, RayPlan
from runtime.bundle import BundleError, read_manifest

KEY_FILE = "api-key"
LOG_POLL = 1.0
INVOKE_TIMEOUT = 300.0  # a request may wait for a replica to start from zero


def state_dir(spec: FunctionSpec) -> Path:
    return build_dir(spec) / TARGET


def bundle_store(spec: FunctionSpec) -> str:
    """`[targets.ray] bundle_store`, else (a local head: every node shares this disk) a folder beside the build."""
    return spec.targets.ray.bundle_store or str((state_dir(spec) / "store").resolve())


def api_key(spec: FunctionSpec) -> ApiKey:
    env_name = spec.endpoint.api_key_env
    if env_name is None:
        return ApiKey("none")
    if os.environ.get(env_name, "").strip():
        return ApiKey("env", env_name)
    return ApiKey("file", str((state_dir(spec) / KEY_FILE).resolve()))


def plan(spec: FunctionSpec) -> RayPlan:
    """What would change; reads the cluster (when it runs) and the store, changes nothing."""
    check_settings(spec)
    bundle = bundle_dir(spec)
    try:
        manifest = read_manifest(bundle)
    except BundleError as exc:
        raise UserError(f"{exc}\nbuild it first: pkg build {spec.directory}") from exc
    address = spec.targets.ray.address
    head = local_head.running() if address is None else None
    where = bundle_store(spec)
    settings = replica_settings(spec, manifest.digest, where, api_key_env=spec.endpoint.api_key_env)
    key = api_key(spec)
    deployed, state = None, None
    reach = address or (head.address if head else None)
    if reach is not None:
        with cluster.connected(reach, loopback=address is None):
            status = cluster.app_status(spec.name)
        state = status.status if status else None
        deployed = RayDeployment.load(state_dir(spec)) if status else None
    return RayPlan(
        spec=spec, address=address, head=head, bundle=bundle, bundle_files=len(manifest.files) + 1, store=where,
        store_has_bundle=store.present(spec, where, manifest.digest), settings=settings,
        settings_digest=_digest(settings.to_args(), key), route_prefix=route_prefix(spec), api_key=key,
        deployed=deployed, application_state=state,
    )  # fmt: skip


def _digest(args: dict[str, Any], key: ApiKey) -> str:
    """Of what the replicas are given, the key's value included (hashed): a new key is an update."""
    current = key.read() if key.source != "file" or Path(key.location).is_file() else ""
    text = json.dumps(args, sort_keys=True) + hashlib.sha256((current or "").encode()).hexdigest()
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def apply(plan: RayPlan, progress: StepProgress, ready_timeout: float) -> RayDeployment:
    spec, settings = plan.spec, plan.settings
    address = plan.address
    if address is None:
        with progress.step("head", "start a Ray head on 127.0.0.1 (loopback only)") as step:
            head, started = local_head.ensure()
            if not started:
                step.cached()
        address = head.address
        if started:
            progress.console.print(
                f"  started a Ray head at {head.address} (log: {head.log_file}); `pkg destroy --target ray` of the "
                "last function on it stops it", highlight=False,
            )  # fmt: skip
    with progress.step("bundle", f"put the bundle into {settings.bundle_location()}") as step:
        if plan.store_has_bundle:
            step.cached()
        else:
            written = store.upload(spec, plan.bundle, plan.store, settings.bundle_digest)
            progress.console.print(f"  {written / 1e6:.1f} MB written", highlight=False)
    key = _ensure_key(plan.api_key)
    args = settings.to_args()
    if key is not None and settings.api_key_env:
        # Into the replicas' runtime environment, not the application's args: `serve status` shows args.
        args["deployment"]["ray_actor_options"]["runtime_env"] = {"env_vars": {settings.api_key_env: key}}
    local = plan.address is None
    deploying = f"deploy {spec.name} on Ray Serve and wait for it to run"
    with progress.step("serve", deploying), cluster.connected(address, loopback=local):
        proxy = cluster.ensure_serve(spec.targets.ray.http_host, spec.targets.ray.http_port, head_only=local)
        from runtime.ray_serve.app import build

        cluster.deploy(build(args), spec.name, plan.route_prefix, ready_timeout)
    deployment = RayDeployment(
        function=spec.name, address=address, local_head=plan.address is None, application=spec.name,
        route_prefix=plan.route_prefix, url=proxy + plan.route_prefix, bundle_digest=settings.bundle_digest,
        bundle_location=settings.bundle_location(), settings_digest=_digest(settings.to_args(), plan.api_key),
        api_key_source=plan.api_key.source, api_key_location=plan.api_key.location, scaling=describe_scaling(spec),
        updated_at=time.time(),
    )  # fmt: skip
    deployment.save(state_dir(spec))
    return deployment


def _ensure_key(key: ApiKey) -> str | None:
    if key.source == "file" and not Path(key.location).is_file():
        path = Path(key.location)
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(secrets.token_urlsafe(32))
    return key.read()


def status(spec: FunctionSpec) -> TargetStatus | None:
    deployment = RayDeployment.load(state_dir(spec))
    if deployment is None:
        return None
    if deployment.local_head and local_head.running() is None:
        return TargetStatus(TARGET, deployment.url, deployment.bundle_digest, "exited", deployment=deployment,
                            detail="the local Ray head is not running: pkg deploy starts it again")  # fmt: skip
    with cluster.connected(deployment.address, loopback=deployment.local_head):
        found = cluster.app_status(deployment.application)
    if found is None:
        return TargetStatus(
            TARGET,
            deployment.url,
            deployment.bundle_digest,
            "missing",
            deployment=deployment,
            detail=f"no application {deployment.application} on the cluster at {deployment.address}",
        )
    running = found.running()
    if found.status == "RUNNING":
        state = "ready" if running else "idle"
    else:
        state = {"DEPLOYING": "updating", "DELETING": "updating"}.get(found.status, "failed")
    nodes = sorted({f"{r.node_id[:8]} ({', '.join(r.node_resources) or 'no custom resources'})"
                    for r in found.replicas if r.state == "RUNNING"})  # fmt: skip
    detail = f"{running} replica(s) running" + (f" on node(s) {'; '.join(nodes)}" if nodes else ": scaled to zero")
    if found.message:
        detail += f"; Serve: {found.message}"
    return TargetStatus(TARGET, deployment.url, deployment.bundle_digest, state, detail=detail, deployment=deployment)


def destroy(spec: FunctionSpec) -> Removal | None:
    deployment = RayDeployment.load(state_dir(spec))
    if deployment is None:
        return None
    removed: list[str] = []
    head = local_head.running() if deployment.local_head else None
    if not deployment.local_head or head is not None:
        with cluster.connected(deployment.address, loopback=deployment.local_head):
            if cluster.delete(deployment.application):
                removed.append(f"serve-application {deployment.application} ({deployment.url})")
            others = cluster.applications()
        if head is not None and not others:
            local_head.stop(head)
            removed.append(f"ray-head {head.address} (the local head pkg started; no application left on it)")
    (state_dir(spec) / "state.json").unlink(missing_ok=True)
    if deployment.api_key_source == "file":
        Path(deployment.api_key_location).unlink(missing_ok=True)
    return Removal(
        f"removed {spec.name} from Ray at {deployment.address}; the bundle stays in {deployment.bundle_location} "
        "and in the nodes' caches (content-addressed: a redeploy of it fetches nothing)",
        tuple(removed),
    )


def http_endpoint(spec: FunctionSpec) -> HttpEndpoint:
    deployment = RayDeployment.load(state_dir(spec))
    if deployment is None:
        raise UserError(f"{spec.name} is not deployed on Ray; deploy it: pkg deploy {spec.directory} --target ray")
    key = deployment.api_key.read()
    return HttpEndpoint(deployment.url, {"Authorization": f"Bearer {key}"} if key else {})


def logs(spec: FunctionSpec, *, follow: bool, tail: int | None) -> Iterator[LogLine]:
    deployment = RayDeployment.load(state_dir(spec))
    if deployment is None:
        raise UserError(f"{spec.name} is not deployed on Ray; deploy it: pkg deploy {spec.directory} --target ray")
    offsets: dict[str, int] = {}
    with cluster.connected(deployment.address, loopback=deployment.local_head):
        first = True
        while first or follow:
            found = cluster.replica_logs(deployment.application, offsets)
            for name, (size, lines) in sorted(found.items()):
                shown = lines[-tail:] if first and tail else lines
                for line in shown:
                    yield LogLine(line, stream=name.removesuffix(".log"))
                offsets[name] = size
            if first and not found:
                yield LogLine(f"no replica log on any node yet ({deployment.application} may be scaled to zero)")
            first = False
            if follow:
                time.sleep(LOG_POLL)


class Ray(Target):
    name = TARGET

    def plan(self, spec: FunctionSpec, progress: StepProgress) -> RayPlan:
        return plan(spec)

    def apply(self, plan: RayPlan, progress: StepProgress) -> RayDeployment:
        return apply(plan, progress, self.ready_timeout)

    def status(self, spec: FunctionSpec) -> TargetStatus | None:
        return status(spec)

    def destroy(self, spec: FunctionSpec) -> Removal | None:
        return destroy(spec)

    def http_endpoint(self, spec: FunctionSpec) -> HttpEndpoint:
        return http_endpoint(spec)

    def invoke(self, spec: FunctionSpec, path: str, body: dict[str, Any]) -> dict[str, Any]:
        endpoint = http_endpoint(spec)
        try:
            response = httpx.post(f"{endpoint.url}{path}", json=body, headers=endpoint.headers, timeout=INVOKE_TIMEOUT)
        except httpx.HTTPError as exc:
            raise UserError(f"Ray Serve's proxy at {endpoint.url} did not answer: {exc}") from exc
        if response.status_code >= 400:
            raise UserError(f"{spec.name} on Ray answered {response.status_code}: {response.text[:2000]}")
        answer: dict[str, Any] = response.json()
        return answer

    def logs(
        self, spec: FunctionSpec, *, follow: bool, since_seconds: float | None, tail: int | None
    ) -> Iterator[LogLine]:
        return logs(spec, follow=follow, tail=tail)

    def scaling(self, spec: FunctionSpec) -> tuple[int | str, int | str]:
        return spec.targets.ray.min_replicas, spec.targets.ray.max_replicas

    def emit_kubernetes(self, spec: FunctionSpec, out: Path, progress: StepProgress) -> list[Path]:
        from packager.targets.ray.kubernetes import write_rayservice

        written: list[Path] = write_rayservice(spec, out, progress)
        return written
