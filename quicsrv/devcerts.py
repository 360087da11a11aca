"""A local development PKI: one CA and one server certificate for localhost.

QUIC has no plaintext mode, so even a laptop run needs a certificate the client can verify.
:func:`ensure_dev_certs` keeps a directory (``certs/`` by default, see ``certs/README.md``)
holding::

    ca.pem      the CA certificate; clients trust it (``quicsrv-client --ca certs/ca.pem``)
    ca.key      the CA private key, kept so the server certificate can be re-issued
    server.pem  the server certificate: localhost, 127.0.0.1 and ::1
    server.key  the server private key

Private keys are created with mode 0600 and every file is replaced atomically, so neither a
concurrent reader nor a crash ever sees a half-written or world-readable key. This is for
development only: the CA key sits unencrypted next to the certificates it signs.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "CA_COMMON_NAME",
    "CA_LIFETIME",
    "RENEW_BEFORE",
    "SERVER_LIFETIME",
    "SERVER_NAMES",
    "DevCertPaths",
    "describe",
    "ensure_dev_certs",
]

CA_COMMON_NAME = "quicsrv dev CA"
CA_LIFETIME = dt.timedelta(days=3650)
SERVER_LIFETIME = dt.timedelta(days=365)
#: A certificate expiring sooner than this is replaced rather than reused.
RENEW_BEFORE = dt.timedelta(days=1)
#: Backdating absorbs clock skew between the machine that issues and the one that verifies.
_BACKDATE = dt.timedelta(hours=1)
SERVER_NAMES: tuple[str, ...] = ("localhost", "127.0.0.1", "::1")

_KEY_MODE = 0o600
_CERT_MODE = 0o644


@dataclass(frozen=True, slots=True, kw_only=True)
class DevCertPaths:
    """Where the development PKI lives."""

    ca_cert: Path
    """The CA certificate (PEM) that clients verify the server against."""
    server_cert: Path
    """The server certificate (PEM), signed by the CA."""
    server_key: Path
    """The server's private key (PEM, PKCS#8, unencrypted, mode 0600)."""

    @property
    def ca_key(self) -> Path:
        """The CA's private key (mode 0600), next to its certificate."""
        return self.ca_cert.with_name("ca.key")


def ensure_dev_certs(directory: Path, *, now: dt.datetime | None = None) -> DevCertPaths:
    """Make sure ``directory`` holds a usable dev CA and server certificate; return their paths.

    Files already there are reused as they are. The CA (both files) is regenerated if either is
    missing, unreadable, mismatched or about to expire; the server certificate and key are
    re-issued from the CA if either is missing, unreadable, not issued by that CA, or expiring
    within :data:`RENEW_BEFORE`. ``now`` (timezone-aware) defaults to the current time.
    """
    now = dt.datetime.now(dt.UTC) if now is None else now.astimezone(dt.UTC)
    directory.mkdir(parents=True, exist_ok=True)
    paths = DevCertPaths(
        ca_cert=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server.key",
    )
    ca = _load_pair(paths.ca_cert, paths.ca_key, now)
    if ca is None:
        ca = _issue_ca(now)
        _write_key(paths.ca_key, ca[1])
        _write_cert(paths.ca_cert, ca[0])
    ca_cert, ca_key = ca

    server = _load_pair(paths.server_cert, paths.server_key, now)
    if server is None or not _issued_by(server[0], ca_cert):
        cert, key = _issue_server(ca_cert, ca_key, now)
        # Key first: a server starting in between would fail on the mismatch and be retried,
        # rather than run with a key that the new certificate does not name.
        _write_key(paths.server_key, key)
        _write_cert(paths.server_cert, cert)
    return paths


def describe(paths: DevCertPaths) -> str:
    """A few lines for the CLI: where the files are and what the server certificate covers."""
    ca = x509.load_pem_x509_certificate(paths.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(paths.server_cert.read_bytes())
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = [*san.get_values_for_type(x509.DNSName)]
    names += [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]
    fingerprint = ca.fingerprint(hashes.SHA256()).hex(":")
    return "\n".join(
        [
            f"CA certificate:     {paths.ca_cert}  (trust this one in clients)",
            f"  SHA-256:          {fingerprint}",
            f"  valid until:      {ca.not_valid_after_utc:%Y-%m-%d}",
            f"server certificate: {paths.server_cert}",
            f"server key:         {paths.server_key}",
            f"  names:            {', '.join(names)}",
            f"  valid until:      {server.not_valid_after_utc:%Y-%m-%d}",
            f"  SPKI SHA-256:     {spki_hash(paths.server_cert)}  (Chrome over HTTP/3: "
            "--ignore-certificate-errors-spki-list=<this>)",
        ]
    )


def spki_hash(cert_path: Path) -> str:
    """Base64 of the SHA-256 of the certificate's public key (its DER SubjectPublicKeyInfo):
    what Chromium's ``--ignore-certificate-errors-spki-list`` takes. Chromium speaks QUIC to a
    server whose certificate chains to a locally installed root only when told this."""
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    spki = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    digest = hashes.Hash(hashes.SHA256())
    digest.update(spki)
    return base64.b64encode(digest.finalize()).decode("ascii")


# --- issuing ------------------------------------------------------------------------------


def _issue_ca(now: dt.datetime) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_COMMON_NAME)])
    cert = (
        _base_builder(now, CA_LIFETIME)
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(key_cert_sign=True, crl_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _issue_server(
    ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, now: dt.datetime
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    san = x509.SubjectAlternativeName(
        [x509.DNSName("localhost")]
        + [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", "::1")]
    )
    cert = (
        _base_builder(now, SERVER_LIFETIME)
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(digital_signature=True), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(san, critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def _base_builder(now: dt.datetime, lifetime: dt.timedelta) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + lifetime)
    )


def _key_usage(
    *, digital_signature: bool = False, key_cert_sign: bool = False, crl_sign: bool = False
) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=digital_signature,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=key_cert_sign,
        crl_sign=crl_sign,
        encipher_only=False,
        decipher_only=False,
    )


# --- loading and checking -----------------------------------------------------------------


def _load_pair(
    cert_path: Path, key_path: Path, now: dt.datetime
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None:
    """The certificate and its key, or None if either is unusable and must be replaced."""
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError):
        return None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != "secp256r1":
        return None
    if cert.public_key() != key.public_key():
        return None
    if not cert.not_valid_before_utc <= now < cert.not_valid_after_utc - RENEW_BEFORE:
        return None
    return cert, key


def _issued_by(cert: x509.Certificate, ca_cert: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (InvalidSignature, ValueError, TypeError):  # bad signature / names or key type differ
        return False
    return True


# --- writing ------------------------------------------------------------------------------


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    _write_atomically(path, pem, _KEY_MODE)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    _write_atomically(path, cert.public_bytes(serialization.Encoding.PEM), _CERT_MODE)


def _write_atomically(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same directory and a rename.

    The temporary file is created with ``mode`` (O_EXCL: never an existing file or a symlink
    someone planted), so a key is never readable by others, not even before the rename.
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)
    try:
        try:
            os.fchmod(fd, mode)  # the umask may have taken bits off a certificate's 0644
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
