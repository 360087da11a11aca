"""A throwaway CA and a server certificate for one IP address (the benchmark's veth address).

The dev certificates (``quicsrv certs``) name localhost, 127.0.0.1 and ::1 only, and the client
verifies the name it connects to (``server_name`` is the host it is given), so a server reached
at 10.200.0.1 needs a certificate naming that address. Verification stays on.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["BenchCerts", "issue_certs"]

_LIFETIME = dt.timedelta(days=2)
_BACKDATE = dt.timedelta(hours=1)


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchCerts:
    """Where the benchmark's PKI was written."""

    ca_cert: Path
    """The CA certificate the client verifies against."""
    server_cert: Path
    """The server certificate, naming the server's address."""
    server_key: Path
    """The server's private key (mode 0600)."""


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + _LIFETIME)
    )


def issue_certs(directory: Path, address: str, *more: str) -> BenchCerts:
    """Write ``ca.pem``, ``server.pem`` and ``server.key`` (for ``address`` and any ``more``
    addresses: one certificate for several nodes) into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "quicsrv netns bench CA")])
    ca_cert = (
        _builder(ca_name, ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, address)])
    san = x509.SubjectAlternativeName(
        [x509.IPAddress(ipaddress.ip_address(a)) for a in (address, *more)]
    )
    cert = (
        _builder(name, ca_name, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(san, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = BenchCerts(
        ca_cert=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server.key",
    )
    paths.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    paths.server_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(paths.server_key, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return paths
