"""Where the local target keeps each deployment's record, and how it finds them again.

A function's state lives in its per-user folder (`paths.function_state_dir`: `$XDG_STATE_HOME/onnxfn/
functions/FOLDER-HASH/`), keyed by the function folder's absolute path, so `pkg status` and `pkg destroy`
find it from any current folder and `pkg ps` finds every deployment on the machine. Earlier versions kept it
in `build/NAME/local/` under the current folder: a record found there is still honoured (status, destroy,
and the next deploy, which stops its server first), and its files stay where its record says they are, so
a server that is running is never moved under its feet. Once destroyed or replaced, nothing is written there.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from packager.errors import UserError
from packager.paths import build_dir, function_state_dir, state_root
from packager.spec import FunctionSpec
from packager.targets.local.records import LocalDeployment

TARGET = "local"
STATE_FILE = "state.json"
PID_FILE = "server.pid"
# The environment a server needs beyond the gateway's own (its API key, when it comes from a variable), so the
# gateway can start it again after it was stopped as idle, and check requests' keys. Mode 0600, like `api-key`.
SERVER_ENV_FILE = "server-env.json"


def state_dir(spec: FunctionSpec) -> Path:
    return function_state_dir(spec)


def legacy_dirs(spec: FunctionSpec) -> list[Path]:
    """Where an earlier version kept the state: `build/NAME/local` under the current folder (as it did), or
    under the project that holds `functions/NAME` (where it was when deployed from the project's root)."""
    candidates = [build_dir(spec) / TARGET]
    parents = spec.directory.resolve().parents
    if len(parents) > 1:
        candidates.append(parents[1] / "build" / spec.name / TARGET)
    unique: list[Path] = []
    for candidate in candidates:
        resolved = candidate.resolve()
        if resolved not in unique and resolved != state_dir(spec).resolve():
            unique.append(resolved)
    return unique


def found(spec: FunctionSpec) -> list[tuple[Path, LocalDeployment]]:
    """Every record of this function's deployment: its state folder's first, then any an earlier version left."""
    records = []
    for directory in (state_dir(spec), *legacy_dirs(spec)):
        deployment = load(directory)
        if deployment is not None and deployment.function == spec.name:
            records.append((directory, deployment))
    return records


def current(spec: FunctionSpec) -> LocalDeployment | None:
    records = found(spec)
    return records[0][1] if records else None


def everything() -> tuple[list[tuple[Path, LocalDeployment]], list[str]]:
    """Every deployment recorded for this user (`pkg ps`), plus earlier versions' under the current folder;
    and what is wrong with the records that cannot be read (one corrupt record does not hide the others)."""
    folders = sorted((state_root() / "functions").glob(f"*/{STATE_FILE}"))
    folders += sorted(Path("build").glob(f"*/{TARGET}/{STATE_FILE}"))
    records, problems = [], []
    for state_file in folders:
        try:
            deployment = load(state_file.parent)
        except UserError as exc:
            problems.append(str(exc))
            continue
        if deployment is not None:
            records.append((state_file.parent.resolve(), deployment))
    return records, problems


def load(directory: Path) -> LocalDeployment | None:
    try:
        data = json.loads((directory / STATE_FILE).read_text())
        data["command"] = tuple(data["command"])
        data["crashes"] = tuple(data.get("crashes", ()))
        return LocalDeployment(**data)
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, KeyError) as exc:
        raise UserError(f"{directory / STATE_FILE} is corrupt ({exc}); delete {directory} and redeploy") from exc


def save(directory: Path, deployment: LocalDeployment) -> None:
    """Write the record; a `UserError` when it cannot be (a full disk), and then the previous one is intact."""
    temporary = directory / f"{STATE_FILE}.tmp"
    try:
        temporary.write_text(json.dumps(asdict(deployment), indent=2) + "\n")
        temporary.replace(directory / STATE_FILE)  # readers see the old record or the new one, never half of one
        (directory / PID_FILE).write_text(f"{deployment.pid}\n")
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise UserError(
            f"cannot write {directory / STATE_FILE} ({exc.strerror or exc}); free space there and try again"
        ) from exc


def forget(directory: Path) -> None:
    for name in (STATE_FILE, PID_FILE, SERVER_ENV_FILE):
        (directory / name).unlink(missing_ok=True)


def save_server_env(directory: Path, env: dict[str, str]) -> None:
    path = directory / SERVER_ENV_FILE
    path.unlink(missing_ok=True)
    if env:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            json.dump(env, handle)


def server_env(directory: Path) -> dict[str, str]:
    """What `save_server_env` wrote; empty when nothing was (no key from a variable, or an earlier version)."""
    try:
        data = json.loads((directory / SERVER_ENV_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return {str(name): str(value) for name, value in data.items()} if isinstance(data, dict) else {}
