"""The server's UDP socket, made here and handed to aioquic: buffers, DF/PMTU, dual-stack.

aioquic's :func:`aioquic.asyncio.serve` creates its socket with ``create_datagram_endpoint``'s
defaults: small kernel buffers (a burst of datagrams from many clients overflows them and is
dropped before Python runs), no don't-fragment bit, and no say over IPV6_V6ONLY.
:func:`open_udp_socket` sets each option and then *reads it back*, because the kernel may
apply something else (Linux silently clamps SO_RCVBUF/SO_SNDBUF to ``net.core.rmem_max`` /
``net.core.wmem_max``); :func:`serve_on_socket` is ``serve()`` with that socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aioquic.asyncio.protocol import QuicConnectionProtocol, QuicStreamHandler
from aioquic.asyncio.server import QuicServer
from aioquic.quic.configuration import QuicConfiguration
from aioquic.tls import SessionTicketFetcher, SessionTicketHandler

__all__ = [
    "AppliedSocketOptions",
    "SocketOptions",
    "open_udp_socket",
    "serve_on_socket",
]


_LINUX = sys.platform.startswith("linux")

# Python 3.11's socket module lacks these; the values are Linux's <linux/in.h>, <linux/in6.h>.
_IP_MTU_DISCOVER: int | None = getattr(socket, "IP_MTU_DISCOVER", 10 if _LINUX else None)
_IP_PMTUDISC_PROBE: int = getattr(socket, "IP_PMTUDISC_PROBE", 3)
_IPV6_MTU_DISCOVER: int | None = getattr(socket, "IPV6_MTU_DISCOVER", 23 if _LINUX else None)
_IPV6_PMTUDISC_PROBE: int = getattr(socket, "IPV6_PMTUDISC_PROBE", 3)
_IPV6_DONTFRAG: int | None = getattr(socket, "IPV6_DONTFRAG", 62 if _LINUX else None)
_SO_REUSEPORT: int | None = getattr(socket, "SO_REUSEPORT", None)


@dataclass(frozen=True, slots=True, kw_only=True)
class SocketOptions:
    """What to ask of the kernel for the server's UDP socket."""

    recv_buffer_bytes: int
    """SO_RCVBUF request; the kernel may clamp it (``net.core.rmem_max`` on Linux)."""
    send_buffer_bytes: int
    """SO_SNDBUF request; the kernel may clamp it (``net.core.wmem_max`` on Linux)."""
    pmtu_probe: bool
    """Set don't-fragment and leave path-MTU discovery to QUIC (IP_PMTUDISC_PROBE)."""
    reuse_port: bool
    """SO_REUSEPORT, so several processes can bind the same port and share its load."""
    dual_stack: bool = True
    """On an IPv6 address, also accept IPv4 (IPV6_V6ONLY = 0); ignored for IPv4."""

    def __post_init__(self) -> None:
        for name in ("recv_buffer_bytes", "send_buffer_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")


@dataclass(frozen=True, slots=True, kw_only=True)
class AppliedSocketOptions:
    """What the kernel actually applied, read back with getsockopt after setting it."""

    address: tuple[str, int]
    """The bound host and port (port 0 resolved to the ephemeral one)."""
    family: str
    """``"IPv6 dual-stack"``, ``"IPv6"`` or ``"IPv4"``."""
    recv_buffer_requested: int
    """SO_RCVBUF as asked for."""
    recv_buffer_bytes: int
    """SO_RCVBUF in effect, comparable with the request (on Linux, half what getsockopt says)."""
    recv_buffer_reported: int
    """SO_RCVBUF as getsockopt reports it (Linux reports double the usable size)."""
    recv_buffer_clamped: bool
    """The kernel applied less than was asked for."""
    send_buffer_requested: int
    """SO_SNDBUF as asked for."""
    send_buffer_bytes: int
    """SO_SNDBUF in effect, comparable with the request (on Linux, half what getsockopt says)."""
    send_buffer_reported: int
    """SO_SNDBUF as getsockopt reports it (Linux reports double the usable size)."""
    send_buffer_clamped: bool
    """The kernel applied less than was asked for."""
    dont_fragment: bool
    """The DF bit is set (IPv4) and IPv6 datagrams are not fragmented locally."""
    reuse_port: bool
    """SO_REUSEPORT is on."""
    warnings: tuple[str, ...] = ()
    """One line per option the kernel refused or reduced, with the fix where there is one."""

    def describe(self) -> str:
        """One line for the start-up log."""
        host, port = self.address
        shown = f"[{host}]" if ":" in host else host
        return (
            f"udp {shown}:{port} {self.family}"
            f" rcvbuf={self.recv_buffer_bytes} (asked {self.recv_buffer_requested}"
            f"{', clamped' if self.recv_buffer_clamped else ''})"
            f" sndbuf={self.send_buffer_bytes} (asked {self.send_buffer_requested}"
            f"{', clamped' if self.send_buffer_clamped else ''})"
            f" dont_fragment={'on' if self.dont_fragment else 'off'}"
            f" reuse_port={'on' if self.reuse_port else 'off'}"
        )


def open_udp_socket(
    host: str, port: int, options: SocketOptions
) -> tuple[socket.socket, AppliedSocketOptions]:
    """Create, tune and bind a non-blocking UDP socket; report what the kernel applied.

    ``host`` is an address or a name (the first address it resolves to is used); ``"::"``
    gives one socket for IPv6 and IPv4 when ``options.dual_stack``. Raises :class:`OSError`
    when the address cannot be resolved or bound, or when SO_REUSEPORT is asked for but
    unavailable; options the kernel merely reduces become warnings.
    """
    family, sockaddr = _resolve(host, port)
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        applied = _configure_and_bind(sock, family, sockaddr, options)
    except BaseException:
        sock.close()
        raise
    return sock, applied


def _resolve(host: str, port: int) -> tuple[socket.AddressFamily, tuple[Any, ...]]:
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_DGRAM, flags=socket.AI_PASSIVE)
    for family, _type, _proto, _canonname, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6):
            return family, sockaddr
    raise OSError(f"{host!r} resolves to no IPv4 or IPv6 address")


def _configure_and_bind(
    sock: socket.socket,
    family: socket.AddressFamily,
    sockaddr: tuple[Any, ...],
    options: SocketOptions,
) -> AppliedSocketOptions:
    warnings: list[str] = []

    family_name = "IPv4"
    if family == socket.AF_INET6:
        # Set explicitly: the default comes from net.ipv6.bindv6only and differs by system.
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if options.dual_stack else 1)
        v6only = sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)
        family_name = "IPv6" if v6only else "IPv6 dual-stack"
        if options.dual_stack and v6only:
            warnings.append("IPV6_V6ONLY stayed on: IPv4 clients cannot reach this socket")

    recv_bytes, recv_reported, recv_clamped = _set_buffer(
        sock, socket.SO_RCVBUF, options.recv_buffer_bytes, "net.core.rmem_max", warnings
    )
    send_bytes, send_reported, send_clamped = _set_buffer(
        sock, socket.SO_SNDBUF, options.send_buffer_bytes, "net.core.wmem_max", warnings
    )

    dont_fragment = False
    if options.pmtu_probe:
        dont_fragment = _set_dont_fragment(sock, family, warnings)

    reuse_port = False
    if options.reuse_port:
        if _SO_REUSEPORT is None:
            raise OSError("SO_REUSEPORT is not available on this platform")
        sock.setsockopt(socket.SOL_SOCKET, _SO_REUSEPORT, 1)
        reuse_port = bool(sock.getsockopt(socket.SOL_SOCKET, _SO_REUSEPORT))

    sock.setblocking(False)
    sock.bind(sockaddr)
    bound = sock.getsockname()
    return AppliedSocketOptions(
        address=(str(bound[0]), int(bound[1])),
        family=family_name,
        recv_buffer_requested=options.recv_buffer_bytes,
        recv_buffer_bytes=recv_bytes,
        recv_buffer_reported=recv_reported,
        recv_buffer_clamped=recv_clamped,
        send_buffer_requested=options.send_buffer_bytes,
        send_buffer_bytes=send_bytes,
        send_buffer_reported=send_reported,
        send_buffer_clamped=send_clamped,
        dont_fragment=dont_fragment,
        reuse_port=reuse_port,
        warnings=tuple(warnings),
    )


def _set_buffer(
    sock: socket.socket, option: int, requested: int, sysctl: str, warnings: list[str]
) -> tuple[int, int, bool]:
    """Set one buffer size; return (effective, as getsockopt reports it, clamped)."""
    name = "SO_RCVBUF" if option == socket.SO_RCVBUF else "SO_SNDBUF"
    sock.setsockopt(socket.SOL_SOCKET, option, requested)
    reported = sock.getsockopt(socket.SOL_SOCKET, option)
    # Linux stores min(request, sysctl) * 2 to account for its own bookkeeping (socket(7)) and
    # reports that doubled figure; elsewhere the figure is the usable size.
    usable = reported // 2 if _LINUX else reported
    clamped = usable < requested
    if clamped:
        limit = _read_sysctl(sysctl) if _LINUX else None
        where = f"{sysctl} is {limit}" if limit is not None else f"see {sysctl}"
        warnings.append(
            f"{name}: asked for {requested} bytes, kernel applied {usable} ({where}; "
            f"raise it with `sysctl -w {sysctl}={requested}`)"
        )
    return usable, reported, clamped


def _read_sysctl(name: str) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(Path("/proc/sys", *name.split(".")).read_text())
    return None


def _set_dont_fragment(
    sock: socket.socket, family: socket.AddressFamily, warnings: list[str]
) -> bool:
    """Set DF with PMTU probing; True when every option that applies was read back set.

    RFC 9000 §14: QUIC datagrams must not be fragmented at the IP layer and the DF bit is set
    where possible; QUIC sizes its own packets (§14.2-14.3), so PROBE rather than DO: the
    kernel sets DF but neither shrinks nor refuses sends on ICMP-learnt path MTUs.
    """
    wanted: list[tuple[str, int, int | None, int]] = []
    if family == socket.AF_INET6:
        wanted.append(
            ("IPV6_MTU_DISCOVER", socket.IPPROTO_IPV6, _IPV6_MTU_DISCOVER, _IPV6_PMTUDISC_PROBE)
        )
        wanted.append(("IPV6_DONTFRAG", socket.IPPROTO_IPV6, _IPV6_DONTFRAG, 1))
    # IPv4 traffic on a dual-stack socket (IPv4-mapped peers) follows the IPv4 options, so a
    # dual-stack socket needs IP_MTU_DISCOVER as well; Linux accepts it on AF_INET6 sockets.
    ipv4_needed = family == socket.AF_INET or not sock.getsockopt(
        socket.IPPROTO_IPV6, socket.IPV6_V6ONLY
    )
    if ipv4_needed:
        wanted.append(("IP_MTU_DISCOVER", socket.IPPROTO_IP, _IP_MTU_DISCOVER, _IP_PMTUDISC_PROBE))
    all_set = True
    for name, level, option, value in wanted:
        if option is None:
            warnings.append(f"{name} is not available on this platform; datagrams may fragment")
            all_set = False
            continue
        try:
            sock.setsockopt(level, option, value)
            applied = sock.getsockopt(level, option)
        except OSError as exc:
            warnings.append(f"{name} refused ({exc.strerror}); datagrams may fragment")
            all_set = False
            continue
        if applied != value:
            warnings.append(f"{name}: asked for {value}, kernel applied {applied}")
            all_set = False
    return all_set


async def serve_on_socket(
    sock: socket.socket,
    *,
    configuration: QuicConfiguration,
    create_protocol: Callable[..., QuicConnectionProtocol] = QuicConnectionProtocol,
    session_ticket_fetcher: SessionTicketFetcher | None = None,
    session_ticket_handler: SessionTicketHandler | None = None,
    retry: bool = False,
    stream_handler: QuicStreamHandler | None = None,
) -> QuicServer:
    """:func:`aioquic.asyncio.serve` on a socket made by :func:`open_udp_socket`.

    The arguments mean what they mean for ``serve()``; the server takes ownership of
    ``sock`` and closes it in :meth:`QuicServer.close`.
    """
    loop = asyncio.get_running_loop()
    _, protocol = await loop.create_datagram_endpoint(
        lambda: QuicServer(
            configuration=configuration,
            create_protocol=create_protocol,
            session_ticket_fetcher=session_ticket_fetcher,
            session_ticket_handler=session_ticket_handler,
            retry=retry,
            stream_handler=stream_handler,
        ),
        sock=sock,
    )
    return protocol
