"""The transport's side of a reader's stream (:class:`StreamPort`), and the stand-in that reads
an unattended session while no stream does (:class:`UnattendedPort`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import quicsrv_proto

__all__ = ["StreamPort", "UnattendedPort"]


class StreamPort(Protocol):
    """The transport's side of one response stream.

    It is handed frames, not bytes, so that each transport encodes them its own way (CBOR on
    the native stream, SSE events on the OpenAI one) without decoding anything back.
    """

    def send_frame(self, frame: quicsrv_proto.Frame, end_stream: bool) -> None: ...

    def send_frames(self, frames: Sequence[quicsrv_proto.Frame]) -> None:
        """Several frames in one write (on QUIC, one HTTP/3 DATA frame); the stream goes on."""

    def sent_offset(self) -> int:
        """Stream bytes written so far."""

    def acked_offset(self) -> int:
        """Stream bytes the peer acknowledged without a gap."""


class UnattendedPort:
    """The reader of an unattended session while no stream reads it: takes every frame at
    once and drops it (the record keeps them), so the engine never waits."""

    def __init__(self) -> None:
        self._sent = 0

    def send_frame(self, frame: quicsrv_proto.Frame, end_stream: bool) -> None:
        self._sent += 1

    def send_frames(self, frames: Sequence[quicsrv_proto.Frame]) -> None:
        self._sent += len(frames)

    def sent_offset(self) -> int:
        return self._sent

    def acked_offset(self) -> int:
        return self._sent
