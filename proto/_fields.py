"""Typed, range-checked reads of a decoded CBOR map: every violation is a ProtocolError."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .errors import InvalidField, MalformedPayload, MissingField, UnknownField

_ABSENT: Any = object()


class FieldReader:
    """Reads fields out of one frame's payload map, then insists nothing unknown is left."""

    def __init__(self, frame_name: str, payload: object) -> None:
        if not isinstance(payload, Mapping):
            raise MalformedPayload(f"{frame_name} payload must be a CBOR map")
        for key in payload:
            if not isinstance(key, str):
                raise MalformedPayload(f"{frame_name} payload keys must be text strings")
        self._frame = frame_name
        self._fields: dict[str, object] = dict(payload)

    def _take(self, key: str, required: bool) -> object:
        value = self._fields.pop(key, _ABSENT)
        if value is _ABSENT and required:
            raise MissingField(f"{self._frame}.{key} is required")
        return value

    def _invalid(self, key: str, why: str) -> InvalidField:
        return InvalidField(f"{self._frame}.{key} {why}")

    def integer(self, key: str, *, lo: int, hi: int, default: int = _ABSENT) -> int:
        value = self._take(key, required=default is _ABSENT)
        if value is _ABSENT:
            return default
        return self._check_integer(key, value, lo, hi)

    def optional_integer(self, key: str, *, lo: int, hi: int) -> int | None:
        value = self._take(key, required=False)
        if value is _ABSENT or value is None:
            return None
        return self._check_integer(key, value, lo, hi)

    def _check_integer(self, key: str, value: object, lo: int, hi: int) -> int:
        # bool is an int subclass in Python; on the wire it is a different type.
        if not isinstance(value, int) or isinstance(value, bool):
            raise self._invalid(key, "must be an integer")
        if not lo <= value <= hi:
            raise self._invalid(key, f"must be in [{lo}, {hi}], got {value}")
        return value

    def number(self, key: str, *, lo: float, hi: float, default: float = _ABSENT) -> float:
        value = self._take(key, required=default is _ABSENT)
        if value is _ABSENT:
            return default
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise self._invalid(key, "must be a number")
        number = float(value)
        if not math.isfinite(number) or not lo <= number <= hi:
            raise self._invalid(key, f"must be in [{lo}, {hi}], got {value}")
        return number

    def optional_number(self, key: str, *, lo: float, hi: float) -> float | None:
        value = self._take(key, required=False)
        if value is _ABSENT or value is None:
            return None
        self._fields[key] = value
        return self.number(key, lo=lo, hi=hi)

    def text(self, key: str, *, max_chars: int, default: str = _ABSENT) -> str:
        value = self._take(key, required=default is _ABSENT)
        if value is _ABSENT:
            return default
        return self._check_text(key, value, max_chars)

    def optional_text(self, key: str, *, max_chars: int) -> str | None:
        value = self._take(key, required=False)
        if value is _ABSENT or value is None:
            return None
        return self._check_text(key, value, max_chars)

    def _check_text(self, key: str, value: object, max_chars: int) -> str:
        if not isinstance(value, str):
            raise self._invalid(key, "must be a text string")
        if len(value) > max_chars:
            raise self._invalid(key, f"is longer than {max_chars} characters")
        return value

    def raw_bytes(self, key: str, *, length: int) -> bytes:
        value = self._take(key, required=True)
        if not isinstance(value, bytes):
            raise self._invalid(key, "must be a byte string")
        if len(value) != length:
            raise self._invalid(key, f"must be exactly {length} bytes, got {len(value)}")
        return value

    def flag(self, key: str, *, default: bool) -> bool:
        value = self._take(key, required=False)
        if value is _ABSENT:
            return default
        if not isinstance(value, bool):
            raise self._invalid(key, "must be a boolean")
        return value

    def array(self, key: str, *, max_items: int, required: bool = False) -> list[object] | None:
        value = self._take(key, required=required)
        if value is _ABSENT or value is None:
            return None
        if not isinstance(value, list):
            raise self._invalid(key, "must be an array")
        if len(value) > max_items:
            raise self._invalid(key, f"has more than {max_items} items")
        return value

    def finish(self) -> None:
        """Reject any field the frame type does not define."""
        if self._fields:
            names = ", ".join(sorted(self._fields))
            raise UnknownField(f"{self._frame} has unknown field(s): {names}")
