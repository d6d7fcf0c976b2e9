"""`pkg` as a Ray driver: connect to the cluster, start Serve where it is not running, deploy, look and delete.

Ray is imported here only, when a command talks to a cluster (`pip install onnxfn[ray]`); `pkg status` for a
function never deployed with `--target ray` imports nothing of it. A cluster that does not answer is found out
with a TCP connect to its GCS first, in a second or two: `ray.init` itself would wait about a minute.

Serve is started by the first deploy on a cluster without it: its proxy on `[targets.ray] http_host:http_port`,
on the head only for the local head `pkg` starts (a single node), on every node elsewhere (Ray's default). The
proxy's middleware (`runtime.ray_serve.proxy_errors`) comes from the nodes' environment: Ray 2.60 takes it
nowhere else. A cluster already running Serve keeps its own settings (an operator's, a RayService's); `pkg`
reads the proxy's address from it.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from packager.errors import UserError
from packager.targets.ray.nodes import LOOPBACK_ENV

CONNECT_TIMEOUT = 3.0
SERVE_NAMESPACE = "serve"
POLL = 0.5


@dataclass(frozen=True)
class ReplicaInfo:
    replica_id: str
    state: str  # Serve's: STARTING, RUNNING, STOPPING, …
    node_id: str
    node_resources: tuple[str, ...]  # the node's custom resources (what `ray start --resources` gave it)
    pid: int | None


@dataclass(frozen=True)
class AppStatus:
    status: str  # Serve's: NOT_STARTED, DEPLOYING, RUNNING, DEPLOY_FAILED, DELETING, UNHEALTHY
    message: str
    replicas: tuple[ReplicaInfo, ...]

    def running(self) -> int:
        return sum(1 for r in self.replicas if r.state == "RUNNING")


def check_reachable(address: str) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"[targets.ray] address = {address!r}: use HOST:PORT (the head's GCS port)", exit_code=2)
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT).close()
    except OSError as exc:
        raise UserError(
            f"no Ray cluster answers at {address} ({exc.strerror or exc}); start one (ray start --head) or fix "
            "[targets.ray] address"
        ) from None


@contextmanager
def connected(address: str, *, loopback: bool = False) -> Iterator[Any]:
    """This process as a driver of the cluster at `address`; yields the `ray` module. `loopback`: the cluster is
    the local head `pkg` started, bound to 127.0.0.1 (nodes.py says why Ray needs telling)."""
    check_reachable(address)
    if loopback:
        os.environ[LOOPBACK_ENV] = "0"  # read when ray is imported, below
    try:
        import ray
    except ImportError as exc:
        raise UserError("--target ray needs Ray: pip install 'onnxfn[ray]' (ray[serve]==2.60.0)") from exc
    try:
        ray.init(address=address, namespace=SERVE_NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError) as exc:
        raise UserError(f"cannot join the Ray cluster at {address}: {exc}") from exc
    try:
        yield ray
    finally:
        ray.shutdown()


def ensure_serve(http_host: str, http_port: int, *, head_only: bool) -> str:
    """Start Serve unless it runs; the URL of its HTTP proxy (as the cluster has it)."""
    from ray import serve
    from ray.serve.context import _get_global_client

    if _get_global_client(raise_if_no_controller_running=False) is None:
        location = "HeadOnly" if head_only else "EveryNode"
        serve.start(proxy_location=location, http_options={"host": http_host, "port": http_port})
    return proxy_url()


def _client() -> Any:
    """Serve's controller client, None when Serve does not run on the cluster (Ray 2.60 offers no public read of
    the proxy's address or the replicas' nodes)."""
    from ray.serve.context import _get_global_client

    return _get_global_client(raise_if_no_controller_running=False)


def proxy_url() -> str:
    """`http://HOST:PORT` of Serve's proxy; a proxy on every interface is reached on loopback from here."""
    config = _client().http_config
    host = "127.0.0.1" if config.host in ("0.0.0.0", "", None) else config.host
    return f"http://{host}:{config.port}"


def deploy(application: Any, name: str, route_prefix: str, timeout: float) -> AppStatus:
    """Deploy (or update) the application; wait until it runs, or fail with what Serve says."""
    from ray import serve

    serve.run_many(
        [serve.RunTarget(target=application, name=name, route_prefix=route_prefix)],
        wait_for_applications_running=False,
    )
    deadline = time.monotonic() + timeout
    while True:
        status = app_status(name)
        if status is not None and status.status == "RUNNING":
            return status
        if status is not None and status.status == "DEPLOY_FAILED":
            raise UserError(f"Ray Serve could not deploy {name}: {status.message}\nsee: pkg logs … --target ray")
        if time.monotonic() > deadline:
            detail = f"{status.status}: {status.message}" if status else "not listed"
            raise UserError(f"{name} is not running on Ray Serve after {timeout:.0f} s ({detail})")
        time.sleep(POLL)


def app_status(name: str) -> AppStatus | None:
    """The application's status and its replicas (with their nodes), None when Serve has no such application."""
    import ray

    client = _client()
    if client is None:
        return None
    details = client.get_serve_details()  # the controller's own record, dashboard or not
    app = details.get("applications", {}).get(name)
    if app is None:
        return None
    nodes = {node["NodeID"]: node for node in ray.nodes() if node.get("Alive")}  # type: ignore[no-untyped-call]
    replicas = []
    for deployment in app.get("deployments", {}).values():
        for replica in deployment.get("replicas", []):
            node = nodes.get(replica.get("node_id") or "", {})
            custom = tuple(sorted(k for k in node.get("Resources", {}) if _custom(k)))
            replicas.append(
                ReplicaInfo(replica["replica_id"], replica["state"], replica.get("node_id") or "", custom,
                            replica.get("pid"))
            )  # fmt: skip
    return AppStatus(app["status"], app.get("message", ""), tuple(replicas))


def _custom(resource: str) -> bool:
    return resource not in ("CPU", "GPU", "memory", "object_store_memory") and not resource.startswith("node:")


def delete(name: str) -> bool:
    from ray import serve

    if app_status(name) is None:
        return False
    serve.delete(name)
    return True


def applications() -> list[str]:
    client = _client()
    return sorted(client.get_serve_details().get("applications", {})) if client is not None else []


def replica_logs(app: str, offsets: dict[str, int]) -> dict[str, tuple[int, list[str]]]:
    """Every node's replica log files of `app` past `offsets`, read on the nodes themselves."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from runtime.ray_serve.node_logs import read_replica_logs

    read = ray.remote(num_cpus=0)(read_replica_logs)
    pending = [
        read.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(
            app, offsets
        )
        for node in ray.nodes()  # type: ignore[no-untyped-call]
        if node.get("Alive")
    ]
    found: dict[str, tuple[int, list[str]]] = {}
    for per_node in ray.get(pending):
        found.update(per_node)  # nodes sharing one disk read the same files: one name, one file
    return found
