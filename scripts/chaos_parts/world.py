"""The chaos run's world: a workspace of its own (its `$XDG_STATE_HOME`, its gateway port), three functions
deployed with the real `pkg`, a small tmpfs under the chat function's state (its process snapshot is written
there), and a queue on a moto server served by the real SQS worker.

- chat: the demo (`functions/smollm2-chat`, its bundle from `pkg build`), process snapshots on.
- embed: `functions/minilm-embed`, no snapshots (every wake is a fresh start).
- lora: the demo model built again with `[export] adapter_modules` (its graph takes LoRA adapters) and a
  random PEFT adapter added with `pkg adapter add`; requests name `smollm2-lora:rand`.

Every function idles after `IDLE_TIMEOUT` seconds, so the traffic's pauses make idle -> wake cycles.
Everything started here carries `ONNXFN_CHAOS_RUN=<workspace>` in its environment: what is left with it after
the teardown is an orphan.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
PKG = [sys.executable, "-m", "packager.cli"]
IDLE_TIMEOUT = 3
MARK = "ONNXFN_CHAOS_RUN"
SNAPSHOT_TMPFS = "256m"  # the chat function's state folder: its ~90 MB process snapshot and its logs
ADAPTER = "rand"


@dataclass
class Function:
    kind: str  # chat, embed, lora
    name: str
    folder: Path
    model: str  # what requests name
    key: str = ""


@dataclass
class Queue:
    endpoint: str
    url: str
    dlq_url: str
    bucket: str
    worker: subprocess.Popen[bytes] | None = None
    worker_log: Path | None = None

    def client(self, service: str) -> Any:
        import boto3

        return boto3.client(
            service, endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id="testing", aws_secret_access_key="testing",
        )  # fmt: skip


@dataclass
class World:
    root: Path
    env: dict[str, str]
    gateway_port: int
    functions: dict[str, Function] = field(default_factory=dict)
    mounts: list[Path] = field(default_factory=list)
    queue: Queue | None = None
    stack: ExitStack = field(default_factory=ExitStack)
    notes: list[str] = field(default_factory=list)

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def state_root(self) -> Path:
        return self.root / "state" / "onnxfn"

    def pkg(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*PKG, *args], cwd=self.root, env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def state_dir(self, function: Function) -> Path:
        from packager.paths import function_state_dir
        from packager.spec import load_spec

        return function_state_dir(load_spec(function.folder), root=self.state_root)

    def record(self, function: Function) -> dict[str, Any]:
        return dict(json.loads((self.state_dir(function) / "state.json").read_text()))

    def gateway_pid(self) -> int | None:
        try:
            return int(json.loads((self.state_root / "gateway" / "gateway.json").read_text())["pid"])
        except (OSError, ValueError, KeyError):
            return None


def create(root: Path, gateway_port: int) -> World:
    env = {k: v for k, v in os.environ.items() if k != "ONNXFN_API_KEY"}
    env.update({"XDG_STATE_HOME": str(root / "state"), "ONNXFN_GATEWAY_PORT": str(gateway_port)})
    env.update({MARK: str(root), "COLUMNS": "200", "PYTHONUNBUFFERED": "1"})
    world = World(root, env, gateway_port)
    settings = f"idle_timeout = {IDLE_TIMEOUT}\nmax_waking_requests = 64\n"
    demo = (REPO / "functions" / "smollm2-chat" / "function.toml").read_text()
    embed = (REPO / "functions" / "minilm-embed" / "function.toml").read_text()
    lora = demo.replace('name = "smollm2-chat"', 'name = "smollm2-lora"')
    lora = lora.replace("[export]\n", '[export]\nadapter_modules = ["q_proj", "v_proj"]\n', 1)
    for kind, name, toml, bundle in (
        ("chat", "smollm2-chat", _with_local(demo, settings + "memory_mb = 1024\n"), _repo_bundle("smollm2-chat")),
        ("embed", "minilm-embed", _with_local(embed, settings + "memory_mb = 1024\n"), _repo_bundle("minilm-embed")),
        ("lora", "smollm2-lora", _with_local(lora, settings), None),
    ):
        folder = root / "functions" / name
        folder.mkdir(parents=True)
        (folder / "function.toml").write_text(toml)
        if bundle is not None:
            (root / "build" / name).mkdir(parents=True)
            (root / "build" / name / "bundle").symlink_to(bundle)
        model = f"{name}:{ADAPTER}" if kind == "lora" else name
        world.functions[kind] = Function(kind, name, folder, model)
    return world


def _with_local(toml: str, settings: str) -> str:
    if "[targets.local]" not in toml:
        toml += "\n[targets.local]\n"
    return toml.replace("[targets.local]", f"[targets.local]\n{settings}", 1)


def _repo_bundle(name: str) -> Path:
    bundle = REPO / "build" / name / "bundle"
    if not (bundle / "manifest.json").is_file():
        built = subprocess.run([*PKG, "build", f"functions/{name}"], cwd=REPO, capture_output=True, text=True)
        if built.returncode != 0:
            raise SystemExit(f"pkg build functions/{name} failed:\n{built.stderr[-3000:]}")
    return bundle.resolve()


def deploy_all(world: World, say: Any) -> None:
    """Build the lora function, mount the chat function's small state folder, deploy all three, add the adapter."""
    lora = world.functions["lora"]
    started = time.monotonic()
    built = world.pkg("build", str(lora.folder))
    if built.returncode != 0:
        raise SystemExit(f"pkg build {lora.folder} failed:\n{built.stderr[-3000:]}")
    say(f"built {lora.name} in {time.monotonic() - started:.0f} s")
    chat_state = world.state_dir(world.functions["chat"])
    mount_tmpfs(world, chat_state, SNAPSHOT_TMPFS)
    for function in world.functions.values():
        deployed = world.pkg("deploy", str(function.folder))
        if deployed.returncode != 0:
            raise SystemExit(f"pkg deploy {function.folder} failed:\n{deployed.stderr[-3000:]}")
        function.key = (world.state_dir(function) / "api-key").read_text()
        say(f"deployed {function.name}")
    peft = make_peft(world.root / "peft-rand")
    added = world.pkg("adapter", "add", str(lora.folder), ADAPTER, str(peft))
    if added.returncode != 0:
        raise SystemExit(f"pkg adapter add failed:\n{added.stdout}{added.stderr[-3000:]}")


def make_peft(dest: Path) -> Path:
    """A random LoRA (PEFT, `init_lora_weights=False`) on q_proj and v_proj of the demo model, in a process of
    its own (torch stays out of the chaos driver)."""
    code = textwrap.dedent(f"""
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM
        from packager.progress import StepProgress
        from packager.sources import resolve_source
        from packager.sources.gguf import dequantized_folder
        from packager.spec import load_spec
        from runtime.bundle import file_digest
        demo = {str(REPO / "functions" / "smollm2-chat")!r}
        spec = load_spec(demo)
        gguf = resolve_source(spec.model.source, demo, StepProgress()).gguf_file
        hf_dir = dequantized_folder(
            gguf, file_digest(gguf).sha256, spec.model.source, StepProgress(), tokenizer_from=gguf.parent
        )[0]
        torch.manual_seed(7)
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        config = LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        get_peft_model(model, config).save_pretrained({str(dest)!r})
    """)
    made = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    if made.returncode != 0:
        raise SystemExit(f"could not write the PEFT adapter:\n{made.stderr[-3000:]}")
    return dest


def mount_tmpfs(world: World, where: Path, size: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)], check=True)
    world.mounts.append(where)


def unmount(where: Path) -> None:
    if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)  # still held: detached, freed when let go


def start_queue(world: World, say: Any) -> None:
    """moto (S3 and SQS), a request queue with a DLQ after 5 receives and a results bucket, and the worker."""
    from tests.fixtures.moto_server import running_moto_server

    logs = world.root / "logs"
    logs.mkdir(exist_ok=True)
    server = world.stack.enter_context(running_moto_server(logs))
    sqs = server.client("sqs")
    name = f"chaos{uuid.uuid4().hex[:8]}"
    dlq_url = sqs.create_queue(QueueName=f"{name}-dlq")["QueueUrl"]
    dlq_arn = sqs.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    redrive = json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": "5"})
    url = sqs.create_queue(QueueName=name, Attributes={"VisibilityTimeout": "10", "RedrivePolicy": redrive})
    server.client("s3").create_bucket(Bucket=name)
    world.queue = Queue(server.endpoint_url, url["QueueUrl"], dlq_url, name, worker_log=logs / "worker.log")
    world.env.update(server.env)
    start_worker(world)
    say(f"queue {name} on moto at {server.endpoint_url}, worker pid {world.queue.worker.pid}")  # type: ignore[union-attr]


def start_worker(world: World) -> None:
    queue = world.queue
    assert queue is not None and queue.worker_log is not None
    bundle = _repo_bundle("minilm-embed")
    command = [
        sys.executable, "-m", "runtime", "worker", str(bundle), "--queue-url", queue.url,
        "--endpoint-url", queue.endpoint, "--visibility-timeout", "10", "--wait-time", "2", "--threads", "1",
    ]  # fmt: skip
    with queue.worker_log.open("ab") as log:
        queue.worker = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=world.env, cwd=world.root)


def answers(url: str, headers: dict[str, str] | None = None) -> bool:
    try:
        return httpx.get(url, headers=headers or {}, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False
