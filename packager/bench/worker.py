"""One system under test in its own process, so threads, memory and start-up never mix between systems.

    python -m packager.bench.worker CONFIG_JSON            serve: one JSON command per stdin line, one reply per line
    python -m packager.bench.worker CONFIG_JSON --cold T0  exec -> first token once, with phases
                                                           (T0 = the parent's monotonic at exec)

Libraries print to fd 1 (llama.cpp, transformers), so the protocol gets a private copy of stdout and
fd 1 is pointed at stderr.
"""

from __future__ import annotations

import time

MAIN_STARTED = time.monotonic()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from typing import TextIO  # noqa: E402

from packager.bench.systems import import_system  # noqa: E402
from packager.bench.systems.base import InProcessSystem, PromptSpec, System, SystemConfig  # noqa: E402


def cold_start(config: SystemConfig, exec_time: float, text: str) -> dict[str, float | dict[str, float]]:
    system_class = import_system(config.system)
    imported = time.monotonic()
    system: InProcessSystem = system_class(config)
    loaded = time.monotonic()
    marks = system.first_token(text)
    # A system may split its load into finer phases (onnxfn: bundle verification, then the engine).
    load = getattr(system, "load_phases", None) or {"session": loaded - imported}
    phases = {
        "interpreter": MAIN_STARTED - exec_time,
        "imports": imported - MAIN_STARTED,
        **load,
        "tokenizer": marks["tokenizer"] - loaded,
        "first_token": marks["first_token"] - marks["tokenizer"],
    }
    return {"total": marks["first_token"] - exec_time, "phases": phases, **system.memory()}


def serve(config: SystemConfig, protocol: TextIO) -> None:
    def reply(message: dict[str, object]) -> None:
        protocol.write(json.dumps(message) + "\n")
        protocol.flush()

    started = time.monotonic()
    system: System = import_system(config.system)(config)
    reply({"ok": True, "load_s": time.monotonic() - started, "max_streams": system.max_streams})
    for line in sys.stdin:
        command = json.loads(line)
        try:
            if command["op"] == "run":
                prompts = [PromptSpec(**p) for p in command["prompts"]]
                streams = system.run(prompts, command["max_tokens"])
                reply({"ok": True, "streams": [s.to_json() for s in streams]})
            elif command["op"] == "memory":
                reply({"ok": True, **system.memory()})
            elif command["op"] == "quit":
                break
        except Exception as exc:  # reported to the parent, which records the failure in the results
            reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    system.close()
    reply({"ok": True, "closed": True})


def main() -> None:
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    config = SystemConfig(**json.loads(sys.argv[1]))
    if "--cold" in sys.argv:
        exec_time = float(sys.argv[sys.argv.index("--cold") + 1])
        text = sys.stdin.read()
        protocol.write(json.dumps(cold_start(config, exec_time, text)) + "\n")
        protocol.flush()
        return
    serve(config, protocol)


if __name__ == "__main__":
    main()
