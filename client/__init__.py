"""quicsrv's Python client: stream LLM tokens over HTTP/3.

Usage::

    import asyncio
    from quicsrv_client import Client, ClientConfig, GenerationEnded, SamplingOptions, TokenReceived

    async def main() -> None:
        config = ClientConfig(ca="certs/ca.pem")
        async with Client("localhost", 4433, config=config) as c:
            async with c.stream("Once upon a time", max_tokens=32) as generation:
                async for event in generation:
                    if isinstance(event, TokenReceived):
                        print(event.text, end="", flush=True)
                    elif isinstance(event, GenerationEnded):
                        print(f"\\n[{event.reason}]")
            creative = SamplingOptions(temperature=0.8, seed=7, max_tokens=64)
            result = await c.generate_text(
                messages=[{"role": "user", "content": "Hi"}], sampling=creative
            )
            print(result.text)

    asyncio.run(main())

Errors (see :mod:`quicsrv_client._errors`): :class:`ServerError` for ERROR frames,
:class:`ProtocolError` for malformed server bytes, :class:`TransportError`
(:class:`ConnectTimeout`, :class:`NetworkError`) for connection trouble; all are
:class:`ClientError`. Leaving a ``stream`` block early cancels the request on the server.
"""

from ._client import H3_REQUEST_CANCELLED, Client, MessageLike, PlainResponse
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
from ._generation import Generation, collect
from ._options import DEFAULT_CA, ClientConfig, SamplingOptions
from ._reconnect import ReconnectPolicy
from ._stats import ClientStats
from ._tickets import TicketCache, default_ticket_cache_path

__all__ = [
    "DEFAULT_CA",
    "H3_REQUEST_CANCELLED",
    "CheckpointReceived",
    "Client",
    "ClientConfig",
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
    "SamplingOptions",
    "ServerError",
    "StallTimeout",
    "SessionStarted",
    "TicketCache",
    "TokenReceived",
    "TransportError",
    "collect",
    "default_ticket_cache_path",
]
