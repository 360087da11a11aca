"""The client's TLS session ticket cache: one file, mode 0600, one ticket per server.

A ticket received on one connection lets the next one resume the TLS session and send its
request as 0-RTT early data. Tickets hold the resumption secret, from which 0-RTT keys are
derived (RFC 8446 §4.6.1), so the file is private to the user and written atomically (a 0600
temporary file, then ``os.replace``); a file others could read is ignored, not trusted.

The format is JSON (stdlib, nothing executable in it, readable when debugging) rather than
pickle, with bytes as hex and times as ISO 8601. Anything that does not parse or validate
makes the whole file count as empty, with one warning: the cost is one full handshake.
Several processes may share the file; the last writer wins, and a lost ticket costs the same.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from aioquic.tls import CipherSuite, SessionTicket

__all__ = ["TicketCache", "default_ticket_cache_path", "ticket_cache_key"]

log = logging.getLogger("quicsrv_client.tickets")

FORMAT_VERSION = 1
#: A file larger than this was not written by us; refuse to parse it.
MAX_FILE_BYTES = 1 << 20


def ticket_cache_key(host: str, port: int, server_name: str) -> str:
    """The cache key for a server: where we connect and the name we verify."""
    shown = f"[{host}]" if ":" in host else host
    return f"{shown}:{port} {server_name}"


def default_ticket_cache_path() -> Path:
    """``$XDG_CACHE_HOME/quicsrv/tickets.json``, defaulting to ``~/.cache``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "quicsrv" / "tickets.json"


class TicketCache:
    """Session tickets on disk, keyed by :func:`ticket_cache_key`; at most ``max_entries``.

    Every call reads the file afresh, so processes sharing it see each other's tickets.
    Expired tickets are dropped on reading; past ``max_entries`` the oldest are dropped.
    Write failures are logged, never raised: :meth:`put` runs inside aioquic's ticket
    callback, where an exception would break the connection that received the ticket.
    """

    def __init__(self, path: Path | str, *, max_entries: int = 64) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.path = Path(path)
        self.max_entries = max_entries

    def get(self, key: str) -> SessionTicket | None:
        """The valid ticket for ``key``, left in the cache; ``None`` if there is none."""
        return self._load().get(key)

    def pop(self, key: str) -> SessionTicket | None:
        """Take the ticket for ``key`` out of the cache (the usual way to use one).

        RFC 8446 Appendix C.4: clients should not reuse a ticket, as reuse links
        connections; quicsrv's server also accepts each ticket only once.
        """
        tickets = self._load()
        ticket = tickets.pop(key, None)
        if ticket is not None:
            self._save(tickets)
        return ticket

    def put(self, key: str, ticket: SessionTicket) -> None:
        """Store ``ticket`` for ``key``, replacing the previous one. Usable as aioquic's
        ``session_ticket_handler`` via ``lambda t: cache.put(key, t)``."""
        tickets = self._load()
        tickets.pop(key, None)
        tickets[key] = ticket
        self._save(tickets)

    def __len__(self) -> int:
        """Valid tickets in the file."""
        return len(self._load())

    def _load(self) -> dict[str, SessionTicket]:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            log.warning("ignoring ticket cache %s: cannot open it: %s", self.path, exc)
            return {}
        with os.fdopen(fd, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if not stat.S_ISREG(mode):
                log.warning("ignoring ticket cache %s: not a regular file", self.path)
                return {}
            if mode & 0o077:
                log.warning(
                    "ignoring ticket cache %s: mode %o lets others read session secrets",
                    self.path,
                    stat.S_IMODE(mode),
                )
                return {}
            raw = f.read(MAX_FILE_BYTES + 1)
        try:
            if len(raw) > MAX_FILE_BYTES:
                raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
            tickets = _decode_file(raw)
        except (ValueError, TypeError, KeyError) as exc:
            # json.JSONDecodeError and UnicodeDecodeError are ValueErrors.
            log.warning("ignoring corrupt ticket cache %s: %s", self.path, exc)
            return {}
        valid = {key: ticket for key, ticket in tickets.items() if ticket.is_valid}
        return valid

    def _save(self, tickets: dict[str, SessionTicket]) -> None:
        if len(tickets) > self.max_entries:
            newest = sorted(tickets.items(), key=lambda kv: kv[1].not_valid_before)
            tickets = dict(newest[-self.max_entries :])
        data = json.dumps(
            {"version": FORMAT_VERSION, "tickets": {k: _encode(t) for k, t in tickets.items()}},
            sort_keys=True,
        ).encode()
        tmp = self.path.with_name(f".{self.path.name}.{secrets.token_hex(4)}.tmp")
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            # O_EXCL with a random name: never write through a file or link planted by another
            # user. No fsync: after a crash an empty file is ignored like a corrupt one.
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("cannot write ticket cache %s: %s", self.path, exc)
            with contextlib.suppress(OSError):
                tmp.unlink()


def _encode(ticket: SessionTicket) -> dict[str, Any]:
    return {
        "age_add": ticket.age_add,
        "cipher_suite": int(ticket.cipher_suite),
        "not_valid_after": ticket.not_valid_after.isoformat(),
        "not_valid_before": ticket.not_valid_before.isoformat(),
        "resumption_secret": ticket.resumption_secret.hex(),
        "server_name": ticket.server_name,
        "ticket": ticket.ticket.hex(),
        "max_early_data_size": ticket.max_early_data_size,
        # The server's transport parameters travel here; 0-RTT needs them (RFC 9000 §7.4.1).
        "other_extensions": [[kind, value.hex()] for kind, value in ticket.other_extensions],
    }


def _decode_file(raw: bytes) -> dict[str, SessionTicket]:
    document = json.loads(raw.decode("utf-8"))
    if not isinstance(document, dict) or document.get("version") != FORMAT_VERSION:
        raise ValueError(f"not a version {FORMAT_VERSION} ticket cache")
    entries = document["tickets"]
    if not isinstance(entries, dict):
        raise ValueError("'tickets' is not an object")
    return {_require(key, str, "key"): _decode(entry) for key, entry in entries.items()}


def _decode(entry: Any) -> SessionTicket:
    if not isinstance(entry, dict):
        raise ValueError("a ticket entry is not an object")
    max_early = entry["max_early_data_size"]
    extensions = _require(entry["other_extensions"], list, "other_extensions")
    return SessionTicket(
        age_add=_uint32(entry["age_add"], "age_add"),
        cipher_suite=CipherSuite(_require(entry["cipher_suite"], int, "cipher_suite")),
        not_valid_after=_datetime(entry["not_valid_after"], "not_valid_after"),
        not_valid_before=_datetime(entry["not_valid_before"], "not_valid_before"),
        resumption_secret=bytes.fromhex(_require(entry["resumption_secret"], str, "secret")),
        server_name=_require(entry["server_name"], str, "server_name"),
        ticket=bytes.fromhex(_require(entry["ticket"], str, "ticket")),
        max_early_data_size=None if max_early is None else _uint32(max_early, "max_early"),
        other_extensions=[_extension(item) for item in extensions],
    )


def _require(value: Any, kind: type[Any], what: str) -> Any:
    # bool is an int subclass; no field here is a bool.
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{what} is not a {kind.__name__}")
    return value


def _uint32(value: Any, what: str) -> int:
    number: int = _require(value, int, what)
    if not 0 <= number < 1 << 32:
        raise ValueError(f"{what} is out of range")
    return number


def _datetime(value: Any, what: str) -> datetime.datetime:
    moment = datetime.datetime.fromisoformat(_require(value, str, what))
    if moment.tzinfo is None:  # aioquic compares with aware UTC datetimes
        raise ValueError(f"{what} has no time zone")
    return moment


def _extension(item: Any) -> tuple[int, bytes]:
    if not isinstance(item, list) or len(item) != 2:
        raise ValueError("an extension is not a [type, hex] pair")
    kind = _require(item[0], int, "extension type")
    if not 0 <= kind < 1 << 16:
        raise ValueError("extension type is out of range")
    return kind, bytes.fromhex(_require(item[1], str, "extension value"))
