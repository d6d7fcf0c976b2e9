"""`pkg invoke functions/NAME "prompt"`: stream a chat reply from the deployed endpoint to stdout.

For a completion function (`task = "completion"`, a base model without a chat template) the prompt is
raw text for `/v1/completions` and the continuation is streamed instead.

For an embedding function (`task = "embedding"`) it embeds the text instead and prints the vector's size,
norm and first values; for a classifier (`task = "classification"`), every label's probability.

The reply goes to stdout as it arrives (so it pipes cleanly); token counts and timing go to stderr.
A target with an HTTP endpoint (local, jetson) streams; `--target aws-lambda` and `--target aws-sagemaker`
go through boto3 (Lambda's Invoke, SageMaker's InvokeEndpoint) and print the whole reply once complete;
greengrass says where each device serves.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from packager.errors import UserError
from packager.openai_stream import choice_text, error_message, events
from packager.spec import FunctionSpec, load_spec
from packager.targets.base import TARGETS, Target, target

err_console = Console(stderr=True)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("invoke", help="send a prompt to a deployed function")
    parser.add_argument("function", type=Path, help="function folder holding function.toml")
    parser.add_argument("prompt", help="the user message (a completion function: the text to continue)")
    parser.add_argument("--target", choices=TARGETS, default="local")
    parser.add_argument("--system", help="a system message (default: the function's system prompt)")
    parser.add_argument("--max-tokens", type=int, help="default: the function's")
    parser.add_argument("--temperature", type=float, help="default: the function's")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the whole reply")
    parser.add_argument("--queue", metavar="QUEUE_URL", help="send through this SQS queue and wait for the result")
    parser.add_argument(
        "--reply-to",
        metavar="S3_URI|QUEUE_URL",
        help="with --queue: where the result goes (default: a temporary queue)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.function)
    if args.queue:
        return _invoke_queue(spec, args)
    chosen = target(args.target)
    endpoint = chosen.http_endpoint(spec)
    if endpoint is None:
        return _invoke_through_target(chosen, spec, args)
    if spec.model.task == "embedding":
        return _invoke_embedding(f"{endpoint.url}/v1/embeddings", spec, args, endpoint.headers)
    if spec.model.task == "classification":
        return _invoke_classification(f"{endpoint.url}/v1/classify", spec, args, endpoint.headers)
    path, _, body = _generation_request(spec, args, stream=True)
    started = time.perf_counter()
    usage = _stream_reply(f"{endpoint.url}{path}", body, endpoint.headers, args.timeout)
    elapsed = time.perf_counter() - started
    if usage:
        err_console.print(
            f"[dim]{usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion tokens "
            f"in {elapsed:.2f} s[/]"
        )
    return 0


def _invoke_embedding(url: str, spec: FunctionSpec, args: argparse.Namespace, headers: dict[str, str]) -> int:
    """Embed the text and print what came back (size, norm, first values) as a table; the timing to stderr."""
    import base64

    import numpy as np
    from rich.table import Table

    started = time.perf_counter()
    body = {"model": spec.name, "input": args.prompt, "encoding_format": "base64"}
    try:
        response = httpx.post(url, json=body, headers=headers, timeout=args.timeout)
    except httpx.HTTPError as exc:
        raise UserError(f"cannot reach {url}: {exc}") from exc
    if response.status_code != 200:
        raise UserError(f"the endpoint answered {response.status_code}: {error_message(response)}")
    elapsed = time.perf_counter() - started
    reply = response.json()
    vector = np.frombuffer(base64.b64decode(reply["data"][0]["embedding"]), dtype="<f4")
    table = Table(title=f"embedding from {spec.name}", show_header=False)
    table.add_row("dimensions", str(vector.size))
    table.add_row("L2 norm", f"{float(np.linalg.norm(vector)):.6f}")
    table.add_row("first values", ", ".join(f"{v:+.4f}" for v in vector[:6]) + ", …")
    table.add_row("tokens", str(reply["usage"]["prompt_tokens"]))
    Console().print(table)
    err_console.print(f"[dim]embedded in {elapsed:.3f} s[/]")
    return 0


def _invoke_classification(url: str, spec: FunctionSpec, args: argparse.Namespace, headers: dict[str, str]) -> int:
    """Classify the text and print every label's probability, most probable first; the timing to stderr."""
    from rich.table import Table

    started = time.perf_counter()
    try:
        response = httpx.post(
            url, json={"model": spec.name, "input": args.prompt}, headers=headers, timeout=args.timeout
        )
    except httpx.HTTPError as exc:
        raise UserError(f"cannot reach {url}: {exc}") from exc
    if response.status_code != 200:
        raise UserError(f"the endpoint answered {response.status_code}: {error_message(response)}")
    elapsed = time.perf_counter() - started
    reply = response.json()
    result = reply["data"][0]
    table = Table(title=f"{spec.name}: {result['label']}")
    table.add_column("label")
    table.add_column("probability", justify="right")
    for label, probability in sorted(zip(reply["labels"], result["probs"], strict=True), key=lambda lp: -lp[1]):
        style = "bold green" if label == result["label"] else None
        table.add_row(label, f"{probability:.4f}", style=style)
    Console().print(table)
    err_console.print(f"[dim]{reply['usage']['prompt_tokens']} tokens classified in {elapsed:.3f} s[/]")
    return 0


def _generation_request(
    spec: FunctionSpec, args: argparse.Namespace, *, stream: bool
) -> tuple[str, str, dict[str, Any]]:
    """`(HTTP path, queue request kind, body)` for the function's task: a chat, or a raw completion."""
    if spec.model.task == "completion":
        if args.system:
            raise UserError(f"--system applies to chat functions; {spec.name} continues raw text (task = completion)")
        return "/v1/completions", "completion", _body({"model": spec.name, "prompt": args.prompt}, args, stream)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}
    ]
    return "/v1/chat/completions", "chat", _body({"model": spec.name, "messages": messages}, args, stream)


def _body(body: dict[str, Any], args: argparse.Namespace, stream: bool) -> dict[str, Any]:
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    if args.max_tokens is not None:
        body["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        body["temperature"] = args.temperature
    return body


def _invoke_queue(spec: FunctionSpec, args: argparse.Namespace) -> int:
    from packager.queue_client import invoke_via_queue

    started = time.perf_counter()
    _, kind, body = _generation_request(spec, args, stream=False)
    result = invoke_via_queue(args.queue, kind, body, reply_to=args.reply_to, timeout=args.timeout)
    elapsed = time.perf_counter() - started
    if result.status != 200:
        error = result.body.get("error", {})
        raise UserError(f"the function answered {result.status}: {error.get('message')} (param: {error.get('param')})")
    sys.stdout.write(choice_text(result.body["choices"][0]) + "\n")
    sys.stdout.flush()
    usage = result.body["usage"]
    err_console.print(
        f"[dim]{usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion tokens "
        f"in {elapsed:.2f} s via the queue[/]"
    )
    return 0


def _invoke_through_target(chosen: Target, spec: FunctionSpec, args: argparse.Namespace) -> int:
    """A target without an HTTP endpoint of its own (Lambda's Invoke, SageMaker's InvokeEndpoint): one reply."""
    started = time.perf_counter()
    path, _, body = _generation_request(spec, args, stream=False)
    reply = chosen.invoke(spec, path, body)
    elapsed = time.perf_counter() - started
    choices = reply.get("choices") or [{}]
    sys.stdout.write(choice_text(choices[0]) + "\n")
    sys.stdout.flush()
    usage = reply.get("usage")
    if usage:
        err_console.print(
            f"[dim]{usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion tokens "
            f"in {elapsed:.2f} s via {args.target}[/]"
        )
    return 0


def _stream_reply(url: str, body: dict[str, Any], headers: dict[str, str], timeout: float) -> dict[str, int] | None:
    usage: dict[str, int] | None = None
    try:
        with httpx.stream("POST", url, json=body, headers=headers, timeout=timeout) as response:
            if response.status_code != 200:
                response.read()
                raise UserError(f"the endpoint answered {response.status_code}: {error_message(response)}")
            for event in events(response.iter_lines()):
                if "error" in event:
                    raise UserError(f"the endpoint failed mid-reply: {event['error'].get('message')}")
                for choice in event.get("choices", []):
                    sys.stdout.write(choice_text(choice))
                    sys.stdout.flush()
                usage = event.get("usage") or usage
    except httpx.HTTPError as exc:
        raise UserError(f"cannot reach {url}: {exc}") from exc
    finally:
        sys.stdout.write("\n")
        sys.stdout.flush()
    return usage
