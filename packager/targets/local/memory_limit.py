"""`[targets.local] memory_mb`: each server in a memory cgroup of its own, so one over its limit is killed alone.

Where: under the memory cgroup this process runs in (a program never escapes its own limits), a folder per
function (`onnxfn-STATE_FOLDER`) holding one cgroup per server start (`s` + a time stamp): during a rolling
redeploy the old and the new server run side by side, each within the limit. cgroup v2 (`memory.max`, the
parent's `cgroup.subtree_control` gets `+memory`) where the unified hierarchy has the memory controller,
else v1's memory controller (`memory.limit_in_bytes`; no swap here, and `memory.memsw.*` is capped too where
swap is accounted). Needs write access to that hierarchy (root, or a delegated subtree); where there is none,
`prepare` says why and the deploy reports the limit as not enforced.

A server joins its cgroup before it execs (`join_prefix`: a shell writes its own pid to `cgroup.procs`),
so nothing it allocates is charged elsewhere; a process snapshot is restored by a CRIU that joined it first.
The kernel's OOM killer then chooses within the cgroup, and `oom_kills` tells the supervisor why it ended.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
_JOIN = 'echo $$ > "$0" && exec "$@"'


@dataclass(frozen=True)
class Cgroup:
    path: Path
    version: int  # 1 or 2

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def describe(self) -> str:
        return f"cgroup v{self.version} memory controller, {self.path}"


def prepare(function_folder: str, memory_mb: int) -> tuple[Cgroup | None, str]:
    """A new cgroup limited to `memory_mb` for one server of the function whose state folder is named
    `function_folder`; (None, why not) when this machine cannot enforce it. Empty cgroups of the function's
    earlier servers are removed on the way."""
    hierarchy, why = _hierarchy()
    if hierarchy is None:
        return None, why
    parent = hierarchy.path / f"onnxfn-{function_folder}"
    try:
        parent.mkdir(exist_ok=True)
        prune(parent, keep=None)
        if hierarchy.version == 2:
            (parent / "cgroup.subtree_control").write_text("+memory")
        child = parent / f"s{time.time_ns()}"
        child.mkdir()
        _limit(Cgroup(child, hierarchy.version), memory_mb << 20)
    except OSError as exc:
        return None, f"cannot make a memory cgroup under {hierarchy.path} ({exc.strerror or exc})"
    return Cgroup(child, hierarchy.version), ""


def existing(path: str) -> Cgroup | None:
    """The cgroup a record names, if it is still there."""
    if not path or not (Path(path) / "cgroup.procs").is_file():
        return None
    return Cgroup(Path(path), 2 if (Path(path) / "memory.max").exists() else 1)


def join_prefix(cgroup: Cgroup | None) -> tuple[str, ...]:
    """A command prefix that puts the command (and all it starts) in `cgroup` before it runs."""
    return ("sh", "-c", _JOIN, str(cgroup.procs)) if cgroup is not None else ()


def move(pid: int, cgroup: Cgroup | None) -> None:
    """Put a running process (a restored snapshot's) in `cgroup`; v1 moves its memory along with it."""
    if cgroup is not None:
        cgroup.procs.write_text(str(pid))


def oom_kills(cgroup: Cgroup | None) -> int:
    """How many processes the kernel's OOM killer ended in `cgroup` (0 when unknown)."""
    if cgroup is None:
        return 0
    name = "memory.events" if cgroup.version == 2 else "memory.oom_control"
    try:
        for line in (cgroup.path / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        return 0
    return 0


def prune(parent: Path, keep: Path | None) -> None:
    """Remove the function's server cgroups that no process uses any more (all but `keep`)."""
    for child in parent.glob("s*"):
        if child != keep and child.is_dir():
            with contextlib.suppress(OSError):  # EBUSY: a server still runs in it
                child.rmdir()


def remove(path: str) -> None:
    """After `pkg destroy`: the function's cgroups, once its processes are gone (they may take a moment)."""
    if not path:
        return
    parent = Path(path).parent
    deadline = time.monotonic() + 5.0
    while parent.is_dir():
        prune(parent, keep=None)
        try:
            parent.rmdir()
            return
        except OSError as exc:
            if exc.errno not in (errno.EBUSY, errno.ENOTEMPTY) or time.monotonic() > deadline:
                return
        time.sleep(0.05)


def _limit(cgroup: Cgroup, limit: int) -> None:
    if cgroup.version == 2:
        (cgroup.path / "memory.max").write_text(str(limit))
        with contextlib.suppress(OSError):
            (cgroup.path / "memory.swap.max").write_text("0")
        return
    (cgroup.path / "memory.limit_in_bytes").write_text(str(limit))
    swap = cgroup.path / "memory.memsw.limit_in_bytes"
    with contextlib.suppress(OSError):  # absent, or refused where swap is not accounted
        swap.write_text(str(limit))
    # A restored snapshot's pages are charged where CRIU ran; moved along with the process (anon and file).
    with contextlib.suppress(OSError):
        (cgroup.path / "memory.move_charge_at_immigrate").write_text("3")


def _hierarchy() -> tuple[Cgroup | None, str]:
    """Where this process's memory cgroup is, v2 first; (None, why) when there is none to write to."""
    try:
        lines = Path(f"/proc/{os.getpid()}/cgroup").read_text().splitlines()
    except OSError:
        return None, "no /proc/self/cgroup: this system has no cgroups"
    own = {}
    for line in lines:
        _, controllers, path = line.split(":", 2)
        own[controllers] = path
    unified = _unified_root()
    if unified is not None and "" in own and "memory" in (unified / "cgroup.controllers").read_text().split():
        found = unified / own[""].lstrip("/")
        if os.access(found, os.W_OK):
            return Cgroup(found, 2), ""
    memory = next((path for controllers, path in own.items() if "memory" in controllers.split(",")), None)
    if memory is not None and (ROOT / "memory" / "memory.limit_in_bytes").is_file():
        found = ROOT / "memory" / memory.lstrip("/")
        if os.access(found, os.W_OK):
            return Cgroup(found, 1), ""
        return None, f"{found} is not writable by this user (the memory cgroup needs root or a delegated subtree)"
    return None, "no cgroup memory controller is mounted (neither cgroup v2 with memory nor v1's memory)"


def _unified_root() -> Path | None:
    for candidate in (ROOT, ROOT / "unified"):
        if (candidate / "cgroup.controllers").is_file():
            return candidate
    return None
