"""Typed reads of a request body's fields; each bad value is a 400 that names the field and what is allowed.

As in OpenAI's API, a field set to `null` counts as absent, booleans are never accepted as numbers, and a
field the endpoint does not know is rejected (`Unrecognized request argument supplied`) so that a typo such
as `max_token` fails loudly instead of being silently ignored.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any, Literal, overload

from runtime.api.errors import invalid_param

_REPR_LIMIT = 60


def show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _REPR_LIMIT else text[: _REPR_LIMIT - 3] + "..."


def _span(lo: float | None, hi: float | None, *, above: bool = False) -> str:
    low = f"above {lo}" if above else f"at least {lo}"
    if lo is not None and hi is not None:
        return f"{low} and at most {hi}" if above else f"between {lo} and {hi}"
    if lo is not None:
        return low
    return f"at most {hi}"


class BodyReader:
    """One JSON object (the body, or a nested object) with validated accessors; `path` prefixes param names."""

    def __init__(self, body: Any, allowed: Collection[str], *, path: str = "") -> None:
        if not isinstance(body, dict):
            where = path.rstrip(".") or "the request body"
            raise invalid_param(path.rstrip(".") or None, f"{where} must be an object, got {show(body)}")
        for key in body:
            if not isinstance(key, str):
                raise invalid_param(path.rstrip(".") or None, f"object keys must be strings, got {show(key)}")
            if key not in allowed:
                raise invalid_param(
                    path + key, f"Unrecognized request argument supplied: {path + key}", code="unknown_parameter"
                )
        self._body: dict[str, Any] = body
        self._path = path

    def name(self, key: str) -> str:
        return self._path + key

    def has(self, key: str) -> bool:
        return self._body.get(key) is not None

    def raw(self, key: str) -> Any:
        return self._body.get(key)

    def _fail(self, key: str, expected: str) -> Exception:
        return invalid_param(self.name(key), f"{show(self._body[key])} is not valid for '{self.name(key)}': {expected}")

    @overload
    def string(self, key: str, *, required: Literal[True]) -> str: ...
    @overload
    def string(self, key: str, *, required: bool = False) -> str | None: ...
    def string(self, key: str, *, required: bool = False) -> str | None:
        value = self._body.get(key)
        if value is None:
            if required:
                raise invalid_param(
                    self.name(key), f"'{self.name(key)}' is required", code="missing_required_parameter"
                )
            return None
        if not isinstance(value, str):
            raise self._fail(key, "expected a string")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self._body.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._fail(key, "expected true or false")
        return value

    @overload
    def integer(self, key: str, default: int, *, lo: int | None = None, hi: int | None = None) -> int: ...
    @overload
    def integer(self, key: str, default: None, *, lo: int | None = None, hi: int | None = None) -> int | None: ...
    def integer(self, key: str, default: int | None, *, lo: int | None = None, hi: int | None = None) -> int | None:
        value = self._body.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._fail(key, f"expected an integer {_span(lo, hi)}".rstrip())
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise self._fail(key, f"expected an integer {_span(lo, hi)}")
        return value

    @overload
    def number(
        self, key: str, default: float, *, lo: float | None = None, hi: float | None = None, above: bool = False
    ) -> float: ...
    @overload
    def number(
        self, key: str, default: None, *, lo: float | None = None, hi: float | None = None, above: bool = False
    ) -> float | None: ...
    def number(
        self,
        key: str,
        default: float | None,
        *,
        lo: float | None = None,
        hi: float | None = None,
        above: bool = False,
    ) -> float | None:
        """A finite number in [lo, hi], or in (lo, hi] with `above`."""
        value = self._body.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise self._fail(key, f"expected a number {_span(lo, hi, above=above)}")
        too_low = lo is not None and (value <= lo if above else value < lo)
        if too_low or (hi is not None and value > hi):
            raise self._fail(key, f"expected a number {_span(lo, hi, above=above)}")
        return float(value)

    def nested(self, key: str, allowed: Collection[str]) -> BodyReader | None:
        value = self._body.get(key)
        return None if value is None else BodyReader(value, allowed, path=self.name(key) + ".")
