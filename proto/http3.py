"""How quicsrv's frames travel over HTTP/3: paths, header names, content type, stream codes.

Shared by the server and the client, so neither spells a header name of its own. Header names
and values are bytes, as HTTP/3 carries them (aioquic's headers are ``list[tuple[bytes, bytes]]``).
"""

from __future__ import annotations

from .errors import InvalidField
from .frames import SESSION_ID_BYTES

__all__ = [
    "AUTHORIZATION_HEADER",
    "CONTENT_TYPE",
    "EARLY_DATA_HEADER",
    "GENERATE_PATH",
    "H3_NO_ERROR",
    "H3_REQUEST_CANCELLED",
    "NATIVE_PATHS",
    "PROTOCOL_HEADER",
    "RESUME_PATH",
    "RESUME_PATH_HEADER",
    "SESSION_HEADER",
    "parse_session_header",
]

#: The body of every request and response on :data:`NATIVE_PATHS`: frames, back to back.
CONTENT_TYPE = b"application/vnd.quicsrv.frames"
#: ``POST``, body: one GENERATE frame. Starts a session.
GENERATE_PATH = b"/v1/generate"
#: ``POST``, body: one RESUME_STREAM frame (session id also in :data:`SESSION_HEADER`).
RESUME_PATH = b"/v1/resume"
NATIVE_PATHS = frozenset({GENERATE_PATH, RESUME_PATH})

#: The session id, hex: on every 200 response, and on a resume request.
SESSION_HEADER = b"quicsrv-session"
#: On a resume's response: how the server continues (kv-restore, replay, reprefill, none).
RESUME_PATH_HEADER = b"quicsrv-resume-path"
#: On a response to a request that arrived whole in 0-RTT data: ``1``.
EARLY_DATA_HEADER = b"quicsrv-early-data"
#: On every response: what carried the request, as ALPN names it (``h3``, ``h2``, ``http/1.1``).
PROTOCOL_HEADER = b"quicsrv-protocol"
AUTHORIZATION_HEADER = b"authorization"

#: The client abandoned the request on purpose (RFC 9114 §8.1): no KV snapshot is worth keeping.
H3_REQUEST_CANCELLED = 0x10C
#: A stream stopped with nothing wrong (RFC 9114 §8.1), e.g. a request body nobody reads.
H3_NO_ERROR = 0x100


def parse_session_header(value: bytes | None) -> bytes | None:
    """The session id a :data:`SESSION_HEADER` names (None when the header is absent); raises
    :class:`~quicsrv_proto.errors.InvalidField` when it is not the hex of a session id."""
    if value is None:
        return None
    try:
        session = bytes.fromhex(value.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        session = b""
    if len(session) != SESSION_ID_BYTES:
        raise InvalidField(
            f"the quicsrv-session header is not a {2 * SESSION_ID_BYTES}-digit hex id"
        )
    return session
