"""The tuned UDP socket: every option is read back from the kernel with getsockopt."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from quicsrv.settings import socket_options_for
from quicsrv.transport.sockets import open_udp_socket
from quicsrv.transport.tcp import open_tcp_socket

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="option values are Linux's"
)

IP_MTU_DISCOVER = 10
IPV6_MTU_DISCOVER = 23
PMTUDISC_PROBE = 3
SMALL_BUFFER = 256 * 1024


def _sysctl(name: str) -> int:
    try:
        return int(Path("/proc/sys", *name.split(".")).read_text())
    except OSError:
        pytest.skip(f"cannot read {name}")


def _ipv6_available() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


def test_ipv4_socket_options_read_back() -> None:
    if _sysctl("net.core.rmem_max") < SMALL_BUFFER or _sysctl("net.core.wmem_max") < SMALL_BUFFER:
        pytest.skip("buffer sysctls below the test's request")
    options = socket_options_for(recv_buffer_bytes=SMALL_BUFFER, send_buffer_bytes=SMALL_BUFFER)
    sock, applied = open_udp_socket("127.0.0.1", 0, options)
    with sock:
        assert sock.family == socket.AF_INET
        assert sock.getblocking() is False
        assert sock.getsockname()[1] == applied.address[1] != 0
        assert applied.family == "IPv4"

        rcvbuf = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        sndbuf = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        # Linux doubles the request for its bookkeeping and reports the doubled figure.
        assert applied.recv_buffer_reported == rcvbuf == 2 * SMALL_BUFFER
        assert applied.send_buffer_reported == sndbuf == 2 * SMALL_BUFFER
        assert applied.recv_buffer_bytes == applied.send_buffer_bytes == SMALL_BUFFER
        assert not applied.recv_buffer_clamped and not applied.send_buffer_clamped

        assert sock.getsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER) == PMTUDISC_PROBE
        assert applied.dont_fragment
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 0
        assert not applied.reuse_port
        assert applied.warnings == ()


@pytest.mark.skipif(not _ipv6_available(), reason="no IPv6 loopback")
def test_dual_stack_socket_options_read_back() -> None:
    sock, applied = open_udp_socket("::", 0, socket_options_for())
    with sock:
        assert sock.family == socket.AF_INET6
        assert applied.family == "IPv6 dual-stack"
        assert sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0
        assert sock.getsockopt(socket.IPPROTO_IPV6, IPV6_MTU_DISCOVER) == PMTUDISC_PROBE
        assert sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_DONTFRAG) == 1
        # IPv4-mapped peers follow the IPv4 option on the same socket.
        assert sock.getsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER) == PMTUDISC_PROBE
        assert applied.dont_fragment


@pytest.mark.skipif(not _ipv6_available(), reason="no IPv6 loopback")
def test_dual_stack_socket_receives_an_ipv4_datagram() -> None:
    sock, applied = open_udp_socket("::", 0, socket_options_for())
    with sock, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
        sender.sendto(b"over IPv4", ("127.0.0.1", applied.address[1]))
        sock.settimeout(10)  # a bound on a broken test, not a timing assumption
        data, address = sock.recvfrom(100)
        sender_port = sender.getsockname()[1]
    assert data == b"over IPv4"
    assert address[0] == "::ffff:127.0.0.1"
    assert address[1] == sender_port


@pytest.mark.skipif(not _ipv6_available(), reason="no IPv6 loopback")
def test_ipv6_only_when_dual_stack_is_off() -> None:
    sock, applied = open_udp_socket("::", 0, socket_options_for(dual_stack=False))
    with sock:
        assert sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1
        assert applied.family == "IPv6"
        # No IPv4 traffic can arrive, so only the IPv6 options are set.
        assert sock.getsockopt(socket.IPPROTO_IPV6, IPV6_MTU_DISCOVER) == PMTUDISC_PROBE


def test_pmtu_probe_off_leaves_the_kernel_default() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as plain:
        default = plain.getsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER)
    sock, applied = open_udp_socket("127.0.0.1", 0, socket_options_for(pmtu_probe=False))
    with sock:
        assert sock.getsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER) == default
        assert not applied.dont_fragment


def test_clamped_buffers_are_reported_with_the_sysctl_to_raise() -> None:
    rmem_max = _sysctl("net.core.rmem_max")
    wmem_max = _sysctl("net.core.wmem_max")
    options = socket_options_for(
        recv_buffer_bytes=2 * rmem_max + 4096, send_buffer_bytes=2 * wmem_max
    )
    sock, applied = open_udp_socket("127.0.0.1", 0, options)
    with sock:
        # Plain SO_RCVBUF is capped by the sysctl even for root (only *FORCE bypasses it).
        rcvbuf = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        assert applied.recv_buffer_reported == rcvbuf == 2 * rmem_max
        assert applied.recv_buffer_bytes == rmem_max
        assert applied.send_buffer_bytes == wmem_max
    assert applied.recv_buffer_clamped and applied.send_buffer_clamped
    rcv_warning, snd_warning = applied.warnings
    assert "SO_RCVBUF" in rcv_warning
    assert f"net.core.rmem_max is {rmem_max}" in rcv_warning
    assert f"sysctl -w net.core.rmem_max={options.recv_buffer_bytes}" in rcv_warning
    assert "SO_SNDBUF" in snd_warning and "net.core.wmem_max" in snd_warning
    assert f"rcvbuf={rmem_max} (asked {options.recv_buffer_bytes}, clamped)" in applied.describe()


def test_reuse_port_lets_two_sockets_bind_one_port() -> None:
    options = socket_options_for(reuse_port=True)
    first, applied = open_udp_socket("127.0.0.1", 0, options)
    with first:
        assert first.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 1
        assert applied.reuse_port
        second, again = open_udp_socket("127.0.0.1", applied.address[1], options)
        with second:
            assert again.address == applied.address


def test_without_reuse_port_the_port_is_taken() -> None:
    first, applied = open_udp_socket("127.0.0.1", 0, socket_options_for())
    with first, pytest.raises(OSError):
        open_udp_socket("127.0.0.1", applied.address[1], socket_options_for())


def test_describe_is_one_line_naming_each_option() -> None:
    sock, applied = open_udp_socket("127.0.0.1", 0, socket_options_for(reuse_port=True))
    with sock:
        line = applied.describe()
    assert "\n" not in line
    assert line.startswith(f"udp 127.0.0.1:{applied.address[1]} IPv4 ")
    for part in ("rcvbuf=", "sndbuf=", "dont_fragment=on", "reuse_port=on"):
        assert part in line


def test_invalid_buffer_size_is_refused() -> None:
    with pytest.raises(ValueError, match="recv_buffer_bytes"):
        socket_options_for(recv_buffer_bytes=0)


@pytest.mark.parametrize("host", ["127.0.0.1", "::"])
def test_every_accepted_tcp_connection_sends_without_nagle(host: str) -> None:
    # A streamed event must leave at once, not wait for the previous one's ACK.
    listener = open_tcp_socket(host, 0)
    with listener, socket.create_connection(("127.0.0.1", listener.getsockname()[1])):
        listener.setblocking(True)
        accepted, _ = listener.accept()
        with accepted:
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
