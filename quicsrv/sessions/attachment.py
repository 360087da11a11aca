"""A stream reading a session: the transport's port (:class:`StreamPort`), the stand-in that
reads an unattended session while no stream does (:class:`UnattendedPort`), and the
:class:`Attachment` that writes a port a session's frames and reads back how far they got."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import quicsrv_proto

from .reader import ReaderFlow
from .transcript import Transcript

__all__ = ["Attachment", "StreamPort", "UnattendedPort"]


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


class Attachment:
    """One reader of a session: the port its stream is written through, and the reader's flow
    (:class:`~.reader.ReaderFlow`: what it was sent and acknowledged). It writes; the session
    decides what and when."""

    __slots__ = ("port", "reader")

    def __init__(self, port: StreamPort, reader: ReaderFlow) -> None:
        self.port = port
        self.reader = reader

    @property
    def stand_in(self) -> bool:
        """It is the stand-in of an unattended session: no stream, nobody to tell anything."""
        return isinstance(self.port, UnattendedPort)

    def send(self, transcript: Transcript, upto: int, now: float) -> None:
        """Write the frames of the tokens before ``upto`` it was not sent yet: a write per
        chunk of the transcript's."""
        port, reader = self.port, self.reader
        for end, frames in transcript.chunks(reader.next_index, upto):
            port.send_frames(frames)
            reader.wrote(end, port.sent_offset(), now)

    def acknowledged(self, now: float) -> None:
        """Read back how much of the stream the peer acknowledged, at ``now``."""
        self.reader.acknowledged(self.port.acked_offset(), self.port.sent_offset(), now)

    def paused(self, transcript: Transcript, paused_at: int) -> None:
        """The engine paused after ``paused_at`` tokens: send the checkpoint of that point, if
        the transcript gives this reader one."""
        checkpoint = transcript.pause_checkpoint(self.reader.next_index, paused_at)
        if checkpoint is not None:
            self.port.send_frame(checkpoint, False)

    def end(self, frame: quicsrv_proto.Frame) -> bool:
        """End the stream with ``frame``; whether a stream was told (the stand-in is none)."""
        if self.stand_in:
            return False
        self.port.send_frame(frame, True)
        return True
