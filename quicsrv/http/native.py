"""The native frame API's requests and answers, sans-I/O: ``POST /v1/generate`` (body: one
GENERATE frame) and ``POST /v1/resume`` (body: one RESUME_STREAM frame, the session id also in
the ``quicsrv-session`` header), served over HTTP/3 by the router like every other route.

A request body is read here into its one frame, or refused with the wire format's own error
(``frame_too_large``, ``unexpected_frame``, ``missing_field``...). Its answer is ``200`` and
the session's frames (a :class:`~.messages.SessionStream` with :func:`encode_frames`), or a refusal:
the status of its code and one ERROR frame (:func:`error_response`).
"""

from __future__ import annotations

from collections.abc import Sequence

import quicsrv_proto
from quicsrv_proto.http3 import CONTENT_TYPE, parse_session_header

from .errors import Refusal
from .messages import FullResponse

__all__ = [
    "FRAMES",
    "encode_frames",
    "error_response",
    "read_generate",
    "read_resume",
]

FRAMES = CONTENT_TYPE.decode("ascii")


def read_generate(body: bytes, *, max_payload_bytes: int) -> quicsrv_proto.Generate:
    """The GENERATE a ``/v1/generate`` body holds; raises a ``quicsrv_proto`` error."""
    frame = _one_frame(body, max_payload_bytes)
    if not isinstance(frame, quicsrv_proto.Generate):
        raise quicsrv_proto.UnexpectedFrame(f"expected GENERATE, got {frame.frame_type.name}")
    return frame


def read_resume(
    body: bytes, session_header: bytes | None, *, max_payload_bytes: int
) -> tuple[quicsrv_proto.ResumeStream, bytes | None]:
    """The RESUME_STREAM a ``/v1/resume`` body holds, and the session its header names (None:
    no header); raises a ``quicsrv_proto`` error."""
    frame = _one_frame(body, max_payload_bytes)
    if not isinstance(frame, quicsrv_proto.ResumeStream):
        raise quicsrv_proto.UnexpectedFrame(f"expected RESUME_STREAM, got {frame.frame_type.name}")
    return frame, parse_session_header(session_header)


def encode_frames(frames: Sequence[quicsrv_proto.Frame]) -> bytes:
    """A native response's body bytes for ``frames``."""
    return b"".join([quicsrv_proto.encode_frame(frame) for frame in frames])


def error_response(refusal: Refusal) -> FullResponse:
    """A native refusal: the status of its code and one ERROR frame."""
    return FullResponse(
        status=refusal.status,
        body=quicsrv_proto.encode_frame(refusal.frame()),
        content_type=FRAMES,
        headers=refusal.headers,
    )


def _one_frame(body: bytes, max_payload_bytes: int) -> quicsrv_proto.Frame:
    decoder = quicsrv_proto.FrameDecoder(max_payload_bytes=max_payload_bytes)
    frames = decoder.feed(body)
    if len(frames) > 1:
        raise quicsrv_proto.UnexpectedFrame("the request body holds more than one frame")
    decoder.end_of_stream()
    if not frames:
        raise quicsrv_proto.MissingField("the request body holds no frame")
    return frames[0]
