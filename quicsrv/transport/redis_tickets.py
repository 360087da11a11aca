"""TLS session tickets in Redis, so a client's 0-RTT works whichever process it reaches.

Each ticket is one key, ``<prefix>t:<label hex>``, expiring with the ticket (``PX ttl``). The
fetcher's pop is ``GETDEL``: one atomic command, so of two connections presenting the same label
(on any processes) exactly one gets the ticket, and a replayed first flight finds none
(RFC 8446 §8.1 single-use tickets, as :class:`~.tickets.MemoryTicketStore` does in-process).

aioquic calls the handler and fetcher synchronously during handshakes, so these are blocking
round trips on the event loop (one per handshake that issues or presents a ticket; about 0.1 ms
to a Redis on the same host). A Redis failure costs the client its 0-RTT, never the connection:
the ticket is then simply not kept, or not found, and the handshake is a full one.
"""

from __future__ import annotations

import logging

import cbor2
import redis
from aioquic.tls import SessionTicket

from .tickets import TICKET_LIFETIME_S, decode_ticket, encode_ticket

__all__ = ["RedisTicketStore"]

log = logging.getLogger(__name__)


class RedisTicketStore:
    """A :class:`~.tickets.TicketStore` shared by every process using the same Redis."""

    def __init__(
        self, client: redis.Redis, *, ttl_s: float = TICKET_LIFETIME_S, prefix: str = "quicsrv:"
    ) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self._redis = client
        self._ttl_ms = int(ttl_s * 1000)
        self._prefix = f"{prefix}t:"

    def add(self, ticket: SessionTicket) -> None:
        """Keep ``ticket`` under its label until it expires."""
        try:
            self._redis.set(self._key(ticket.ticket), encode_ticket(ticket), px=self._ttl_ms)
        except redis.RedisError as exc:
            log.warning("cannot store a session ticket (its client loses 0-RTT): %s", exc)

    def pop(self, label: bytes) -> SessionTicket | None:
        """Atomically remove and return the ticket for ``label`` (``GETDEL``)."""
        try:
            data = self._redis.getdel(self._key(label))
        except redis.RedisError as exc:
            log.warning("cannot fetch a session ticket (full handshake instead): %s", exc)
            return None
        if data is None:
            return None
        try:
            return decode_ticket(bytes(data))  # type: ignore[arg-type]
        except (ValueError, TypeError, KeyError, cbor2.CBORDecodeError) as exc:
            log.warning("ignoring an unreadable session ticket: %s", exc)
            return None

    def close(self) -> None:
        """The tickets stay in Redis for the other processes; only the client goes."""
        self._redis.close()

    def _key(self, label: bytes) -> str:
        return self._prefix + label.hex()
