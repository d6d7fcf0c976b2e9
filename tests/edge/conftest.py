"""Edge devices as network namespaces: each has its own address on a veth pair and runs the real agent.

Needs root and iproute2 (`ip netns`); without them the tests skip and say which is missing. Every
namespace and agent a test creates is removed in teardown, whatever the test did.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from packager.edge.archive import BundleArchive, archive_bundle
from tests.edge.bundles import derive_bundle

TOKEN = "edge-test-token"
MODEL = "edge-demo"  # both bundles of the pair are served under this id; their fingerprints differ
AGENT_PORT = 8470
READY_TIMEOUT = 90.0
# One /16 per test process, so parallel runs of the suite never share addresses.
SUBNET = f"10.{200 + os.getpid() % 50}"
_counter = itertools.count(1)


def _netns_problem() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"onnxfn-probe-{os.getpid()}"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if result.returncode != 0:
        return f"`ip netns add` fails here: {result.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass
class Device:
    """One simulated device: a namespace, its address, and the agent process inside it."""

    namespace: str
    address: str
    root: Path
    token_file: Path
    log_file: Path
    extra_args: list[str] = field(default_factory=list)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.address}:{AGENT_PORT}"

    def start(self, enter: list[str] | None = None) -> None:
        """Start the agent in the namespace: `ip netns exec` (its own /sys), or `enter`'s command in its place."""
        command = [
            *(enter or ["ip", "netns", "exec", self.namespace]), sys.executable, "-m", "runtime", "agent",
            "--bundle-root", str(self.root), "--token-file", str(self.token_file),
            "--host", self.address, "--port", str(AGENT_PORT),
            "--model-name", MODEL, "--max-batch", "2", "--kv-memory-mb", "64", "--threads", "1",
            "--log-level", "warning",
            *self.extra_args,
        ]  # fmt: skip
        with self.log_file.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        self.wait_listening()

    def wait_listening(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            assert self.process is not None and self.process.poll() is None, self.log_file.read_text()[-3000:]
            try:
                httpx.get(f"{self.url}/health", timeout=1.0)
                return
            except httpx.TransportError:
                time.sleep(0.05)
        raise AssertionError(f"the agent in {self.namespace} did not listen within {READY_TIMEOUT} s")

    def wait_settled(self) -> dict:
        """Wait until the agent is done loading (serving, empty or failed); returns its status."""
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            status = self.status()
            if status["health"] != "starting" and not status["install"]["running"]:
                return status
            time.sleep(0.05)
        raise AssertionError(f"the agent in {self.namespace} is still starting: {self.status()}")

    def status(self) -> dict:
        response = httpx.get(f"{self.url}/agent/status", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        response.raise_for_status()
        return response.json()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)
        self.process = None


@pytest.fixture(scope="session")
def netns_available() -> None:
    problem = _netns_problem()
    if problem is not None:
        pytest.skip(f"edge device tests skipped: {problem}")


@pytest.fixture
def devices(tmp_path: Path, netns_available: None) -> Iterator[Callable[..., list[Device]]]:
    """`make(n)` starts n devices (namespaces with agents); all are killed and removed afterwards."""
    created: list[Device] = []

    def make(count: int = 1, extra_args: list[str] | None = None) -> list[Device]:
        batch = []
        for _ in range(count):
            index = next(_counter)
            namespace = f"onnxfn-{os.getpid()}-{index}"
            host_if = f"oe{os.getpid() % 100000}h{index}"[:15]
            octet = index % 250
            device = Device(
                namespace,
                f"{SUBNET}.{octet}.2",
                tmp_path / f"device{index}",
                tmp_path / "token",
                tmp_path / f"device{index}.log",
                extra_args or [],
            )
            created.append(device)
            _create_namespace(namespace, host_if, f"{SUBNET}.{octet}.1/30", f"{device.address}/30")
            device.root.mkdir()
            device.token_file.write_text(TOKEN + "\n")
            batch.append(device)
        for device in batch:
            device.start()
        return batch

    try:
        yield make
    finally:
        for device in created:
            device.kill()
            subprocess.run(["ip", "netns", "del", device.namespace], capture_output=True)


def _create_namespace(namespace: str, host_if: str, host_address: str, device_address: str) -> None:
    for command in (
        ["ip", "netns", "add", namespace],
        ["ip", "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", namespace],
        ["ip", "addr", "add", host_address, "dev", host_if],
        ["ip", "link", "set", host_if, "up"],
        ["ip", "-n", namespace, "addr", "add", device_address, "dev", "eth0"],
        ["ip", "-n", namespace, "link", "set", "eth0", "up"],
        ["ip", "-n", namespace, "link", "set", "lo", "up"],
    ):
        subprocess.run(command, check=True, capture_output=True)


@pytest.fixture(scope="session")
def bundle_pair(demo_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The demo bundle (A) and a valid variant of it (B) whose manifest names another function."""
    root = tmp_path_factory.mktemp("bundles")
    a = derive_bundle(demo_bundle, root / "a")
    b = derive_bundle(demo_bundle, root / "b", function="smollm2-chat-v2")
    return a, b


@pytest.fixture(scope="session")
def tiny_bundle_pair(tmp_path_factory: pytest.TempPathFactory, tiny_hf_dir: Path) -> tuple[Path, Path]:
    """Two valid bundles of a tiny random-weight Llama, built by the real `pkg build` pipeline.

    Its engine loads in milliseconds instead of seconds, so the SIGKILL test can afford all 20 rounds.
    """
    from tests.conftest import tiny_model_cache
    from tests.packager.conftest import build_in, write_function
    from tests.packager.test_build_tiny import INT8_SPEC

    root = tmp_path_factory.mktemp("tiny-edge")
    # The packager tests' spec and cache: when both suites run, the exports are built once.
    function = write_function(root, "tiny-edge", f"hf:{tiny_hf_dir}", INT8_SPEC)
    built = build_in(root, function, tiny_model_cache(tmp_path_factory))
    return derive_bundle(built, root / "a"), derive_bundle(built, root / "b", function="tiny-edge-v2")


@dataclass
class Workspace:
    """A project folder with one function whose built bundle can be switched between A and B."""

    root: Path
    name: str = "edge-demo"

    @property
    def function(self) -> str:
        return f"functions/{self.name}"

    def select(self, bundle: Path) -> None:
        target = self.root / "build" / self.name / "bundle"
        shutil.rmtree(target, ignore_errors=True)
        derive_bundle(bundle, target)

    def archive(self, bundle: Path) -> BundleArchive:
        return archive_bundle(bundle, self.root / "archives")


@pytest.fixture(scope="session")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    root = tmp_path_factory.mktemp("project")
    function = root / "functions" / "edge-demo"
    function.mkdir(parents=True)
    (function / "function.toml").write_text('name = "edge-demo"\n\n[model]\nsource = "hf:unused"\n')
    return Workspace(root)
