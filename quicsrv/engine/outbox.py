"""What goes to the engine worker in its next message: the commands gathered since the last
send, with the KV blobs of resumed sequences.

The callers' ``submit``/``cancel``/``pause``/``allow`` (on the event loop) only append to the
:class:`Outbox` of a :class:`~.supervisor.WorkerEngine`; its sender thread takes everything at
once and sends it as one message. On the way an allowance that a later one for the same
sequence replaces is dropped (a message holds at most one per sequence, however many ACKs
arrived since the last send), and each blob is written to the spool (:mod:`.spool`), so that
only its file's name goes over the socket. Not thread-safe: the supervisor calls it under its
lock (writing blobs, which takes no lock, is left to the sender: :meth:`Outgoing.written`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container
from dataclasses import dataclass

from .ipc import Allow, Command, Submit
from .spool import Spool

__all__ = ["Outbox", "Outgoing"]


class Outbox:
    """See the module docstring."""

    def __init__(self) -> None:
        self._commands: list[Command] = []
        self._blobs: dict[int, bytes] = {}  # by key: the blobs of Submits queued or held back

    def __bool__(self) -> bool:
        return bool(self._commands)

    def append(self, command: Command) -> None:
        self._commands.append(command)

    def attach(self, key: int, blob: bytes) -> None:
        """Sequence ``key``'s Submit (queued now, or once the poison watch releases it) brings
        ``blob``, its KV cells."""
        self._blobs[key] = blob

    def detach(self, key: int) -> bytes | None:
        """Sequence ``key`` stops before its Submit was sent: its blob, back."""
        return self._blobs.pop(key, None)

    def worker_died(self, held: Container[int]) -> None:
        """Nothing queued for the dead worker is sent; the blobs of the ``held`` sequences
        (never sent: they go to the next worker) stay."""
        self._commands.clear()
        self._blobs = {key: blob for key, blob in self._blobs.items() if key in held}

    def clear(self) -> None:
        self._commands.clear()
        self._blobs.clear()

    def take(self) -> Outgoing:
        """Everything to send now (the outbox is empty after)."""
        commands, self._commands = self._commands, []
        blobs = {
            c.key: self._blobs.pop(c.key)
            for c in commands
            if isinstance(c, Submit) and c.key in self._blobs
        }
        return Outgoing(commands, blobs)


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One message's commands, in order, and the blobs of its Submits."""

    commands: list[Command]
    blobs: dict[int, bytes]

    def written(self, spool: Spool, incarnation: int) -> list[Command]:
        """The message for worker ``incarnation``: the latest allowance of each sequence only,
        each blob written to ``spool`` and named by its Submit (one that could not be written
        goes without: the worker replays instead)."""
        return [
            self._with_blob_file(c, spool, incarnation) for c in _latest_allowances(self.commands)
        ]

    def _with_blob_file(self, command: Command, spool: Spool, incarnation: int) -> Command:
        if not isinstance(command, Submit) or command.key not in self.blobs:
            return command
        kv_file = spool.write_in(incarnation, command.key, self.blobs[command.key])
        return command if kv_file is None else dataclasses.replace(command, kv_file=kv_file)


def _latest_allowances(batch: list[Command]) -> list[Command]:
    """Drop every allowance that a later one for the same sequence replaces."""
    seen: set[int] = set()
    kept: list[Command] = []
    for command in reversed(batch):
        if isinstance(command, Allow):
            if command.key in seen:
                continue
            seen.add(command.key)
        kept.append(command)
    kept.reverse()
    return kept
