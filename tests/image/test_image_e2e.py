"""The issue's "done when": build the demo image, push it to a real registry, pull it back, run it with
podman and get replies; an unchanged re-push sends 0 bytes; a code-only change sends only the code layer.
"""

from __future__ import annotations

import json
import shutil
import tarfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests
from openai import OpenAI

from packager.bench.local_registry import LocalRegistry
from packager.image import ImageResult, RegistryTarget, app_layer, build_image, pull_image, push_layout
from packager.image.run import Podman, pull_registry
from packager.processes import stop_process
from packager.progress import StepProgress
from packager.spec import FunctionSpec
from packager.targets.local.server_process import free_port

API_KEY = "image-test-key"
TIMINGS: dict[str, float] = {}


def layer(result: ImageResult, name: str) -> dict[str, object]:
    report = next(r for r in result.layers if r.name == name)
    return {"digest": report.digest, "size": report.size}


def test_layers_are_split_as_promised(demo_image: ImageResult) -> None:
    names = [r.name for r in demo_image.layers]
    assert names == ["os", "python-deps", "bundle", "code"]
    sizes = {r.name: r for r in demo_image.layers}
    # The runtime base stays small: well under python:3.11-slim (~125 MB unpacked) + a pip install of the
    # runtime's declared dependencies (~330 MB with sympy, protobuf, huggingface_hub).
    assert sizes["os"].tar_size + sizes["python-deps"].tar_size < 300e6
    assert sizes["code"].size < 1e6
    deps = next(r for r in demo_image.layers if r.name == "python-deps")
    with tarfile.open(next(layer.path for layer in demo_image.images[0].layers if layer.name == "python-deps")) as tar:
        tops = {Path(name).parts[3] for name in tar.getnames() if len(Path(name).parts) > 3}
    assert "onnxruntime" in tops and "numpy" in tops and "awslambdaric" in tops
    assert not tops & {"torch", "transformers", "sympy", "huggingface_hub", "packager"}, tops
    assert deps.reused or deps.size > 0


def test_push_pull_rebuild_and_code_only_change(
    demo_image: ImageResult,
    demo_bundle: Path,
    demo_spec: FunctionSpec,
    registry: LocalRegistry,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    target = RegistryTarget.parse(f"{registry.address}/onnxfn/{demo_spec.name}:e2e")

    first = push_layout(demo_image.layout, target)
    TIMINGS["push"] = first.seconds
    total = sum(r.size for r in demo_image.layers)
    assert first.index_digest == demo_image.index_digest
    assert first.bytes_sent > total  # every layer, plus config, manifest and index
    assert first.blobs_skipped == []

    pulled = pull_image(target, tmp_path / "pulled")
    assert pulled.index_digest == demo_image.index_digest
    assert pulled.manifests == {"linux/amd64": demo_image.manifests["linux/amd64"]}
    assert set(pulled.blobs) == {r.digest for r in demo_image.layers} | {demo_image.images[0].config.digest}
    for digest in pulled.blobs:  # pulled bytes equal the built ones
        assert (tmp_path / "pulled" / "blobs" / "sha256" / digest[7:]).stat().st_size == pulled.blobs[digest]

    # A rebuild from unchanged inputs reproduces every digest, and pushes nothing.
    again = build_image(demo_bundle, demo_spec, progress=StepProgress(), out_dir=tmp_path / "again")
    assert again.index_digest == demo_image.index_digest
    assert all(r.reused for r in again.layers if r.name != "code")
    repeat = push_layout(again.layout, target)
    TIMINGS["re-push unchanged"] = repeat.seconds
    assert repeat.bytes_sent == 0 and repeat.blobs_sent == []

    # A code-only change: one more line in the runtime package.
    changed = tmp_path / "runtime-changed"
    shutil.copytree(app_layer.RUNTIME_SOURCE, changed, ignore=shutil.ignore_patterns("__pycache__"))
    with (changed / "__init__.py").open("a") as init:
        init.write("\n# a code change\n")
    monkeypatch.setattr(app_layer, "RUNTIME_SOURCE", changed)
    edited = build_image(demo_bundle, demo_spec, progress=StepProgress(), out_dir=tmp_path / "edited")
    code = layer(edited, "code")
    assert code["digest"] != layer(demo_image, "code")["digest"]
    assert [layer(edited, n) for n in ("os", "python-deps", "bundle")] == [
        layer(demo_image, n) for n in ("os", "python-deps", "bundle")
    ]
    code_push = push_layout(edited.layout, target)
    TIMINGS["re-push code change"] = code_push.seconds
    config = edited.images[0].config
    assert code_push.blobs_sent == [config.digest, code["digest"]]
    documents = len(edited.images[0].manifest.data) + len(
        (edited.layout / "blobs" / "sha256" / edited.index_digest[7:]).read_bytes()
    )
    assert code_push.bytes_sent == len(config.data) + code["size"] + documents
    print(f"\nimage timings: {json.dumps({k: round(v, 2) for k, v in TIMINGS.items()})}")


@contextmanager
def running(podman: Podman, image: str, log: Path, *args: str) -> Iterator[None]:
    process = podman.start(
        "run", "--rm", "--network", "host", "--env", f"ONNXFN_API_KEY={API_KEY}", image, *args, log=log
    )
    try:
        yield
    finally:
        stop_process(process, grace=20)


def wait_until(url: str, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        # The port is bound before anything loads (a taken port fails at once), so a probe sent before the
        # HTTP loop runs waits in the backlog: a timeout means "not yet", as it does to a load balancer.
        except (requests.ConnectionError, requests.Timeout):
            pass
        time.sleep(0.25)
    pytest.fail(f"{url} never answered 200; container log:\n{log.read_text()[-3000:]}")


def wait_for_prompt_graph(url: str, log: Path, timeout: float = 60) -> str:
    """What `/ready` (asked with the key) says prompts run through, once that is no longer `loading`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        graph = requests.get(url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=2).json()["prompt_graph"]
        if graph != "loading":
            return graph
        time.sleep(0.1)
    pytest.fail(f"the prefill graph was still loading after {timeout} s; container log:\n{log.read_text()[-3000:]}")


def test_pulled_image_serves_chat_sagemaker_and_lambda(
    demo_image: ImageResult, demo_spec: FunctionSpec, registry: LocalRegistry, podman: Podman, tmp_path: Path
) -> None:
    target = RegistryTarget.parse(f"{registry.address}/onnxfn/{demo_spec.name}:run")
    push_layout(demo_image.layout, target)
    start = time.perf_counter()
    pull_registry(podman, target.reference, insecure=True)
    TIMINGS["podman pull"] = time.perf_counter() - start
    image = target.reference

    # The image's own Python has the runtime and the Lambda client, and no torch.
    probe = podman.run(
        "run", "--rm", "--network", "none", image,
        "python3", "-c", "import importlib.util as u; print([bool(u.find_spec(m)) for m in "
        "('runtime', 'onnxruntime', 'awslambdaric', 'torch', 'transformers')])",
    )  # fmt: skip
    assert probe.stdout.strip() == "[True, True, True, False, False]"

    port = free_port("127.0.0.1")
    log = tmp_path / "http.log"
    with running(podman, image, log, "http", "--host", "127.0.0.1", "--port", str(port)):
        start = time.perf_counter()
        wait_until(f"http://127.0.0.1:{port}/ready", log)
        TIMINGS["container start to ready"] = time.perf_counter() - start
        # Greedy replies are equal only once prompts run through one graph: wait out the loading window.
        assert wait_for_prompt_graph(f"http://127.0.0.1:{port}/ready", log) == "prefill graph"
        TIMINGS["container start to prefill graph"] = time.perf_counter() - start
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        replies = [
            client.chat.completions.create(model=demo_spec.name, messages=messages, max_tokens=16)  # type: ignore[arg-type]
            for _ in range(2)
        ]
        text = replies[0].choices[0].message.content
        assert text and text == replies[1].choices[0].message.content  # temperature 0 in function.toml: greedy
        usage = replies[0].usage
        assert usage is not None and usage.prompt_tokens > 10 and 0 < usage.completion_tokens <= 16
        assert requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).status_code == 401  # the key is enforced

    port = free_port("127.0.0.1")
    log = tmp_path / "sagemaker.log"
    # SageMaker runs `IMAGE serve`; the extra flags only move it off 8080 for this shared host.
    with running(podman, image, log, "serve", "--host", "127.0.0.1", "--port", str(port)):
        wait_until(f"http://127.0.0.1:{port}/ping", log)
        body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
        answer = requests.post(f"http://127.0.0.1:{port}/invocations", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["object"] == "chat.completion"
        assert answer.json()["choices"][0]["message"]["content"]
        bad = requests.post(f"http://127.0.0.1:{port}/invocations", json={"input": "x"}, timeout=10)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_invocation"
    print(f"\nimage timings: {json.dumps({k: round(v, 2) for k, v in TIMINGS.items()})}")
