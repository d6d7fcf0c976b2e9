"""`pkg deploy --target jetson`: refused here with the reasons, and its configuration as a Jetson would get it."""

from __future__ import annotations

import platform
import shutil
import socket
import zipfile
from pathlib import Path

import onnxruntime
import pytest

from packager.cli import main
from packager.errors import UserError
from packager.spec import load_spec
from packager.targets import jetson
from packager.targets.jetson import HostFacts
from runtime.engine.providers import TensorRTCache
from tests.conftest import DEMO_FUNCTION

ORIN = HostFacts(
    machine="aarch64",
    l4t_release="# R36 (release), REVISION: 4.0, GCID: 37537400, BOARD: generic, EABI: aarch64",
    providers=("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"),
    onnxruntime="1.20.0",
    hostname="orin-01",
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def function_dir(tmp_path: Path, demo_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "functions" / "edge-chat"
    folder.mkdir(parents=True)
    bundle = tmp_path / "build" / "edge-chat" / "bundle"
    bundle.mkdir(parents=True)
    shutil.copyfile(demo_bundle / "manifest.json", bundle / "manifest.json")  # planning reads only the manifest
    token = tmp_path / "agent-token"
    token.write_text("jetson-token\n")
    text = (DEMO_FUNCTION / "function.toml").read_text().replace('name = "smollm2-chat"', 'name = "edge-chat"')
    table = (
        f'\n[targets.jetson]\njetpack = "6.0"\nbundle_root = "{tmp_path / "onnxfn"}"\nport = {_free_port()}\n'
        f'token_file = "{token}"\n'
    )
    (folder / "function.toml").write_text(text + table)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "1000")  # rich wraps error lines at the terminal width
    return folder


def test_off_hardware_deploy_fails_naming_what_is_missing_and_where_it_works(
    function_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    here = HostFacts.here()
    assert here.missing(), "this test expects a machine that is not a Jetson"
    code = main(["deploy", str(function_dir), "--target", "jetson"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "--target jetson runs on an NVIDIA Jetson" in err
    if platform.machine() != "aarch64":
        assert f"this machine is {platform.machine()}, not aarch64" in err
    assert "/etc/nv_tegra_release" in err
    offered = ", ".join(onnxruntime.get_available_providers())
    assert f"onnxruntime {onnxruntime.__version__} here offers {offered}, without" in err
    assert "TensorrtExecutionProvider and CUDAExecutionProvider" in err
    assert f"run `pkg deploy {function_dir} --target jetson` on the device" in err
    assert f"pkg image jetson {function_dir} --wheel" in err
    assert not (function_dir.parent.parent / "onnxfn").exists()  # nothing was started or created


def test_a_jetson_gets_the_gpu_providers_and_a_persistent_tensorrt_cache(function_dir: Path) -> None:
    spec = load_spec(function_dir)
    plan = jetson.plan(spec, host=ORIN)
    command = list(plan.agent_command)
    assert command[1:4] == ["-m", "runtime", "agent"]
    assert command[command.index("--providers") + 1] == "tensorrt,cuda,cpu"  # the spec itself says ["cpu"]
    root = Path(spec.targets.jetson.bundle_root)
    assert command[command.index("--bundle-root") + 1] == str(root)
    assert command[command.index("--port") + 1] == str(spec.targets.jetson.port)
    # The agent keeps bundles in ROOT/bundles/NAME; the runtime puts TensorRT's caches beside each bundle.
    name = plan.bundle_digest.removeprefix("sha256:")[:16]
    assert plan.tensorrt_cache == TensorRTCache.beside(root / "bundles" / name).directory
    assert plan.serving is None and not plan.no_changes  # no agent answers on that port yet
    assert [(action, kind) for action, kind, _, _ in plan.rows()] == [("create", "edge agent"), ("create", "bundle")]
    assert plan.where.startswith("aarch64, # R36 (release), REVISION: 4.0")
    assert jetson.status(spec) is None


def test_the_docker_context_follows_the_jetpack_and_refuses_a_wrong_wheel(function_dir: Path, tmp_path: Path) -> None:
    toml = function_dir / "function.toml"
    good = tmp_path / "onnxruntime_gpu-1.20.0-cp310-cp310-linux_aarch64.whl"
    with zipfile.ZipFile(good, "w") as archive:
        archive.writestr("onnxruntime/__init__.py", "")
    toml.write_text(toml.read_text() + f'wheel = "{good}"\n')
    plan = jetson.plan(load_spec(function_dir), host=ORIN)
    assert ("create", "docker context", str(plan.state_dir / "image"),
            "FROM nvcr.io/nvidia/l4t-jetpack:r36.3.0") in plan.rows()  # fmt: skip

    wrong = tmp_path / "onnxruntime_gpu-1.20.0-cp310-cp310-linux_x86_64.whl"
    good.rename(wrong)
    toml.write_text(toml.read_text().replace(good.name, wrong.name))
    with pytest.raises(UserError, match="platform 'linux_x86_64' is not aarch64"):
        jetson.plan(load_spec(function_dir), host=ORIN)


def test_half_a_jetson_is_refused_with_only_what_it_lacks(function_dir: Path) -> None:
    cpu_only = HostFacts(ORIN.machine, ORIN.l4t_release, ("CPUExecutionProvider",), "1.31.1", "orin-02")
    assert cpu_only.missing() == [
        "onnxruntime 1.31.1 here offers CPUExecutionProvider, without TensorrtExecutionProvider and "
        "CUDAExecutionProvider (NVIDIA's onnxruntime-gpu wheel for the JetPack provides them)"
    ]
    with pytest.raises(UserError, match="JetPack 6.0") as raised:
        jetson.plan(load_spec(function_dir), host=cpu_only)
    assert "aarch64, not" not in str(raised.value) and "nv_tegra_release" not in str(raised.value)


def test_a_missing_token_is_named(function_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toml = function_dir / "function.toml"
    toml.write_text("\n".join(line for line in toml.read_text().splitlines() if not line.startswith("token_file")))
    monkeypatch.delenv("ONNXFN_EDGE_TOKEN", raising=False)
    with pytest.raises(UserError, match=r"no agent token: set targets.jetson.token_file or \$ONNXFN_EDGE_TOKEN"):
        jetson.plan(load_spec(function_dir), host=ORIN)
