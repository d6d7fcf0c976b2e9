"""`pkg invoke functions/NAME "prompt"`: stream a chat reply from the deployed endpoint to stdout.

The reply goes to stdout as it arrives (so it pipes cleanly); token counts and timing go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from packager.deploy import local
from packager.errors import UserError
from packager.spec import load_spec

err_console = Console(stderr=True)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("invoke", help="send a chat prompt to a deployed function")
    parser.add_argument("function", type=Path, help="function folder holding function.toml")
    parser.add_argument("prompt", help="the user message")
    parser.add_argument("--system", help="a system message (default: the function's system prompt)")
    parser.add_argument("--max-tokens", type=int, help="default: the function's")
    parser.add_argument("--temperature", type=float, help="default: the function's")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the whole reply")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.function)
    status = local.status(spec)
    if status is None:
        raise UserError(f"{spec.name} is not deployed; deploy it first: pkg deploy {args.function} --target local")
    if status.state != "ready":
        tail = local.log_tail(Path(status.deployment.log_file))
        raise UserError(
            f"the local deployment of {spec.name} is not serving (state: {status.state}, pid {status.pid}); "
            f"redeploy with `pkg deploy {args.function} --target local`\n{tail}"
        )
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}
    ]
    body: dict[str, Any] = {
        "model": spec.name,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.max_tokens is not None:
        body["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        body["temperature"] = args.temperature
    key = status.deployment.api_key.read()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    started = time.perf_counter()
    usage = _stream_reply(f"{status.url}/v1/chat/completions", body, headers, args.timeout)
    elapsed = time.perf_counter() - started
    if usage:
        err_console.print(
            f"[dim]{usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion tokens "
            f"in {elapsed:.2f} s[/]"
        )
    return 0


def _stream_reply(url: str, body: dict[str, Any], headers: dict[str, str], timeout: float) -> dict[str, int] | None:
    usage: dict[str, int] | None = None
    try:
        with httpx.stream("POST", url, json=body, headers=headers, timeout=timeout) as response:
            if response.status_code != 200:
                response.read()
                raise UserError(f"the endpoint answered {response.status_code}: {_error_message(response)}")
            for event in _events(response.iter_lines()):
                if "error" in event:
                    raise UserError(f"the endpoint failed mid-reply: {event['error'].get('message')}")
                for choice in event.get("choices", []):
                    sys.stdout.write(choice["delta"].get("content") or "")
                    sys.stdout.flush()
                usage = event.get("usage") or usage
    except httpx.HTTPError as exc:
        raise UserError(f"cannot reach {url}: {exc}") from exc
    finally:
        sys.stdout.write("\n")
        sys.stdout.flush()
    return usage


def _events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            return
        yield json.loads(data)


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:500]
