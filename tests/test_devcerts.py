"""The dev PKI: file modes, certificate contents, reuse and renewal, and real TLS handshakes."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import socket
import ssl
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import ConnectionTerminated, HandshakeCompleted, QuicEvent
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from quicsrv.devcerts import DevCertPaths, describe, ensure_dev_certs

FILES = ("ca.pem", "ca.key", "server.pem", "server.key")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> DevCertPaths:
    """One PKI for the tests that only read it."""
    return ensure_dev_certs(tmp_path_factory.mktemp("pki"))


def load_cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def load_key(path: Path) -> Any:
    return serialization.load_pem_private_key(path.read_bytes(), password=None)


def snapshot(directory: Path) -> dict[str, tuple[bytes, int, int]]:
    """Contents, inode and mtime of every PKI file: what a rewrite would change."""
    result = {}
    for name in FILES:
        st = (directory / name).stat()
        result[name] = ((directory / name).read_bytes(), st.st_ino, st.st_mtime_ns)
    return result


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --- files ---------------------------------------------------------------------------------


def test_creates_the_four_files_and_nothing_else(tmp_path: Path) -> None:
    directory = tmp_path / "certs" / "nested"
    paths = ensure_dev_certs(directory)
    assert paths == DevCertPaths(
        ca_cert=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server.key",
    )
    assert paths.ca_key == directory / "ca.key"
    assert sorted(p.name for p in directory.iterdir()) == sorted(FILES)  # no temp files left


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_keys_are_0600_and_certs_0644_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        paths = ensure_dev_certs(tmp_path)
    finally:
        os.umask(old)
    assert mode(paths.server_key) == 0o600
    assert mode(paths.ca_key) == 0o600
    assert mode(paths.server_cert) == 0o644
    assert mode(paths.ca_cert) == 0o644


def test_key_files_are_created_private_not_chmodded_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[tuple[str, int, int]] = []
    real_open = os.open

    def spy(path: Any, flags: int, mode: int = 0o777, **kwargs: Any) -> int:
        opened.append((os.fspath(path), flags, mode))
        return real_open(path, flags, mode, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    ensure_dev_certs(tmp_path)
    key_opens = [(p, f, m) for p, f, m in opened if p.endswith(".key") or ".key." in p]
    assert len(key_opens) == 2
    for path, flags, created_mode in key_opens:
        assert Path(path).parent == tmp_path  # temp file beside the target: rename is atomic
        assert Path(path).name.startswith(".")
        assert flags & os.O_CREAT and flags & os.O_EXCL and flags & os.O_WRONLY
        assert created_mode == 0o600


def test_a_failed_replace_leaves_the_old_file_and_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = ensure_dev_certs(tmp_path)
    old_cert = paths.server_cert.read_bytes()
    paths.server_key.unlink()  # forces a re-issue of server.key and server.pem

    def broken_replace(src: Any, dst: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        ensure_dev_certs(tmp_path)
    assert paths.server_cert.read_bytes() == old_cert
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(set(FILES) - {"server.key"})


# --- certificate contents ------------------------------------------------------------------


def test_ca_certificate(pki: DevCertPaths) -> None:
    ca = load_cert(pki.ca_cert)
    cn = ca.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    assert [a.value for a in cn] == ["quicsrv dev CA"]
    assert ca.issuer == ca.subject
    ca.verify_directly_issued_by(ca)  # self-signed

    bc = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca
    ku = ca.extensions.get_extension_for_class(x509.KeyUsage)
    assert ku.critical and ku.value.key_cert_sign and ku.value.crl_sign
    assert not ku.value.digital_signature
    ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)

    lifetime = ca.not_valid_after_utc - ca.not_valid_before_utc
    assert dt.timedelta(days=3640) < lifetime < dt.timedelta(days=3660)
    key = ca.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name == "secp256r1"
    assert load_key(pki.ca_key).public_key() == key


def test_server_certificate(pki: DevCertPaths) -> None:
    ca = load_cert(pki.ca_cert)
    server = load_cert(pki.server_cert)
    server.verify_directly_issued_by(ca)
    assert server.issuer == ca.subject

    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert set(san.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    }
    eku = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    bc = server.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and not bc.value.ca

    aki = server.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    ca_ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    assert aki.key_identifier == ca_ski.digest
    ski = server.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    assert ski == x509.SubjectKeyIdentifier.from_public_key(server.public_key())

    lifetime = server.not_valid_after_utc - server.not_valid_before_utc
    assert dt.timedelta(days=360) < lifetime < dt.timedelta(days=370)
    now = dt.datetime.now(dt.UTC)
    assert server.not_valid_before_utc <= now < server.not_valid_after_utc

    key = load_key(pki.server_key)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1"
    assert key.public_key() == server.public_key()
    assert server.public_key() != ca.public_key()


def test_describe_names_the_files_and_the_hosts(pki: DevCertPaths) -> None:
    text = describe(pki)
    for path in (pki.ca_cert, pki.server_cert, pki.server_key):
        assert str(path) in text
    for name in ("localhost", "127.0.0.1", "::1"):
        assert name in text


# --- reuse and renewal ---------------------------------------------------------------------


def test_a_second_call_rewrites_nothing(tmp_path: Path) -> None:
    first = ensure_dev_certs(tmp_path)
    before = snapshot(tmp_path)
    assert ensure_dev_certs(tmp_path) == first
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("missing", ["server.pem", "server.key"])
def test_a_missing_server_file_reissues_the_server_cert_only(tmp_path: Path, missing: str) -> None:
    paths = ensure_dev_certs(tmp_path)
    before = snapshot(tmp_path)
    (tmp_path / missing).unlink()
    ensure_dev_certs(tmp_path)
    after = snapshot(tmp_path)
    assert after["ca.pem"] == before["ca.pem"]
    assert after["ca.key"] == before["ca.key"]
    assert after["server.pem"][0] != before["server.pem"][0]
    assert after["server.key"][0] != before["server.key"][0]
    server = load_cert(paths.server_cert)
    server.verify_directly_issued_by(load_cert(paths.ca_cert))
    assert load_key(paths.server_key).public_key() == server.public_key()


@pytest.mark.parametrize("missing", ["ca.pem", "ca.key"])
def test_a_missing_ca_file_regenerates_everything(tmp_path: Path, missing: str) -> None:
    paths = ensure_dev_certs(tmp_path)
    before = snapshot(tmp_path)
    (tmp_path / missing).unlink()
    ensure_dev_certs(tmp_path)
    after = snapshot(tmp_path)
    assert all(after[name][0] != before[name][0] for name in FILES)
    load_cert(paths.server_cert).verify_directly_issued_by(load_cert(paths.ca_cert))


@pytest.mark.parametrize("damaged", ["server.pem", "server.key"])
def test_a_garbled_server_file_is_replaced(tmp_path: Path, damaged: str) -> None:
    paths = ensure_dev_certs(tmp_path)
    (tmp_path / damaged).write_bytes(b"-----BEGIN nonsense-----\n")
    ensure_dev_certs(tmp_path)
    server = load_cert(paths.server_cert)
    assert load_key(paths.server_key).public_key() == server.public_key()


def test_a_server_key_that_does_not_match_is_replaced(tmp_path: Path) -> None:
    paths = ensure_dev_certs(tmp_path)
    paths.server_key.write_bytes(paths.ca_key.read_bytes())  # a valid P-256 key, the wrong one
    ensure_dev_certs(tmp_path)
    assert load_key(paths.server_key).public_key() == load_cert(paths.server_cert).public_key()


def test_a_server_cert_from_another_ca_is_reissued(tmp_path: Path) -> None:
    mine = ensure_dev_certs(tmp_path / "mine")
    other = ensure_dev_certs(tmp_path / "other")
    for name in ("server.pem", "server.key"):
        (tmp_path / "mine" / name).write_bytes((tmp_path / "other" / name).read_bytes())
    ensure_dev_certs(tmp_path / "mine")
    server = load_cert(mine.server_cert)
    server.verify_directly_issued_by(load_cert(mine.ca_cert))
    assert server != load_cert(other.server_cert)


def test_an_expiring_server_cert_is_renewed_and_a_fresh_one_kept(tmp_path: Path) -> None:
    paths = ensure_dev_certs(tmp_path)
    server = load_cert(paths.server_cert)
    before = snapshot(tmp_path)

    ensure_dev_certs(tmp_path, now=server.not_valid_after_utc - dt.timedelta(days=2))
    assert snapshot(tmp_path) == before  # two days left: still good

    later = server.not_valid_after_utc - dt.timedelta(hours=12)
    ensure_dev_certs(tmp_path, now=later)
    renewed = load_cert(paths.server_cert)
    assert renewed.serial_number != server.serial_number
    assert renewed.not_valid_before_utc <= later < renewed.not_valid_after_utc
    assert paths.ca_cert.read_bytes() == before["ca.pem"][0]  # the CA has years left


def test_an_expired_ca_is_regenerated(tmp_path: Path) -> None:
    paths = ensure_dev_certs(tmp_path)
    ca = load_cert(paths.ca_cert)
    ensure_dev_certs(tmp_path, now=ca.not_valid_after_utc + dt.timedelta(days=1))
    assert load_cert(paths.ca_cert).serial_number != ca.serial_number


# --- real handshakes -----------------------------------------------------------------------


def recv_exactly(sock: ssl.SSLSocket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data


def tls_round_trip(paths: DevCertPaths, *, cafile: Path, server_hostname: str) -> dict[str, Any]:
    """One TLS connection over loopback TCP; returns what the client saw of the server."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(paths.server_cert, paths.server_key)
    client_ctx = ssl.create_default_context(cafile=str(cafile))
    server_failures: list[BaseException] = []

    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(10)

        def serve() -> None:
            try:
                conn, _ = listener.accept()
                conn.settimeout(10)
                with server_ctx.wrap_socket(conn, server_side=True) as tls:
                    tls.sendall(b"hello " + recv_exactly(tls, 6))
            except (OSError, ssl.SSLError) as exc:  # the client refusing us lands here
                server_failures.append(exc)

        thread = threading.Thread(target=serve)
        thread.start()
        try:
            with socket.create_connection(listener.getsockname(), timeout=10) as raw:
                with client_ctx.wrap_socket(raw, server_hostname=server_hostname) as tls:
                    tls.sendall(b"client")
                    reply = recv_exactly(tls, 12)
                    peer = tls.getpeercert()
                    version = tls.version()
        finally:
            thread.join(10)
    assert not thread.is_alive()
    assert server_failures == []
    return {"reply": reply, "peer": peer, "version": version}


@pytest.mark.parametrize("server_hostname", ["localhost", "127.0.0.1", "::1"])
def test_tls_handshake_verifies_against_the_ca(pki: DevCertPaths, server_hostname: str) -> None:
    seen = tls_round_trip(pki, cafile=pki.ca_cert, server_hostname=server_hostname)
    assert seen["reply"] == b"hello client"
    assert seen["version"] in {"TLSv1.2", "TLSv1.3"}
    assert ("DNS", "localhost") in seen["peer"]["subjectAltName"]


def test_tls_refuses_a_name_the_cert_does_not_cover(pki: DevCertPaths) -> None:
    with pytest.raises(ssl.SSLCertVerificationError, match="example.com"):
        tls_round_trip(pki, cafile=pki.ca_cert, server_hostname="example.com")


def test_tls_refuses_a_server_from_another_ca(pki: DevCertPaths, tmp_path: Path) -> None:
    stranger = ensure_dev_certs(tmp_path)
    with pytest.raises(ssl.SSLCertVerificationError):
        tls_round_trip(pki, cafile=stranger.ca_cert, server_hostname="localhost")


def quic_handshake(paths: DevCertPaths, *, server_name: str) -> Iterator[QuicEvent]:
    """A sans-I/O aioquic handshake (the stack quicsrv really uses); yields the client's events."""
    client_config = QuicConfiguration(is_client=True, alpn_protocols=["h3"])
    client_config.server_name = server_name
    client_config.load_verify_locations(cafile=str(paths.ca_cert))
    server_config = QuicConfiguration(is_client=False, alpn_protocols=["h3"])
    server_config.load_cert_chain(paths.server_cert, paths.server_key)

    client = QuicConnection(configuration=client_config)
    server = QuicConnection(
        configuration=server_config,
        original_destination_connection_id=client.original_destination_connection_id,
    )
    client_addr, server_addr = ("127.0.0.1", 50000), ("127.0.0.1", 4433)
    now = 1.0
    client.connect(server_addr, now=now)
    for _ in range(20):
        now += 0.01
        moved = 0
        for data, _addr in client.datagrams_to_send(now=now):
            server.receive_datagram(data, client_addr, now=now)
            moved += 1
        for data, _addr in server.datagrams_to_send(now=now):
            client.receive_datagram(data, server_addr, now=now)
            moved += 1
        while (event := client.next_event()) is not None:
            yield event
            if isinstance(event, HandshakeCompleted | ConnectionTerminated):
                return
        timer = client.get_timer()
        if not moved and timer is not None:
            # Nothing in flight: jump the clock to the client's next deadline (a closing
            # connection reports ConnectionTerminated only when its drain period ends).
            now = max(now, timer)
            client.handle_timer(now=now)
    raise AssertionError("the handshake neither completed nor failed")


def test_quic_handshake_with_aioquic(pki: DevCertPaths) -> None:
    events = list(quic_handshake(pki, server_name="localhost"))
    assert isinstance(events[-1], HandshakeCompleted)
    assert events[-1].alpn_protocol == "h3"


def test_quic_handshake_refuses_a_wrong_name(pki: DevCertPaths) -> None:
    events = list(quic_handshake(pki, server_name="example.com"))
    assert isinstance(events[-1], ConnectionTerminated)
    assert "example.com" in events[-1].reason_phrase
