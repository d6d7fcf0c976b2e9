"""`docs/api.md`: the HTTP API rendered from the OpenAPI document the server publishes, plus the queue API.

The HTTP part is generated from `runtime/http/openapi.py` (what `GET /openapi.json` serves) for each
kind of bundle; `python -m packager.api_reference` rewrites the page, and a test fails when it is stale.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

from runtime.api.protocol import RequestPolicy
from runtime.bundle import CLASSIFICATION_TASK, EMBEDDING_TASK
from runtime.engine.config import EngineConfig
from runtime.events import schema as events_schema
from runtime.http.connection_limits import ConnectionLimits
from runtime.http.openapi import document
from runtime.http.openapi_routes import core_pieces

API_PAGE = Path(__file__).resolve().parents[1] / "docs" / "api.md"
# The limits shown are the server's defaults (`python -m runtime serve --help` changes them).
EXAMPLE_POLICY = RequestPolicy(model_name="NAME", vocab_size=49152)
TASKS = (("chat and completion bundles", "chat"), ("embedding bundles", EMBEDDING_TASK),
         ("classification bundles", CLASSIFICATION_TASK))  # fmt: skip

QUEUE_DELIVERY = """\
The worker deletes a message only after its result is stored (written once per `request_id`, so a
redelivered message never produces a second result); a message that keeps failing reaches the
dead-letter queue after `max_receive_count` deliveries. The Lambda handler reports partial batch
failures (`ReportBatchItemFailures`), so one bad message never fails its neighbours. Error results
carry the same body as HTTP errors (see [troubleshooting](troubleshooting.md)).
`pkg invoke functions/NAME "prompt" --queue QUEUE_URL` sends a request and waits for its result.
"""


def grammar_limits() -> list[str]:
    """The structured-output budgets of a chat request, from the server's defaults, as one wrapped paragraph."""
    policy, config = EXAMPLE_POLICY, EngineConfig()
    text = (
        "Structured output limits ([details](structured-output.md#limits)): a `response_format` schema, regex or"
        f" grammar, or a `guided_*` field, may take {policy.max_grammar_bytes} bytes (of its JSON; a string: its"
        f" UTF-8), and `tools` {policy.max_tools} functions whose `parameters` take {policy.max_tool_schema_bytes}"
        " bytes together; beyond that, 400 naming the field and the limit. The grammar is compiled before the"
        " request is queued, off the event loop: one that cannot be used, runs llguidance's lexer out of fuel,"
        f" takes more than {config.grammar_max_bytes >> 20} MiB compiled or more than {config.grammar_compile_s:g} s"
        " to compile is a 400 with the reason in plain text; while other requests' grammars hold the compiler"
        f" that long, 429 with `Retry-After`. Compiled grammars are kept up to {config.grammar_cache_bytes >> 20}"
        " MiB, least recently used evicted first."
    )
    return [*textwrap.wrap(text, width=110), ""]


def render() -> str:
    lines = [
        "# HTTP and queue APIs",
        "",
        "Generated from the OpenAPI document the server serves at `GET /openapi.json` by",
        "`python -m packager.api_reference`; do not edit by hand. Shapes follow OpenAI's API.",
        "",
        "Every body is `application/json` or `application/msgpack` (same schema; msgpack maps may key",
        "`logit_bias` by integer token id); the response uses the format `Accept` names. With `stream`,",
        "JSON responses are server-sent events (`data: {chunk}` … `data: [DONE]`) and msgpack responses",
        "are the chunk maps back to back. With an API key configured, every route but `/health` needs",
        "`Authorization: Bearer KEY` (`/ready` answers without it, but only with its status).",
        "",
        *textwrap.wrap("**Connections.** " + ConnectionLimits().describe(), width=110),
    ]
    for title, task in TASKS:
        spec = document(EXAMPLE_POLICY, core_pieces(EXAMPLE_POLICY, task), auth=True)
        lines += ["", f"## Routes of {title}", ""]
        for path, operations in spec["paths"].items():
            for method, operation in operations.items():
                lines += _operation(method.upper(), path, operation, spec["components"]["schemas"])
                if path == "/v1/chat/completions":
                    lines += grammar_limits()
    queue = ["", "## Queue API (SQS: `python -m runtime worker`, or SQS events of the Lambda handler)", ""]
    queue += textwrap.dedent(events_schema.__doc__ or "").strip().splitlines()
    return "\n".join(lines + queue) + "\n\n" + QUEUE_DELIVERY


def _operation(method: str, path: str, operation: dict[str, Any], schemas: dict[str, Any]) -> list[str]:
    lines = [f"### `{method} {path}`", "", operation.get("summary", ""), ""]
    body = operation.get("requestBody", {}).get("content", {})
    schema = next(iter(body.values())).get("schema") if body else None
    if schema:
        resolved = _resolve(schema, schemas)
        required = set(resolved.get("required", ()))
        lines += ["| field | type | required | notes |", "|---|---|---|---|"]
        for name, prop in resolved.get("properties", {}).items():
            prop = _resolve(prop, schemas)
            notes = _notes(prop)  # bounds from the server's limits
            lines.append(f"| `{name}` | {_type(prop, schemas)} | {'yes' if name in required else ''} | {notes} |")
        lines.append("")
    statuses = ", ".join(f"{code} {r.get('description', '')}".strip() for code, r in operation["responses"].items())
    return [*lines, f"Responses: {statuses}.", ""]


def _resolve(schema: dict[str, Any], schemas: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = schemas[schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def _type(schema: dict[str, Any], schemas: dict[str, Any]) -> str:
    schema = _resolve(schema, schemas)
    for union in ("anyOf", "oneOf"):
        if union in schema:
            return " \\| ".join(dict.fromkeys(_type(s, schemas) for s in schema[union]))
    if "enum" in schema:
        return " \\| ".join(f"`{v}`" for v in schema["enum"])
    if "const" in schema:
        return f"`{schema['const']}`"
    kind = schema.get("type", "any")
    if isinstance(kind, list):
        return " \\| ".join(kind)
    if kind == "array" and "items" in schema:
        return f"array of {_type(schema['items'], schemas)}"
    return str(kind)


def _notes(schema: dict[str, Any]) -> str:
    members = [m for m in schema.get("anyOf", ()) if m.get("type") != "null"]
    parts = [_notes(m) for m in members if _notes(m)]
    bounds = {
        "minimum": "≥", "maximum": "≤", "exclusiveMinimum": ">", "exclusiveMaximum": "<",
        "maxItems": "at most items:", "maxLength": "at most chars:", "maxProperties": "at most entries:",
    }  # fmt: skip
    for key, sign in bounds.items():
        if key in schema:
            parts.append(f"{sign} {schema[key]}")
    if "default" in schema:
        parts.append(f"default `{schema['default']}`")
    if schema.get("description"):
        parts.append(" ".join(str(schema["description"]).split()))
    return "; ".join(parts).replace("|", "\\|")


def main() -> int:
    API_PAGE.write_text(render())
    print(f"wrote {API_PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
