"""SSE event ids: opaque cursors naming (session, token index), authenticated by a keyed MAC.

A cursor is ``base64url(session id ‖ index ‖ flags ‖ MAC)`` without padding: 16 + 4 + 1 + 16
bytes, 50 characters. The MAC is a keyed BLAKE3 (the server's snapshot MAC keys, so key
rotation and its grace period apply alike) over a domain label and everything before it, so a
cursor can be neither forged nor moved to another session or index. ``flags`` records what the
stream looked like (chat or text completion, usage chunk wanted), so a resumed stream is
rendered exactly like the original.

The index is the last token the event covers: -1 for the opening event, a token index for a
token's event, and the completion's token count for the finishing event. A stream of
Anthropic's Messages API (``FLAG_MESSAGES``) has several events for some tokens and none for
others, so there the index is the event's own number in the stream (0: ``message_start``):
:mod:`.anthropic_stream`.

:func:`read_cursor` is the one reading of a resume request's cursor (``Last-Event-ID``, or
``?last_event_id=`` for a client that cannot set headers), whichever API's stream it names.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import struct
import urllib.parse
from dataclasses import dataclass

import blake3

from quicsrv_proto.frames import MAX_TOKEN_INDEX

from .errors import ApiError

__all__ = [
    "CURSOR_CHARS",
    "FLAG_CHAT",
    "FLAG_MESSAGES",
    "FLAG_USAGE",
    "Cursor",
    "InvalidCursor",
    "decode_cursor",
    "encode_cursor",
    "read_cursor",
]

_DOMAIN = b"quicsrv-sse-cursor/1\x00"
_MAC_BYTES = 16  # 128 bits: forging one takes 2^128 tries at best
_BODY = struct.Struct(">16siB")
_RAW_BYTES = _BODY.size + _MAC_BYTES
CURSOR_CHARS = (_RAW_BYTES * 8 + 5) // 6

FLAG_CHAT = 1
FLAG_USAGE = 2
FLAG_MESSAGES = 4  # an Anthropic Messages stream: the index numbers events, not tokens


class InvalidCursor(ValueError):
    """The cursor is malformed or its MAC does not verify under any live key."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Cursor:
    session_id: bytes
    """The session the event belongs to."""
    index: int
    """The last token index the event covers (see the module docstring)."""
    flags: int
    """``FLAG_CHAT`` | ``FLAG_USAGE`` | ``FLAG_MESSAGES``: how the stream is rendered."""

    @property
    def chat(self) -> bool:
        return bool(self.flags & FLAG_CHAT)

    @property
    def messages(self) -> bool:
        """The stream is one of Anthropic's Messages API (:mod:`.anthropic_stream`)."""
        return bool(self.flags & FLAG_MESSAGES)

    @property
    def include_usage(self) -> bool:
        return bool(self.flags & FLAG_USAGE)


def encode_cursor(key: bytes, session_id: bytes, index: int, flags: int) -> str:
    """The cursor of ``session_id`` at ``index``, MACed with ``key`` (the ring's current)."""
    body = _BODY.pack(session_id, index, flags)
    mac = blake3.blake3(_DOMAIN + body, key=key).digest(_MAC_BYTES)
    return _text(body + mac)


def _text(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def decode_cursor(text: str, keys: list[bytes]) -> Cursor:
    """The cursor ``text`` names, if a live key made it; raises :class:`InvalidCursor`."""
    if len(text) != CURSOR_CHARS:
        raise InvalidCursor("the cursor is not one this server issued")
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise InvalidCursor("the cursor is not one this server issued") from None
    # Strict: base64 ignores stray characters and the unused bits of the last one, so several
    # texts decode to the same bytes; only the one this server wrote is accepted.
    if len(raw) != _RAW_BYTES or _text(raw) != text:
        raise InvalidCursor("the cursor is not one this server issued")
    body, presented = raw[: _BODY.size], raw[_BODY.size :]
    ok = False
    for key in keys:
        # Every key is tried, each in constant time, so timing says nothing about which.
        ok |= hmac.compare_digest(
            blake3.blake3(_DOMAIN + body, key=key).digest(_MAC_BYTES), presented
        )
    if not ok:
        raise InvalidCursor("the cursor does not verify: forged, or from another server")
    session_id, index, flags = _BODY.unpack(body)
    if not -1 <= index <= MAX_TOKEN_INDEX:
        raise InvalidCursor("the cursor is not one this server issued")
    return Cursor(session_id=session_id, index=index, flags=flags)


def read_cursor(
    last_event_id: bytes | None, query: str, session_id: bytes, keys: list[bytes]
) -> Cursor:
    """The cursor a resume of ``session_id``'s stream presents (``Last-Event-ID``, else the
    query's ``last_event_id``), verified under ``keys``: 400 without one, 403 for one this
    server did not issue for that stream."""
    if last_event_id is not None:
        text = last_event_id.decode("latin-1").strip()
    else:
        values = urllib.parse.parse_qs(query).get("last_event_id", [])
        text = values[0].strip() if values else ""
    if not text:
        raise ApiError(
            400,
            "resuming a stream needs the last event id it received (Last-Event-ID)",
            code="missing_last_event_id",
            param="Last-Event-ID",
        )
    try:
        cursor = decode_cursor(text, keys)
    except InvalidCursor as exc:
        raise ApiError(403, str(exc), code="invalid_cursor", param="Last-Event-ID") from None
    if cursor.session_id != session_id:
        raise ApiError(
            403,
            "the cursor belongs to another stream",
            code="invalid_cursor",
            param="Last-Event-ID",
        )
    return cursor
