"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status.

Every client mistake leaves the server as an `APIError` (a 4xx naming the offending field); the engine's
own errors are translated here so handlers never build error bodies by hand.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from runtime.engine.request import EngineOverloadedError, InvalidRequestError


class APIError(Exception):
    """An error response: HTTP `status`, the OpenAI error object fields and extra response headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


def invalid_param(param: str | None, message: str, *, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_engine_error(exc: InvalidRequestError | EngineOverloadedError) -> APIError:
    if isinstance(exc, EngineOverloadedError):
        # Retry-After takes whole seconds; round up so a client never retries before the hint.
        retry_after = max(1, math.ceil(exc.retry_after))
        return APIError(
            429,
            str(exc),
            error_type="rate_limit_error",
            code="engine_overloaded",
            headers={"Retry-After": str(retry_after)},
        )
    return APIError(400, str(exc), param=exc.param, code=exc.code)


def unknown_adapter(function: str, adapter: str, available: tuple[str, ...] | None) -> APIError:
    """OpenAI's 404 for `model: "FUNCTION:ADAPTER"` naming an adapter this server lacks; `available`: the adapter
    names it has (None: the bundle's graph takes no adapters at all)."""
    model = f"{function}:{adapter}"
    if available is None:
        why = (
            f"{function!r} takes no adapters; declare [[adapters]] (or [export] adapter_modules) in function.toml "
            "and rebuild"
        )
    elif available:
        why = f"this server serves {function!r} and the adapters {', '.join(f'{function}:{a}' for a in available)}"
    else:
        why = f"this server serves {function!r} and no adapters yet"
    return APIError(404, f"The model {model!r} does not exist; {why}", param="model", code="model_not_found")


def unavailable(message: str) -> APIError:
    return APIError(503, message, error_type="service_unavailable", code="not_ready")
