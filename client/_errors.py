"""The client's exception hierarchy.

Every exception the client raises on purpose is a :class:`ClientError`::

    ClientError                 base of everything below
    ├── TransportError          the connection could not be made or was lost
    │   ├── ConnectTimeout      the QUIC/TLS handshake did not finish in time
    │   ├── NetworkError        the connection or stream died before the response was complete
    │   └── StallTimeout        the stream produced nothing for stall_timeout_s on a live connection
    ├── ProtocolError           the server sent bytes that violate the wire format (.error_code)
    └── ServerError             the server answered with an ERROR frame (.code, .slug, ...)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

import quicsrv_proto

__all__ = [
    "ClientError",
    "ConnectTimeout",
    "NetworkError",
    "ProtocolError",
    "ServerError",
    "StallTimeout",
    "TransportError",
    "map_exceptions",
]


class ClientError(Exception):
    """Base of every error the client raises."""


class TransportError(ClientError):
    """The QUIC connection could not be established or was lost."""


class ConnectTimeout(TransportError):
    """The handshake did not complete within ``connect_timeout_s``."""


class NetworkError(TransportError):
    """The connection or the stream ended before the response was complete."""


class StallTimeout(TransportError):
    """A generation's stream produced nothing for ``stall_timeout_s`` while its connection
    was alive: handled like a lost connection (auto-resume), raised when that is not possible."""


class ProtocolError(ClientError):
    """The server sent bytes that are not valid frames, or frames out of place."""

    def __init__(self, message: str, error_code: quicsrv_proto.ErrorCode) -> None:
        super().__init__(message)
        self.message = message
        self.error_code = error_code

    @classmethod
    def from_proto(cls, exc: quicsrv_proto.ProtocolError) -> ProtocolError:
        """Wrap a codec error raised while decoding the server's stream."""
        return cls(exc.message, exc.error_code)


class ServerError(ClientError):
    """The server refused or aborted the request with an ERROR frame."""

    def __init__(
        self,
        code: int,
        message: str,
        *,
        http_status: int | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(f"{_slug(code)} ({code}): {message}")
        self.code = code
        self.message = message
        self.http_status = http_status
        self.retry_after_s = retry_after_s

    @property
    def slug(self) -> str:
        """The error's lower-case name, e.g. ``overloaded``; ``code_N`` for unknown codes."""
        return _slug(self.code)

    def __repr__(self) -> str:
        return (
            f"ServerError(code={self.code}, slug={self.slug!r}, message={self.message!r}, "
            f"http_status={self.http_status}, retry_after_s={self.retry_after_s})"
        )


def _slug(code: int) -> str:
    try:
        return quicsrv_proto.ErrorCode(code).slug
    except ValueError:
        return f"code_{code}"


ErrorFactory = Callable[[Exception], ClientError]


@contextlib.contextmanager
def map_exceptions(mapping: Mapping[type[Exception], ErrorFactory] | None = None) -> Iterator[None]:
    """The one place where what aioquic, the codec and the OS raise becomes a client error.

    A codec error always becomes :class:`ProtocolError`; ``mapping`` turns other exception
    types (matched in order, subclasses included) into the :class:`ClientError` its factory
    builds, chained to the original. Client errors, cancellation and unlisted types pass.
    """
    try:
        yield
    except ClientError:
        raise
    except quicsrv_proto.ProtocolError as exc:
        raise ProtocolError.from_proto(exc) from None
    except Exception as exc:
        for source, make in (mapping or {}).items():
            if isinstance(exc, source):
                raise make(exc) from exc
        raise
