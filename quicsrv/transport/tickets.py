"""Server-side TLS session tickets: where issued tickets wait for the client to come back.

aioquic is stateful about tickets: after each handshake it calls ``session_ticket_handler``
with the ticket it just sent (an opaque random label plus the resumption secret), and when a
client offers a label it asks ``session_ticket_fetcher(label)`` for that ticket. A ticket found
there resumes the session and, if the client sent early data, accepts it as 0-RTT.

0-RTT data is replayable (RFC 8446 §8, RFC 9001 §9.2): whoever captured the first flight can
send it again, and aioquic checks neither the ticket age nor a replay cache. The measure RFC 8446
§8.1 calls single-use tickets is what :class:`TicketStore` encodes: the fetcher *pops*, so a
label resumes at most one connection and a replayed flight finds nothing, falling back to a
full handshake where its early data is discarded. (Each connection is issued a fresh ticket,
so honest clients lose nothing.) Across processes sharing a port, the store must be shared
too, and its pop must be atomic (a GETDEL, not a GET then a DEL) for that guarantee to hold.
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import cbor2
from aioquic.tls import CipherSuite, SessionTicket

__all__ = [
    "TICKET_LIFETIME_S",
    "MemoryTicketStore",
    "TicketStore",
    "decode_ticket",
    "encode_ticket",
]

log = logging.getLogger(__name__)

#: The lifetime aioquic writes into every NewSessionTicket (fixed, not configurable), so the
#: time clients keep a ticket; a store that forgets sooner turns their 0-RTT into a full handshake.
TICKET_LIFETIME_S = 86400.0


class TicketStore(Protocol):
    """Issued session tickets, each resuming at most one connection.

    ``add`` is aioquic's ``session_ticket_handler`` and ``pop`` its ``session_ticket_fetcher``:
    pass ``session_ticket_handler=store.add, session_ticket_fetcher=store.pop`` to ``serve()``.
    """

    def add(self, ticket: SessionTicket) -> None:
        """Keep a ticket the server has just issued, under ``ticket.ticket``."""
        ...

    def pop(self, label: bytes) -> SessionTicket | None:
        """Remove and return the ticket with this label; ``None`` if unknown or expired.

        Removal is the anti-replay measure (RFC 8446 §8.1) and must be atomic: two
        connections presenting the same label must never both get the ticket.
        """
        ...

    def close(self) -> None:
        """The server stops: leave what the next process may use (a memory store saves its
        unused tickets where it was told to keep them) and let go of what is held."""
        ...


@dataclass(frozen=True, slots=True)
class _Entry:
    ticket: SessionTicket
    expires_at: float


class MemoryTicketStore:
    """An in-process :class:`TicketStore`: bounded, with expiry; safe across threads.

    When full, adding a ticket evicts the oldest one (its client will do a full handshake).
    A ticket expires ``ttl_s`` after it was added (default: the lifetime clients are told), or
    earlier when the ticket's own ``not_valid_after`` passes, which aioquic checks itself.
    ``clock`` is monotonic seconds; tests pass their own.
    """

    def __init__(
        self,
        *,
        ttl_s: float = TICKET_LIFETIME_S,
        max_tickets: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        keep_at: Path | None = None,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        if max_tickets < 1:
            raise ValueError("max_tickets must be at least 1")
        self._ttl_s = ttl_s
        self._max_tickets = max_tickets
        self._clock = clock
        # Insertion order is expiry order (one TTL for all), so the front is both the oldest
        # and the first to expire.
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        # aioquic calls from the event loop thread only; the lock is for a store shared by
        # servers running on several loops/threads in one process.
        self._lock = threading.Lock()
        self._keep_at = keep_at

    def add(self, ticket: SessionTicket) -> None:
        """Keep ``ticket``; evicts the oldest ticket when ``max_tickets`` are held."""
        with self._lock:
            now = self._clock()
            self._purge_expired(now)
            self._entries.pop(ticket.ticket, None)
            self._entries[ticket.ticket] = _Entry(ticket, now + self._ttl_s)
            while len(self._entries) > self._max_tickets:
                self._entries.popitem(last=False)

    def pop(self, label: bytes) -> SessionTicket | None:
        """Remove and return the ticket for ``label``; ``None`` if unknown or expired."""
        with self._lock:
            entry = self._entries.pop(label, None)
            if entry is None or entry.expires_at <= self._clock():
                return None
            return entry.ticket

    def get(self, label: bytes) -> SessionTicket | None:
        """Look without removing. Not a fetcher: a ticket that stays would allow replay."""
        with self._lock:
            entry = self._entries.get(label)
            if entry is None or entry.expires_at <= self._clock():
                return None
            return entry.ticket

    def save(self, path: Path) -> int:
        """Write the tickets not yet used to ``path`` (0600, atomically), for the next process
        on this data dir: a restart keeps its clients' 0-RTT resumes. That keeps resumption
        secrets at rest, a decision: with a ticket's secret, captured 0-RTT data of its client
        can be read. They sit in the data dir (0700) beside the MAC keys and the session
        records, which hold every prompt and answer in clear: whoever can read one can read
        all. Returns how many were written."""
        with self._lock:
            now = self._clock()
            tickets = [e.ticket for e in self._entries.values() if e.expires_at > now]
        data = cbor2.dumps([encode_ticket(t) for t in tickets])
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return len(tickets)

    def close(self) -> None:
        """Save the unused tickets at ``keep_at`` (when given) for the next process."""
        if self._keep_at is not None:
            saved = self.save(self._keep_at)
            log.info("session tickets: %d saved for the next process", saved)

    def load(self, path: Path) -> int:
        """Take the tickets a previous process saved at ``path``, and remove the file: each
        ticket still resumes one connection, here or nowhere. Returns how many were taken."""
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return 0
        path.unlink()
        now = datetime.datetime.now(datetime.UTC)
        taken = 0
        try:
            for encoded in cbor2.loads(data):
                ticket = decode_ticket(bytes(encoded))
                if ticket.not_valid_after > now:
                    self.add(ticket)
                    taken += 1
        except (ValueError, TypeError, KeyError, cbor2.CBORDecodeError) as exc:
            log.warning("ignoring unreadable saved session tickets in %s: %s", path, exc)
        return taken

    def __len__(self) -> int:
        """Tickets held, expired ones included until the next ``add`` purges them."""
        with self._lock:
            return len(self._entries)

    def _purge_expired(self, now: float) -> None:
        while self._entries:
            label, entry = next(iter(self._entries.items()))
            if entry.expires_at > now:
                return
            del self._entries[label]


def encode_ticket(ticket: SessionTicket) -> bytes:
    """A ticket as bytes (CBOR), for a store outside this process."""
    return cbor2.dumps(
        [
            ticket.age_add,
            int(ticket.cipher_suite),
            ticket.not_valid_after.timestamp(),
            ticket.not_valid_before.timestamp(),
            ticket.resumption_secret,
            ticket.server_name,
            ticket.ticket,
            ticket.max_early_data_size,
            [[kind, value] for kind, value in ticket.other_extensions],
        ]
    )


def decode_ticket(data: bytes) -> SessionTicket:
    """The ticket :func:`encode_ticket` wrote; raises ValueError, TypeError, KeyError or
    cbor2.CBORDecodeError on anything else."""
    (age_add, suite, after, before, secret, name, label, early, extensions) = cbor2.loads(data)
    utc = datetime.UTC
    return SessionTicket(
        age_add=int(age_add),
        cipher_suite=CipherSuite(suite),
        not_valid_after=datetime.datetime.fromtimestamp(after, utc),
        not_valid_before=datetime.datetime.fromtimestamp(before, utc),
        resumption_secret=bytes(secret),
        server_name=str(name),
        ticket=bytes(label),
        max_early_data_size=None if early is None else int(early),
        other_extensions=[(int(k), bytes(v)) for k, v in extensions],
    )
