"""quicsrv's Python client: stream LLM tokens over HTTP/3.

Usage::

    import asyncio
    from client import Client, TokenReceived, GenerationEnded

    async def main() -> None:
        async with Client("localhost", 4433, ca="certs/ca.pem") as c:
            async for event in c.generate("Once upon a time", max_tokens=32):
                if isinstance(event, TokenReceived):
                    print(event.text, end="", flush=True)
                elif isinstance(event, GenerationEnded):
                    print(f"\\n[{event.reason}]")
            result = await c.generate_text(messages=[{"role": "user", "content": "Hi"}])
            print(result.text)

    asyncio.run(main())

Errors (see :mod:`client._errors`): :class:`ServerError` for ERROR frames,
:class:`ProtocolError` for malformed server bytes, :class:`TransportError`
(:class:`ConnectTimeout`, :class:`NetworkError`) for connection trouble; all are
:class:`ClientError`. Breaking out of ``generate`` cancels the request on the server.
"""

from ._client import (
    DEFAULT_CA,
    H3_REQUEST_CANCELLED,
    Client,
    ClientStats,
    MessageLike,
    PlainResponse,
)
from ._errors import (
    ClientError,
    ConnectTimeout,
    NetworkError,
    ProtocolError,
    ServerError,
    StallTimeout,
    TransportError,
)
from ._events import (
    CheckpointReceived,
    Event,
    GenerationEnded,
    GenerationResult,
    Reconnected,
    ResumePosition,
    SessionStarted,
    TokenReceived,
)
from ._generation import Generation, ReconnectPolicy, collect
from ._tickets import TicketCache, default_ticket_cache_path

__all__ = [
    "DEFAULT_CA",
    "H3_REQUEST_CANCELLED",
    "CheckpointReceived",
    "Client",
    "ClientError",
    "ClientStats",
    "ConnectTimeout",
    "Event",
    "GenerationEnded",
    "GenerationResult",
    "Generation",
    "MessageLike",
    "NetworkError",
    "PlainResponse",
    "ProtocolError",
    "Reconnected",
    "ReconnectPolicy",
    "ResumePosition",
    "ServerError",
    "StallTimeout",
    "SessionStarted",
    "TicketCache",
    "TokenReceived",
    "TransportError",
    "collect",
    "default_ticket_cache_path",
]
