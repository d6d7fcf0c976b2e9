"""A system reached over HTTP: the worker starts the server, then acts as its streaming client."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from packager.bench.serving import ServerSpec, free_port, launch, run_streams, wait_ready
from packager.bench.systems.base import PromptSpec, StreamTiming, SystemConfig, process_memory
from packager.decoder_facts import decoder_facts
from packager.processes import stop_process
from runtime.bundle import read_manifest


def kv_budget_mib(config: SystemConfig) -> int:
    """The in-process engine's KV budget: every slot can hold `max_context` tokens."""
    facts = decoder_facts(read_manifest(Path(config.bundle)))
    return -(-config.max_batch * config.max_context * facts.kv_bytes_per_token() // (1 << 20))


def onnxfn_server(config: SystemConfig, decode: str = "latency") -> ServerSpec:
    engine_flags = {
        "--decode": decode,
        "--threads": config.threads,
        "--max-batch": config.max_batch,
        "--max-context": config.max_context,
        "--kv-memory-mb": kv_budget_mib(config),
    }
    return ServerSpec(
        command=[
            *(config.python, "-m", "runtime", "serve", config.bundle, "--host", "127.0.0.1", "--port", "{port}"),
            *("--model-name", "bench", "--log-level", "info"),
            *(str(part) for flag, value in engine_flags.items() for part in (flag, value)),
        ],
        ready_path="/ready",
        extra_body={"ignore_eos": True, "stream_options": {"include_usage": True}},
        env={"OMP_NUM_THREADS": str(config.threads)},
    )


def llamacpp_server(config: SystemConfig) -> ServerSpec:
    from packager.bench.systems.llamacpp import end_tokens  # here: onnxfn's server specs never load llama.cpp

    # The server has no ignore_eos: ban every token it would stop at instead.
    banned = end_tokens(config.gguf)
    settings = {
        "--model": config.gguf,
        "--model_alias": "bench",
        "--host": "127.0.0.1",
        "--port": "{port}",
        "--n_threads": config.threads,
        "--n_threads_batch": config.threads,
        "--n_ctx": config.max_context,
        # Without this a new request aborts the one running (FIELD-NOTES); with it requests queue.
        "--interrupt_requests": False,
    }
    return ServerSpec(
        command=[config.python, "-m", "llama_cpp.server", *(str(p) for kv in settings.items() for p in kv)],
        ready_path="/v1/models",
        extra_body={"logit_bias": {str(token): -100 for token in banned}},
        env={"OMP_NUM_THREADS": str(config.threads)},
    )


SPECS = {
    "onnxfn-http": onnxfn_server,
    "onnxfn-http-throughput": lambda config: onnxfn_server(config, decode="throughput"),
    "llamacpp-server": llamacpp_server,
}


class ServerSystem:
    def __init__(self, config: SystemConfig) -> None:
        self.max_streams = 64
        self._spec = SPECS[config.system](config)
        port = free_port()
        self._base_url = f"http://127.0.0.1:{port}"
        self._log_dir = tempfile.TemporaryDirectory(prefix="bench-server-")
        log_path = Path(self._log_dir.name) / "server.log"
        self._process = launch(self._spec, port, log_path)
        wait_ready(self._process, self._base_url, self._spec.ready_path, log_path)

    def run(self, prompts: list[PromptSpec], max_tokens: int) -> list[StreamTiming]:
        return asyncio.run(run_streams(self._base_url, [p.text for p in prompts], max_tokens, self._spec.extra_body))

    def memory(self) -> dict[str, float]:
        return process_memory(self._process.pid)

    def close(self) -> None:
        stop_process(self._process)
        self._log_dir.cleanup()
