"""API keys: who may use the server, and which key a request (and so a session) belongs to.

Keys are stored hashed (BLAKE3 of the key): a leaked keys file lets nobody in. A key is 32
random bytes, so a fast hash is enough; a presented key is hashed and compared with every known
hash in constant time, all of them, so the time taken says nothing about which one matched.

The keys file holds one ``<hash hex> [name] [rpm=N] [tpm=N]`` per line (``#`` starts a
comment) and is read again when it changes on disk (its mtime, size or inode), at most once per
``recheck_s``: adding or revoking a key, or changing its limits, needs no restart. ``rpm`` and
``tpm`` are the key's requests and generated tokens per minute (:mod:`quicsrv.rate_limits`;
0: none), in place of the server's defaults.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from blake3 import blake3

from .rate_limits import Quota, RateLimits, address_key

__all__ = ["AccessDenied", "ApiKeys", "ClientId", "KeyFileError", "hash_key", "key_id", "new_key"]

log = logging.getLogger(__name__)

KEY_PREFIX = "qs_"
_HASH_HEX_CHARS = 64
MAX_KEYS = 10_000
MAX_PRESENTED_KEY_CHARS = 512


class KeyFileError(ValueError):
    """The API keys file cannot be read or holds a malformed line."""


def new_key() -> str:
    """A fresh API key: 256 random bits, URL-safe."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    """What the keys file stores for ``key``."""
    return blake3(key.encode()).hexdigest()


def key_id(key_hash: str) -> str:
    """A short, non-secret name for a key (logs, session records, per-client limits)."""
    return "key:" + key_hash[:16]


class AccessDenied(Exception):
    """No API key, or one the server does not know: ``unauthorized`` (401)."""

    def __init__(self, message: str, *, presented: bool) -> None:
        super().__init__(message)
        self.message = message
        self.presented = presented
        """Whether a credential was given at all (a wrong key vs a missing one)."""


@dataclass(frozen=True, slots=True)
class ClientId:
    """Who a request belongs to: the unit of per-client limits and of session ownership."""

    name: str
    """The API key id (``key:...``), or the connection's name when the server has no keys."""
    key_id: str | None
    """The API key the request presented; None on an open server."""
    quota: Quota = field(default=Quota("", RateLimits()), compare=False)
    """Whose rate limits a new generation spends: the key's, or the source address's on an
    open server (more connections are not more budget)."""


@dataclass(frozen=True, slots=True)
class _KeyLimits:
    """A keys file line's own limits; None: the server's default."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def over(self, default: RateLimits) -> RateLimits:
        return RateLimits(
            requests_per_minute=_or(self.requests_per_minute, default.requests_per_minute),
            tokens_per_minute=_or(self.tokens_per_minute, default.tokens_per_minute),
        )


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


_NO_LIMITS = _KeyLimits()
_NO_RATE_LIMITS = RateLimits()


@dataclass(frozen=True, slots=True)
class _FileState:
    mtime_ns: int
    size: int
    inode: int


class ApiKeys:
    """The keys the server accepts: plain keys given at start plus a hashed keys file."""

    def __init__(
        self,
        keys: Iterable[str] = (),
        *,
        keys_file: Path | None = None,
        recheck_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        rate_limits: RateLimits = _NO_RATE_LIMITS,
    ) -> None:
        self.rate_limits = rate_limits
        """Every client's limits, unless its line in the keys file says otherwise."""
        self._fixed = tuple(bytes.fromhex(hash_key(k)) for k in keys if k)
        self._file = keys_file
        self._recheck_s = recheck_s
        self._clock = clock
        self._file_hashes: tuple[bytes, ...] = ()
        self._file_limits: dict[bytes, _KeyLimits] = {}
        self._file_state: _FileState | None = None
        self._checked_at = float("-inf")
        if keys_file is not None:
            self._reload(force=True)

    @property
    def enabled(self) -> bool:
        """False: no key configured, the server is open to anyone who reaches it."""
        return bool(self._fixed) or self._file is not None

    def __len__(self) -> int:
        self._maybe_reload()
        return len(self._fixed) + len(self._file_hashes)

    def authorize(
        self, authorization: bytes | None, *, connection: str, address: str = ""
    ) -> ClientId:
        """Who sends a request with this ``authorization`` header value over ``connection``
        (a name for the peer's connection, used as the client on an open server) from
        ``address`` (the peer's IP address: an open server's rate limits are per address).

        Raises AccessDenied when keys are configured and the header holds none of them. Any
        front end (QUIC, HTTP) calls this, so one key means one client everywhere.
        """
        if not self.enabled:
            quota = Quota(address_key(address or connection), self.rate_limits)
            return ClientId(name=connection, key_id=None, quota=quota)
        matched = self._match(authorization)
        if matched is None:
            if authorization is None:
                raise AccessDenied(
                    "an API key is required (authorization: Bearer <key>)", presented=False
                )
            raise AccessDenied("the API key is not valid", presented=True)
        found = key_id(matched.hex())
        limits = self._file_limits.get(matched, _NO_LIMITS).over(self.rate_limits)
        return ClientId(name=found, key_id=found, quota=Quota(found, limits))

    def identify(self, authorization: bytes | None) -> str | None:
        """The key id of a valid ``Bearer`` credential, else None (constant time per key)."""
        matched = self._match(authorization)
        return None if matched is None else key_id(matched.hex())

    def _match(self, authorization: bytes | None) -> bytes | None:
        """The known hash a valid ``Bearer`` credential matches (constant time per key)."""
        if authorization is None:
            return None
        scheme, _, credential = authorization.partition(b" ")
        credential = credential.strip()
        if scheme.lower() != b"bearer" or not credential:
            return None
        if len(credential) > MAX_PRESENTED_KEY_CHARS:
            return None
        try:
            presented = bytes.fromhex(hash_key(credential.decode("ascii")))
        except UnicodeDecodeError:
            return None
        self._maybe_reload()
        matched: bytes | None = None
        for known in (*self._fixed, *self._file_hashes):
            # Every known hash is compared, whatever matched earlier.
            if hmac.compare_digest(presented, known):
                matched = known
        return matched

    def _maybe_reload(self) -> None:
        if self._file is None:
            return
        now = self._clock()
        if now - self._checked_at < self._recheck_s:
            return
        self._checked_at = now
        try:
            self._reload(force=False)
        except KeyFileError as exc:
            # A half-written or broken file must not lock everyone out: keep the last good keys.
            log.error("API keys file %s not reloaded, the previous keys stay: %s", self._file, exc)

    def _reload(self, *, force: bool) -> None:
        assert self._file is not None
        try:
            st = os.stat(self._file)
        except OSError as exc:
            raise KeyFileError(f"cannot read {self._file}: {exc.strerror}") from None
        state = _FileState(st.st_mtime_ns, st.st_size, st.st_ino)
        if not force and state == self._file_state:
            return
        try:
            text = self._file.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise KeyFileError(f"cannot read {self._file}: {exc}") from None
        limits = _parse_keys_file(text, self._file)
        self._file_hashes = tuple(limits)
        self._file_limits = {h: v for h, v in limits.items() if v != _NO_LIMITS}
        self._file_state = state
        log.info("API keys: %d from %s", len(limits), self._file)


#: A keys file line's settings, after the hash and the optional name.
_LIMIT_WORDS = {"rpm": "requests_per_minute", "tpm": "tokens_per_minute"}


def _parse_keys_file(text: str, path: Path) -> dict[bytes, _KeyLimits]:
    """Each key's hash and its own limits, in the file's order."""
    keys: dict[bytes, _KeyLimits] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        digest, *words = line.split()
        digest = digest.lower()
        if len(digest) != _HASH_HEX_CHARS or any(c not in "0123456789abcdef" for c in digest):
            raise KeyFileError(
                f"{path}:{number}: expected a {_HASH_HEX_CHARS}-hex-digit key hash "
                "(`quicsrv api-key hash KEY` prints one), not a plain key"
            )
        keys[bytes.fromhex(digest)] = _parse_limits(words, f"{path}:{number}")
        if len(keys) > MAX_KEYS:
            raise KeyFileError(f"{path}: more than {MAX_KEYS} keys")
    return keys


def _parse_limits(words: list[str], where: str) -> _KeyLimits:
    """``rpm=N`` and ``tpm=N`` among a line's words (the others are its name)."""
    values: dict[str, int] = {}
    for word in words:
        name, eq, value = word.partition("=")
        if not eq:
            continue  # a word of the key's name
        field = _LIMIT_WORDS.get(name)
        if field is None:
            raise KeyFileError(f"{where}: unknown setting {name!r} (rpm=N, tpm=N)")
        if not value.isdigit():
            raise KeyFileError(f"{where}: {name}={value!r} is not a whole number (0: none)")
        values[field] = int(value)
    return _KeyLimits(**values)
