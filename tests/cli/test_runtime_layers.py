"""The runtime's rooms keep to their layers (issue 38): the OpenAI layer knows no transport, no frontend imports
another, and the engine knows none of them. Every import counts, lazy ones included (see test_import_graph).

- `runtime.api`: the OpenAI layer; no transport library, no frontend.
- `runtime.http` (HTTP) and `runtime.events` (queue): the frontends; neither imports the other.
- `runtime.aws_lambda` and `runtime.agent`: hosts. Lambda runs the queue frontend and the HTTP app in one
  execution environment; the agent mounts the HTTP app of each bundle it is pushed. Nothing imports them.
- `runtime.startup`: how every frontend starts a model; it imports no frontend or host.
- `runtime.engine`, `runtime.encoder`: below all of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.cli.test_import_graph import module_files

FRONTENDS_AND_HOSTS = ("runtime.http", "runtime.events", "runtime.aws_lambda", "runtime.agent")
TRANSPORTS = ("starlette", "uvicorn", "mangum", "boto3", "botocore", "awslambdaric", "anyio")
RULES: dict[str, tuple[str, ...]] = {
    "runtime.api": (*FRONTENDS_AND_HOSTS, *TRANSPORTS, "runtime.startup"),
    "runtime.http": ("runtime.events", "runtime.aws_lambda", "runtime.agent"),
    "runtime.events": ("runtime.http", "runtime.aws_lambda", "runtime.agent", "starlette", "uvicorn"),
    "runtime.startup": (*FRONTENDS_AND_HOSTS, *TRANSPORTS),
    "runtime.engine": (*FRONTENDS_AND_HOSTS, "runtime.api", "runtime.startup", *TRANSPORTS),
    "runtime.encoder": (*FRONTENDS_AND_HOSTS, "runtime.api", "runtime.startup", *TRANSPORTS),
    "runtime": ("torch",),
}


def imported_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def breaches(modules: dict[str, Path], rules: dict[str, tuple[str, ...]]) -> list[str]:
    found = []
    for module, path in sorted(modules.items()):
        imports = imported_names(path)
        for room, forbidden in rules.items():
            if not within(module, room):
                continue
            hits = {name for name in imports if any(within(name, f) for f in forbidden)}
            # `from runtime.http.app import create_app` is one breach, not two: keep the outermost name.
            found += [f"{module} imports {name}" for name in sorted(hits) if name.rpartition(".")[0] not in hits]
    return found


def test_each_runtime_room_imports_only_what_its_layer_may() -> None:
    modules = {name: path for name, path in module_files().items() if within(name, "runtime")}
    for room in RULES:
        assert any(within(name, room) for name in modules), f"{room} is gone: update the rules"
    assert breaches(modules, RULES) == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from runtime.http.app import create_app\n", ["runtime.events.handler imports runtime.http.app"]),
        ("from runtime import http\n", ["runtime.events.handler imports runtime.http"]),
        ("def f():\n    import starlette.responses\n", ["runtime.events.handler imports starlette.responses"]),
        ("from runtime.api.chat import submit_chat\n", []),
    ],
)
def test_the_rules_catch_a_frontend_importing_another(tmp_path: Path, source: str, expected: list[str]) -> None:
    path = tmp_path / "handler.py"
    path.write_text(source)
    assert breaches({"runtime.events.handler": path}, RULES) == expected
