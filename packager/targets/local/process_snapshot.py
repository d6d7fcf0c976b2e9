"""Process snapshots for the `local` target: the warmed server frozen by CRIU, resumed by the next deploy.

A fresh server spends about a second before its first token: the interpreter, `import onnxruntime`, the
session build, the tokenizer, the HTTP stack. All of that is the same every time, so after a deploy is
ready and warm, `criu dump --leave-running` writes the process (its memory, threads, listening socket)
to `process-snapshot/` in the function's state folder; the next deploy restores that instead of starting
Python. This is Lambda SnapStart's idea on one machine, and the server runs SnapStart's after-restore hook
(reseed the random generators) when the launcher sends it SIGUSR1.

The restore reads the whole image back before the process runs again, so the image is kept small: the
server maps its weights from the prepacked graphs (runtime/engine/prepacked.py), file-backed pages CRIU does
not dump, and the demo's image holds ~120 MB (heap, tokenizer, KV) instead of ~720 MB with the packed weights
on the heap; the restore fell from ~0.4 s to ~0.1 s. CRIU's lazy restore (`criu lazy-pages`, pages served
over userfaultfd on first touch) returned in 60-90 ms but made the first token slower and less steady
(0.5-0.75 s against 0.54-0.56 s, measured with the 720 MB image), since the first forward pass faults in
every page one by one.

A snapshot is used only where it is exactly valid (`SnapshotKey`): the same bundle, server command,
runtime source, interpreter, CRIU build and boot (CRIU needs the same pids free and continuous
monotonic clocks). Anything else, or a restore that fails (its pid taken, its port in use), is reported
and the deploy starts the server normally, then captures a new snapshot.

Needs CRIU >= 4.1 (`scripts/setup_criu.sh` builds it for Debian 12) and root.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

import runtime
from packager.private_state import PRIVATE_UMASK, make_private

# A restored process gets its pid back, so the server runs as the first process of a pid namespace of its own,
# where that pid is always free; `setsid` makes it lead its session there, as CRIU requires.
ISOLATION = ("unshare", "--pid", "--fork", "setsid")
# The same for a launcher that forks the server itself (server_process.launch): without `--fork`, unshare
# execs the launcher in this pid namespace, and the launcher's first child starts the new one. (With `--fork`,
# unshare would report a server killed by SIGKILL as "exit 1": util-linux 2.38 cannot re-raise SIGKILL.)
PID_NAMESPACE = ("unshare", "--pid")
NAMESPACE_START_TIMEOUT = 5.0
SNAPSHOT_DIR = "process-snapshot"
META_FILE = "snapshot.json"
MIN_CRIU = (4, 1)
RESTORE_TIMEOUT = 30.0
CRIU_ENV = "ONNXFN_CRIU"  # path to the criu binary, when not the one on PATH


class SnapshotUnavailable(Exception):
    """Why no process snapshot was taken or used; the deploy goes on without one."""


@dataclass(frozen=True)
class SnapshotKey:
    """Everything a restored process silently depends on; any difference makes the snapshot unusable."""

    bundle_digest: str
    command: tuple[str, ...]
    runtime_digest: str  # the restored process runs the runtime code it was captured with
    interpreter: str
    criu: str
    boot_id: str
    # A key from the environment lives in the snapshot's memory; a key file is re-read after a restore.
    api_key_env_digest: str
    # The prepacked graphs' record (runtime/engine/prepacked.py): the process maps their files.
    prepacked_digest: str = ""
    # The adapters added to the server (its `--adapter-dir`): the catalog it read at start lives in its memory,
    # so a snapshot taken before `pkg adapter add`/`remove` would not know of the change.
    adapters_digest: str = ""

    @classmethod
    def current(
        cls,
        bundle_digest: str,
        command: tuple[str, ...],
        criu_version: str,
        api_key_env: str | None,
        prepacked_digest: str = "",
        environ: Mapping[str, str] | None = None,
    ) -> SnapshotKey:
        """The key now; `environ` holds the server's environment (default: this process's)."""
        env_key = (os.environ if environ is None else environ).get(api_key_env, "") if api_key_env else ""
        return cls(
            bundle_digest=bundle_digest,
            command=command,
            api_key_env_digest=hashlib.sha256(env_key.encode()).hexdigest() if env_key else "",
            runtime_digest=_runtime_digest(),
            interpreter=f"{sys.executable} {sys.version.split()[0]}",
            criu=criu_version,
            boot_id=Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
            prepacked_digest=prepacked_digest,
        )

    def mismatch(self, other: SnapshotKey) -> str | None:
        """The first field where `other` (what the snapshot was taken with) differs, as a reason."""
        for name, ours in asdict(self).items():
            theirs = getattr(other, name)
            if theirs != ours:
                if name == "command":
                    shown = f" ({_arguments_changed(tuple(theirs), ours)})"
                else:
                    shown = "" if name.endswith("digest") else f" (snapshot: {theirs!r}, now: {ours!r})"
                return f"its {name.replace('_', ' ')} differs{shown}"
        return None


@dataclass(frozen=True)
class Criu:
    binary: str
    version: str

    @classmethod
    def find(cls) -> Criu:
        binary = os.environ.get(CRIU_ENV) or shutil.which("criu")
        if binary is None:
            raise SnapshotUnavailable("CRIU is not installed: run scripts/setup_criu.sh")
        if not os.access(binary, os.X_OK):
            raise SnapshotUnavailable(f"{binary} is not executable: run scripts/setup_criu.sh")
        if os.geteuid() != 0:
            raise SnapshotUnavailable("CRIU needs root to dump and restore a process")
        output = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False).stdout
        found = re.search(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", output)
        if found is None or (int(found[1]), int(found[2])) < MIN_CRIU:
            raise SnapshotUnavailable(
                f"{binary} is not CRIU >= {'.'.join(map(str, MIN_CRIU))} ({output.strip() or 'no version'}): "
                "run scripts/setup_criu.sh"
            )
        return cls(binary, found[0].split()[-1])


@dataclass(frozen=True)
class Captured:
    directory: Path
    size_bytes: int
    seconds: float


def launch_isolated(command: Sequence[str], log: IO[bytes], env: dict[str, str]) -> tuple[subprocess.Popen[bytes], int]:
    """Start `command` as a detached server in a pid namespace of its own: the launcher and the server's pid."""
    launcher = subprocess.Popen(
        (*ISOLATION, *command), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True, env=env,
    )  # fmt: skip
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children")
    deadline = time.monotonic() + NAMESPACE_START_TIMEOUT
    while time.monotonic() < deadline and launcher.poll() is None:
        found = children.read_text().split()
        if found:
            return launcher, int(found[0])
        time.sleep(0.01)
    return launcher, launcher.pid  # it exited (its exit code tells why) or never forked


def wait_until_warm(url: str, headers: dict[str, str], timeout: float) -> None:
    """Until `/ready` reports the start-up work done in the background (prompt graph, huge pages) as over.

    A snapshot taken earlier would resume that work half done (the detailed answer needs the key)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", headers=headers, timeout=2.0).json().get("warm", True):
                return
        except (httpx.HTTPError, ValueError):
            return
        time.sleep(0.1)


def capture(state_dir: Path, pid: int, key: SnapshotKey, criu: Criu) -> Captured:
    """Dump the running server `pid` (it keeps running) into `state_dir/process-snapshot`, replacing any older one."""
    final = state_dir / SNAPSHOT_DIR
    partial = state_dir / f"{SNAPSHOT_DIR}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(mode=0o700, parents=True)
    started = time.perf_counter()
    # --tcp-close: connections open at this moment (none, normally) are not resumed; the listener is.
    dump = [criu.binary, "dump", "--tree", str(pid), "--images-dir", str(partial), "--leave-running"]
    result = subprocess.run(
        [*dump, "--tcp-close", "--log-file", "dump.log"], capture_output=True, text=True, check=False,
        umask=PRIVATE_UMASK,  # the images hold the server's memory: its key, the prompts it served
    )  # fmt: skip
    if result.returncode != 0:
        reason = _log_errors(partial / "dump.log")
        shutil.rmtree(partial, ignore_errors=True)
        raise SnapshotUnavailable(f"criu dump failed: {reason}")
    seconds = time.perf_counter() - started
    (partial / META_FILE).write_text(json.dumps(asdict(key), indent=2) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    make_private(partial)  # whatever modes CRIU gave its images
    partial.replace(final)  # a snapshot directory is either complete or absent
    size = sum(path.stat().st_size for path in final.iterdir())
    return Captured(final, size, seconds)


def exists(state_dir: Path) -> bool:
    return (state_dir / SNAPSHOT_DIR / META_FILE).is_file()


def discard(state_dir: Path) -> None:
    shutil.rmtree(state_dir / SNAPSHOT_DIR, ignore_errors=True)


def recorded_port(state_dir: Path) -> int | None:
    """The port the snapshot's server listens on (a restored process keeps its socket), if there is one."""
    try:
        command = json.loads((state_dir / SNAPSHOT_DIR / META_FILE).read_text())["command"]
        return int(command[command.index("--port") + 1])
    except (FileNotFoundError, ValueError, KeyError, IndexError, TypeError):
        return None


def problem(state_dir: Path, key: SnapshotKey) -> str | None:
    """Why the snapshot in `state_dir` cannot be resumed with `key` (absent, unreadable, taken with another
    key); None when it can."""
    meta = state_dir / SNAPSHOT_DIR / META_FILE
    try:
        data = json.loads(meta.read_text())
        taken_with = SnapshotKey(**{**data, "command": tuple(data["command"])})
    except FileNotFoundError:
        return "no process snapshot yet"
    except (ValueError, TypeError, KeyError) as exc:
        return f"{meta} is unreadable ({exc})"
    return key.mismatch(taken_with)


def restore(state_dir: Path, key: SnapshotKey, criu: Criu, log_file: Path, prefix: Sequence[str] = ()) -> int:
    """Resume the snapshot in `state_dir` as a detached server; its pid. Raises SnapshotUnavailable.

    `prefix` runs CRIU (memory_limit.join_prefix: in the server's memory cgroup, where the restored process
    stays: the cgroups it was dumped in are not restored, they may be gone)."""
    images = state_dir / SNAPSHOT_DIR
    unusable = problem(state_dir, key)
    if unusable is not None:
        raise SnapshotUnavailable(unusable)
    pidfile = images / "restored.pid"
    pidfile.unlink(missing_ok=True)
    # The server's stdout/stderr were the log file, which has grown since: hand CRIU the file open now
    # (it refuses to reopen a file whose size changed). Truncated, as a fresh start's log is.
    log_fd = os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        result = subprocess.run(
            [*prefix, criu.binary, "restore", "--images-dir", str(images), "--restore-detached", "--tcp-close",
             "--manage-cgroups=ignore",
             "--inherit-fd", f"fd[{log_fd}]:{str(log_file.resolve()).lstrip('/')}",
             "--pidfile", str(pidfile), "--log-file", "restore.log"],
            capture_output=True, text=True, check=False, pass_fds=(log_fd,), timeout=RESTORE_TIMEOUT,
            umask=PRIVATE_UMASK,
        )  # fmt: skip
    finally:
        os.close(log_fd)
    if result.returncode != 0:
        raise SnapshotUnavailable(f"criu restore failed: {_log_errors(images / 'restore.log')}")
    pid = int(pidfile.read_text())
    os.kill(pid, signal.SIGUSR1)  # the server's after-restore hook
    return pid


def _arguments_changed(before: tuple[str, ...], now: tuple[str, ...]) -> str:
    """What a server command gained and lost, rather than both commands in full."""
    added = [arg for arg in now if arg not in before]
    dropped = [arg for arg in before if arg not in now]
    parts = ([f"now with {' '.join(added)}"] if added else []) + ([f"no more {' '.join(dropped)}"] if dropped else [])
    return "; ".join(parts) or "its arguments are in another order"


def _log_errors(log: Path) -> str:
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if "Error" in line]
        lines = [line for line in lines if "RLIMIT_NOFILE" not in line]  # logged on every run, harmless
    except FileNotFoundError:
        return f"no log at {log}"
    return "; ".join(lines[-3:]) or f"see {log}"


@functools.cache  # the sources do not change during one deploy, which may build a key twice (refused restore)
def _runtime_digest() -> str:
    digest = hashlib.sha256()
    root = Path(runtime.__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()
