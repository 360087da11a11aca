"""What a peer causes and the server only notes: an abrupt close, a TLS error, a protocol
violation.

Any peer can cause these at will, so each costs at most one log line per source and
``interval_s`` (the rest are counted into the next line), never a traceback, and is counted per
source for ``/metrics`` (``quicsrv_peer_errors_total``). Three ways reach here: hypercorn's error
logger (HTTP/1.1 and HTTP/2 on TCP), aioquic's loggers (a QUIC peer's protocol violation is a
WARNING there) and the event loop's exception handler (:func:`quicsrv.logs.quiet_exception_handler`:
a task or transport nobody awaits, failed by its peer).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable

__all__ = ["PEER_ERRORS", "PeerErrorLog", "install_filters", "is_peer_error"]

#: The loggers whose records a peer causes, and the source each is counted under.
_SOURCES = {"quicsrv.tcp": "tcp", "quic": "quic", "http3": "quic"}
#: aioquic logs a peer's protocol violation (and nothing of its own) at WARNING and above.
_EVERY_WARNING = frozenset({"quic", "http3"})
INTERVAL_S = 10.0

log = logging.getLogger("quicsrv.peer")


@functools.cache
def _peer_error_types() -> tuple[type[BaseException], ...]:
    """A peer's doing: the connection or TLS failed under it, or it broke HTTP/1.1 or HTTP/2
    (h11's and h2's errors, where the server extra is installed)."""
    types: list[type[BaseException]] = [
        ssl.SSLError,
        ConnectionError,
        asyncio.IncompleteReadError,
        EOFError,
    ]
    try:
        import h11

        types.append(h11.RemoteProtocolError)
    except ImportError:
        pass
    try:
        import h2.exceptions

        types.append(h2.exceptions.ProtocolError)
    except ImportError:
        pass
    return tuple(types)


def is_peer_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a peer's doing (a group: every error in it is, or a cancellation)."""
    if isinstance(exc, BaseExceptionGroup):
        leaves = [e for e in exc.exceptions if not isinstance(e, asyncio.CancelledError)]
        return bool(leaves) and all(is_peer_error(e) for e in leaves)
    return isinstance(exc, _peer_error_types())


class PeerErrorLog:
    """Counts peer errors per source and logs at most one line per source and interval."""

    def __init__(
        self, *, interval_s: float = INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()  # aioquic and the engine's threads may log too
        self.counts: Counter[str] = Counter()
        """Peer errors so far, per source (``tcp``, ``quic``, ``loop``)."""
        self._unlogged: Counter[str] = Counter()
        self._quiet_until: dict[str, float] = {}

    def report(self, source: str, what: str) -> None:
        """One more peer error from ``source``; logged if its source has been quiet."""
        with self._lock:
            self.counts[source] += 1
            now = self._clock()
            if now < self._quiet_until.get(source, 0.0):
                self._unlogged[source] += 1
                return
            self._quiet_until[source] = now + self.interval_s
            unlogged = self._unlogged.pop(source, 0)
        more = f" (and {unlogged} more since the last such line)" if unlogged else ""
        log.info(
            "peer error (%s): %s%s",
            source,
            what,
            more,
            extra={"event": "peer_error", "code": source},
        )


PEER_ERRORS = PeerErrorLog()


class _PeerErrorFilter(logging.Filter):
    """On a logger a peer can make speak: its errors go to :data:`PEER_ERRORS` instead."""

    def __init__(self, source: str, *, every_warning: bool) -> None:
        super().__init__()
        self._source = source
        self._every_warning = every_warning

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and is_peer_error(exc):
            PEER_ERRORS.report(self._source, f"{record.getMessage()}: {exc!r}")
            return False
        if self._every_warning and record.levelno >= logging.WARNING:
            PEER_ERRORS.report(self._source, record.getMessage())
            return False
        return True


def install_filters() -> None:
    """Route the peer errors of hypercorn's and aioquic's loggers to :data:`PEER_ERRORS`
    (once per process)."""
    for name, source in _SOURCES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _PeerErrorFilter) for f in logger.filters):
            logger.addFilter(_PeerErrorFilter(source, every_warning=name in _EVERY_WARNING))
