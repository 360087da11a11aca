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

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from aioquic.tls import SessionTicket

__all__ = ["TICKET_LIFETIME_S", "MemoryTicketStore", "TicketStore"]

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
