"""The Greengrass component's `Run` step, on the core device. Shipped as an artifact: stdlib and `runtime` only.

agent mode: start `python -m runtime agent` on the component's work folder, then hand it the deployed bundle
archive through the agent's own upload API over loopback, so the bundle goes through the same verify → smoke →
atomic switch as a `pkg push`. A bundle the agent refuses makes this exit 1, so Greengrass marks the component
broken and (with failure_handling = "ROLLBACK") restores the previous component version, whose bundle the agent
is still serving. worker mode: unpack the archive once, with the agent's safe unpack, and become the queue worker.

    python3 onnxfn_greengrass.py --mode agent --archive A.tar --archive-sha256 HEX --bundle-digest sha256:… \
        --work DIR [--port N] [--token-file F | --token-secret ID] [--queue-url URL] -- RUNTIME_FLAGS…
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

CHUNK_BYTES = 8 << 20
START_TIMEOUT = 300.0  # the agent binds its port first; loading the previous bundle may take minutes on a device
INSTALL_TIMEOUT = 1800.0  # a first TensorRT engine build happens inside the smoke generation


class AgentFailure(Exception):
    pass


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    runtime_flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = _parser().parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.mode == "worker":
        return run_worker(args, work, runtime_flags)
    return run_agent(args, work, runtime_flags)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onnxfn_greengrass")
    parser.add_argument("--mode", choices=("agent", "worker"), required=True)
    parser.add_argument("--archive", type=Path, required=True, help="the bundle archive Greengrass downloaded")
    parser.add_argument("--archive-sha256", required=True)
    parser.add_argument("--bundle-digest", required=True, help="the manifest digest the archive holds")
    parser.add_argument("--work", required=True, help="the component's {work:path}")
    parser.add_argument("--port", type=int, default=8470)
    # Recipe variables of unset configuration keys arrive as empty strings: "" means unset.
    parser.add_argument("--token-file", default="")
    parser.add_argument("--token-secret", default="")
    parser.add_argument("--queue-url", default="")
    parser.add_argument("--region", default="")
    return parser


def run_worker(args: argparse.Namespace, work: Path, flags: list[str]) -> int:
    if not args.queue_url:
        print("onnxfn: worker mode needs QueueUrl in the component configuration", file=sys.stderr)
        return 2
    from runtime.agent.unpack import unpack

    bundles = work / "bundles"
    bundles.mkdir(exist_ok=True)
    name = args.archive_sha256[:16]
    target = bundles / name
    if not target.is_dir():
        staging = bundles / f".{name}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        unpack(args.archive, staging)
        os.replace(staging, target)
    for stale in bundles.iterdir():
        if stale.name != name:
            shutil.rmtree(stale, ignore_errors=True)  # earlier component versions' bundles
    region = ["--region", args.region] if args.region else []
    command = [sys.executable, "-m", "runtime", "worker", str(target), "--queue-url", args.queue_url, *region, *flags]
    os.execv(sys.executable, command)
    return 0  # not reached


def run_agent(args: argparse.Namespace, work: Path, flags: list[str]) -> int:
    token = _agent_token(args)
    token_file = work / "agent-token"
    token_file.touch(mode=0o600)
    token_file.write_text(token + "\n")
    command = [
        sys.executable, "-m", "runtime", "agent", "--bundle-root", str(work / "agent"),
        "--token-file", str(token_file), "--host", "0.0.0.0", "--port", str(args.port), *flags,
    ]  # fmt: skip
    agent = subprocess.Popen(command)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda number, _frame: agent.send_signal(number))
    api = AgentApi(f"http://127.0.0.1:{args.port}", token)
    try:
        current = api.wait_up(agent, START_TIMEOUT).get("current") or {}
        if current.get("digest") == args.bundle_digest:
            print(f"onnxfn: the agent already serves {args.bundle_digest}", flush=True)
        else:
            api.upload(args.archive, args.archive_sha256)
            report = api.install(args.archive_sha256, INSTALL_TIMEOUT)
            print(f"onnxfn: {report.get('action')} {report.get('digest')} {report.get('phases')}", flush=True)
    except AgentFailure as exc:
        print(f"onnxfn: {exc}", file=sys.stderr, flush=True)
        agent.terminate()
        agent.wait()
        return 1
    return agent.wait()


def _agent_token(args: argparse.Namespace) -> str:
    if args.token_file:
        return Path(args.token_file).read_text().strip()
    if args.token_secret:
        import boto3  # credentials from the Token Exchange Service the recipe depends on

        client = boto3.client("secretsmanager", region_name=args.region or None)
        return str(client.get_secret_value(SecretId=args.token_secret)["SecretString"]).strip()
    raise SystemExit("onnxfn: agent mode needs TokenFile or TokenSecret in the component configuration")


class AgentApi:
    """The few `/agent/*` calls a local hand-over needs (`packager/edge/client.py` is the full client)."""

    def __init__(self, url: str, token: str) -> None:
        self.url = url
        self.token = token

    def wait_up(self, agent: subprocess.Popen[bytes], timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if agent.poll() is not None:
                raise AgentFailure(f"the agent exited with {agent.returncode} before it answered")
            try:
                status = self.call("GET", "/agent/status")
            except (OSError, AgentFailure):
                time.sleep(0.5)
                continue
            if not (status.get("install") or {}).get("running"):
                return status
            time.sleep(0.5)  # still loading the bundle it served before: compare with that one
        raise AgentFailure(f"the agent did not answer on {self.url} within {timeout:.0f} s")

    def upload(self, archive: Path, upload_id: str) -> None:
        size = archive.stat().st_size
        offset = self._offset(upload_id)
        with archive.open("rb") as f:
            while offset < size:
                f.seek(offset)
                data = f.read(CHUNK_BYTES)
                headers = {"Content-Range": f"bytes {offset}-{offset + len(data) - 1}/{size}"}
                self.call("PUT", f"/agent/uploads/{upload_id}", data, headers)
                offset += len(data)

    def install(self, upload_id: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.call("POST", f"/agent/uploads/{upload_id}/install", timeout=timeout)
            except AgentFailure as exc:
                if "409" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(1.0)  # another install (the start-up recovery) is running

    def _offset(self, upload_id: str) -> int:
        request = self._request("HEAD", f"/agent/uploads/{upload_id}")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return int(response.headers["Upload-Offset"])
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return 0
            raise AgentFailure(f"HEAD /agent/uploads/{upload_id} answered {exc.code}") from exc

    def call(
        self, method: str, path: str, data: bytes | None = None, headers: dict[str, str] | None = None,
        timeout: float = 60.0,
    ) -> dict[str, Any]:  # fmt: skip
        try:
            with urllib.request.urlopen(self._request(method, path, data, headers), timeout=timeout) as response:
                body = response.read()
        except urllib.error.HTTPError as exc:
            raise AgentFailure(f"{method} {path} answered {exc.code}: {_message(exc.read())}") from exc
        return json.loads(body) if body else {}

    def _request(
        self, method: str, path: str, data: bytes | None = None, headers: dict[str, str] | None = None
    ) -> urllib.request.Request:
        headers = {"Authorization": f"Bearer {self.token}", **(headers or {})}
        return urllib.request.Request(self.url + path, data=data, headers=headers, method=method)


def _message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:300].decode(errors="replace")


if __name__ == "__main__":
    sys.exit(main())
