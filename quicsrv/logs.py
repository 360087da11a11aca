"""Log output: the plain format (default) or one JSON object per line (``--log-format json``).

A JSON line always has ``ts`` (UTC, ISO 8601), ``level``, ``logger``, ``event`` and
``message``; log calls add what they know as ``extra`` fields: ``session_id``, ``stream_id``,
``peer``, ``code`` and ``duration_s``. ``event`` names what happened (``stream_ended``,
``request_rejected``, ``session_resumed``); a call that names none gets ``log``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from .peer_errors import PEER_ERRORS, install_filters, is_peer_error

__all__ = [
    "FIELDS",
    "JsonFormatter",
    "LogFormat",
    "configure_logging",
    "current_log_format",
    "log_handler",
    "quiet_exception_handler",
]

#: The ``extra`` fields a JSON line carries when a log call gives them.
FIELDS = ("event", "session_id", "stream_id", "peer", "code", "duration_s", "resume_path")
PLAIN_FORMAT = "%(asctime)s %(name)s %(message)s"


class LogFormat(StrEnum):
    PLAIN = "plain"
    JSON = "json"  # one JSON object per line


LOG_FORMATS = tuple(f.value for f in LogFormat)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines in messages are escaped by JSON)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": "log",
            "message": record.getMessage(),
            "pid": record.process,
        }
        for name in FIELDS:
            value = record.__dict__.get(name)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def current_log_format() -> str:
    """ "json" when the root logger writes JSON lines, else "plain" (for child processes)."""
    handlers = logging.getLogger().handlers
    return "json" if any(isinstance(h.formatter, JsonFormatter) for h in handlers) else "plain"


def log_handler(log_format: str = "plain") -> logging.Handler:
    """A stderr handler writing ``log_format`` ("plain" or "json")."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, not {log_format!r}")
    handler = logging.StreamHandler()
    formatter = JsonFormatter() if log_format == "json" else logging.Formatter(PLAIN_FORMAT)
    handler.setFormatter(formatter)
    return handler


def configure_logging(log_format: str = "plain", level: int = logging.INFO) -> None:
    """Send the root logger's records to stderr in ``log_format`` ("plain" or "json")."""
    logging.basicConfig(level=level, handlers=[log_handler(log_format)], force=True)
    logging.getLogger("quic").setLevel(logging.WARNING)  # aioquic logs every handshake at INFO
    install_filters()


_quiet_log = logging.getLogger("quicsrv.loop")


def quiet_exception_handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The event loop's exception handler (``loop.set_exception_handler``) for what a task or
    transport nobody awaits any more leaves behind: a cancelled task (hypercorn's, cancelled at
    shutdown) is one debug line; a peer's error (a TLS error, a reset, an exception group of
    them) goes to :data:`~.peer_errors.PEER_ERRORS` (counted, one line now and then); anything
    else is a bug, logged by asyncio's default handler with its traceback."""
    exc = context.get("exception")
    if isinstance(exc, asyncio.CancelledError):
        _quiet_log.debug("%s: %r", context.get("message", "unhandled"), exc)
    elif exc is not None and is_peer_error(exc):
        PEER_ERRORS.report("loop", f"{context.get('message', 'unhandled')}: {exc!r}")
    else:
        loop.default_exception_handler(context)
