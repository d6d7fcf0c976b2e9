"""A real multi-node Ray cluster on this machine: a head and two worker nodes, each a `ray start --block` of its
own (its own raylet, its own custom resources, its own bundle cache), with a moto server as the S3 bundle store.

Everything runs inside a network namespace made for it, reached from the tests through a veth pair: Ray 2.60
binds its servers to loopback only when a node's address is exactly 127.0.0.1, and resolves 127.0.0.1 to the
interface that routes outside whenever one does (packager/targets/ray/nodes.py); inside a namespace without a
route outside, 127.0.0.1 stays loopback for every node. The namespace's loopback holds the cluster (GCS,
raylets, workers: nothing else can reach them), and its veth address serves Serve's proxy and moto to the
tests. `pkg` runs inside it (`ip netns exec`), as it would on the cluster's head.

Small for the 2-core CI machine: a 75 MB object store per node, the dashboard off, a 1-CPU head that takes no
replica (`head` resource only), workers of 2 CPUs each offering `replica_slot: 2`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from packager.errors import UserError
from packager.targets.ray import nodes

SUBNET = f"10.{150 + os.getpid() % 50}.{os.getpid() % 250}"
OBJECT_STORE = 80 * 1000 * 1000  # Ray's floor is 75 MiB
PROXY_PORT = 8000
MOTO_PORT = 5000
GCS_PORT = 46379  # outside Ray's worker ports (10002-19999); the namespace has its own port space
BUCKET = "onnxfn-ray-bundles"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
NODES = {
    "head": {"cpus": 1, "resources": {"head": 1}},
    "worker_a": {"cpus": 2, "resources": {"worker_a": 1, "replica_slot": 2}},
    "worker_b": {"cpus": 2, "resources": {"worker_b": 1, "replica_slot": 2}},
}
REPO = Path(__file__).resolve().parents[2]


def netns_problem() -> str | None:
    if os.geteuid() != 0:
        return "the Ray cluster runs in a network namespace, which needs root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    try:
        import ray  # noqa: F401
    except ImportError:
        return "ray is not installed (pip install 'onnxfn[ray]')"
    return None


@dataclass
class RayCluster:
    root: Path
    namespace: str = f"onnxfn-ray-{os.getpid()}"
    host_if: str = f"orh{os.getpid() % 100000}"
    node_processes: dict[str, nodes.NodeProcess] = field(default_factory=dict)
    stopped: list[nodes.NodeProcess] = field(default_factory=list)
    popens: list[subprocess.Popen[bytes]] = field(default_factory=list)
    moto: subprocess.Popen[bytes] | None = None
    started_seconds: float = 0.0

    @property
    def inside(self) -> str:
        """The namespace's veth address: Serve's proxy and moto, as the tests reach them."""
        return f"{SUBNET}.2"

    @property
    def temp_dir(self) -> str:
        """Ray's session files, this cluster's own (short: Ray's socket paths live under it)."""
        return f"/tmp/{self.namespace}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{GCS_PORT}"

    @property
    def proxy(self) -> str:
        return f"http://{self.inside}:{PROXY_PORT}"

    @property
    def moto_inside(self) -> str:
        return f"http://127.0.0.1:{MOTO_PORT}"

    @property
    def moto_outside(self) -> str:
        return f"http://{self.inside}:{MOTO_PORT}"

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.namespace]

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, **CREDENTIALS, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", **extra}

    def start(self) -> None:
        started = time.monotonic()
        self._namespace()
        self._moto()
        for name in NODES:  # one at a time: Ray gives a joining raylet 30 s, which two at once can miss when busy
            self.start_node(name)
        self.run([*nodes.ray_command()[:2], "ray.serve.scripts", "start", "--address", self.address,
                  "--proxy-location", "HeadOnly", "--http-host", "0.0.0.0", "--http-port", str(PROXY_PORT)],
                 check=True)  # fmt: skip
        self.started_seconds = time.monotonic() - started

    def start_node(self, name: str) -> nodes.NodeProcess:
        shape = NODES[name]
        flags = [
            "--node-ip-address=127.0.0.1", f"--num-cpus={shape['cpus']}", f"--object-store-memory={OBJECT_STORE}",
            f"--resources={json.dumps(shape['resources'])}", "--disable-usage-stats", f"--temp-dir={self.temp_dir}",
        ]  # fmt: skip
        if name == "head":
            flags += ["--head", f"--port={GCS_PORT}", "--include-dashboard=false"]
        else:
            flags += [f"--address={self.address}"]
        env = self.env(
            ONNXFN_BUNDLE_CACHE=str(self.cache(name)),
            RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=nodes.PROXY_CALLBACK,
            RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="5",
        )
        marker, log = f"{self.namespace}-{name}", self.root / f"{name}.log"
        try:
            node, popen = nodes.start_node(flags, marker, log, env, self.prefix())
        except UserError:  # Ray's fixed 30 s for a raylet to register ran out on a busy machine: once more
            node, popen = nodes.start_node(flags, marker, log, env, self.prefix())
        self.node_processes[name] = node
        self.popens.append(popen)
        return node

    def cache(self, name: str) -> Path:
        return self.root / f"cache-{name}"

    def stop_node(self, name: str, *, graceful: bool = True) -> list[int]:
        node = self.node_processes.pop(name)
        self.stopped.append(node)
        return nodes.stop_node(node, graceful=graceful)

    def run(
        self, command: list[str], *, check: bool = False, timeout: float = 600, cwd: Path | None = None, **env: str
    ) -> Any:
        return subprocess.run(
            [*self.prefix(), *command], capture_output=True, text=True, timeout=timeout, env=self.env(**env),
            cwd=cwd or self.root, check=check,
        )  # fmt: skip

    def serve_details(self) -> dict[str, Any]:
        """Serve's own record of every application and replica (with node ids), and the nodes' resources."""
        result = self.run([sys.executable, str(REPO / "tests" / "ray" / "serve_details.py"), self.address], check=True)
        return dict(json.loads(result.stdout))

    def processes(self) -> list[int]:
        """Every live process of the cluster's nodes, stopped ones included (nothing may outlive them)."""
        everyone = [*self.node_processes.values(), *self.stopped]
        return sorted({pid for node in everyone for pid in nodes.node_processes(node)})

    def stop(self) -> None:
        for name in list(self.node_processes)[::-1]:  # workers first, the head last
            self.stop_node(name, graceful=False)
        for popen in self.popens:
            popen.wait(timeout=30)
        if self.moto is not None:
            self.moto.kill()
            self.moto.wait(timeout=30)
        left = subprocess.run(["ip", "netns", "pids", self.namespace], capture_output=True, text=True).stdout.split()
        for pid in left:  # the namespace is this cluster's: whatever still runs in it is
            os.kill(int(pid), 9)
        subprocess.run(["ip", "netns", "del", self.namespace], capture_output=True)
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _namespace(self) -> None:
        for command in (
            ["ip", "netns", "add", self.namespace],
            ["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", "eth0", "netns", self.namespace],
            ["ip", "addr", "add", f"{SUBNET}.1/30", "dev", self.host_if],
            ["ip", "link", "set", self.host_if, "up"],
            ["ip", "-n", self.namespace, "addr", "add", f"{self.inside}/30", "dev", "eth0"],
            ["ip", "-n", self.namespace, "link", "set", "eth0", "up"],
            ["ip", "-n", self.namespace, "link", "set", "lo", "up"],
        ):
            subprocess.run(command, check=True, capture_output=True)

    def _moto(self) -> None:
        log = (self.root / "moto.log").open("wb")
        self.moto = subprocess.Popen(
            [*self.prefix(), sys.executable, "-m", "moto.server", "-H", "0.0.0.0", "-p", str(MOTO_PORT)],
            stdout=log, stderr=subprocess.STDOUT, env=self.env(),
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(self.moto_outside, timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                assert self.moto.poll() is None and time.monotonic() < deadline, (self.root / "moto.log").read_text()
                time.sleep(0.2)
        import boto3

        s3 = boto3.client("s3", endpoint_url=self.moto_outside, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")  # fmt: skip
        s3.create_bucket(Bucket=BUCKET)
