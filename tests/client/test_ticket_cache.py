"""The client's ticket cache file: 0600, atomic, bounded, and sceptical of what it reads."""

from __future__ import annotations

import datetime
import json
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from aioquic.tls import CipherSuite, SessionTicket

from quicsrv_client._tickets import TicketCache, default_ticket_cache_path, ticket_cache_key

KEY = ticket_cache_key("127.0.0.1", 4433, "localhost")


def _ticket(
    label: bytes = b"label", *, issued_ago_s: float = 0.0, lifetime_s: float = 86400.0
) -> SessionTicket:
    issued = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=issued_ago_s)
    return SessionTicket(
        age_add=0xDEADBEEF,
        cipher_suite=CipherSuite.CHACHA20_POLY1305_SHA256,
        not_valid_after=issued + datetime.timedelta(seconds=lifetime_s),
        not_valid_before=issued,
        resumption_secret=bytes(range(32)),
        server_name="localhost",
        ticket=label,
        max_early_data_size=0xFFFFFFFF,
        other_extensions=[(0x39, b"\x01\x02transport parameters")],
    )


@pytest.fixture
def permissive_umask() -> Iterator[None]:
    """The file must come out 0600 whatever the umask lets through."""
    previous = os.umask(0)
    try:
        yield
    finally:
        os.umask(previous)


def test_round_trip_through_the_file(tmp_path: Path) -> None:
    path = tmp_path / "tickets.json"
    ticket = _ticket()
    TicketCache(path).put(KEY, ticket)
    assert TicketCache(path).get(KEY) == ticket
    assert TicketCache(path).get(ticket_cache_key("127.0.0.1", 4434, "localhost")) is None


def test_file_is_created_0600(tmp_path: Path, permissive_umask: None) -> None:
    path = tmp_path / "new" / "dir" / "tickets.json"
    TicketCache(path).put(KEY, _ticket())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    # Rewrites replace the file atomically and leave no temporary files behind.
    TicketCache(path).put(KEY, _ticket(b"second"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == ["tickets.json"]


def test_put_replaces_and_pop_takes(tmp_path: Path) -> None:
    cache = TicketCache(tmp_path / "tickets.json")
    cache.put(KEY, _ticket(b"first"))
    cache.put(KEY, _ticket(b"second"))
    assert len(cache) == 1
    taken = cache.pop(KEY)
    assert taken is not None and taken.ticket == b"second"
    assert cache.pop(KEY) is None
    assert TicketCache(cache.path).get(KEY) is None


def test_expired_tickets_are_dropped(tmp_path: Path) -> None:
    cache = TicketCache(tmp_path / "tickets.json")
    cache.put(KEY, _ticket(issued_ago_s=100.0, lifetime_s=50.0))
    cache.put("other", _ticket())
    assert cache.get(KEY) is None
    assert len(cache) == 1


def test_entries_are_bounded_keeping_the_newest(tmp_path: Path) -> None:
    cache = TicketCache(tmp_path / "tickets.json", max_entries=3)
    for age in (50, 40, 30, 20, 10):
        cache.put(f"server-{age}", _ticket(issued_ago_s=age))
    assert len(cache) == 3
    kept = [cache.get(f"server-{age}") is not None for age in (50, 40, 30, 20, 10)]
    assert kept == [False, False, True, True, True]


@pytest.mark.parametrize(
    "content",
    [
        b"\x80\x81 not even utf-8",
        b"{ truncated",
        b'["a list"]',
        b'{"version": 99, "tickets": {}}',
        b'{"version": 1, "tickets": {"k": {"age_add": "one"}}}',
    ],
    ids=["binary", "bad-json", "not-an-object", "unknown-version", "bad-field"],
)
def test_a_corrupt_file_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes
) -> None:
    path = tmp_path / "tickets.json"
    path.write_bytes(content)
    path.chmod(0o600)
    cache = TicketCache(path)
    with caplog.at_level(logging.WARNING, logger="quicsrv_client.tickets"):
        assert cache.get(KEY) is None
    assert f"ignoring corrupt ticket cache {path}" in caplog.text
    # The next ticket simply replaces the corrupt file.
    cache.put(KEY, _ticket())
    assert TicketCache(path).get(KEY) is not None


def test_a_field_of_the_wrong_type_makes_the_file_corrupt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tickets.json"
    cache = TicketCache(path)
    cache.put(KEY, _ticket())
    document = json.loads(path.read_text())
    document["tickets"][KEY]["max_early_data_size"] = True
    path.write_text(json.dumps(document))
    with caplog.at_level(logging.WARNING, logger="quicsrv_client.tickets"):
        assert cache.get(KEY) is None
    assert "max_early" in caplog.text


def test_a_file_others_can_read_is_not_trusted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tickets.json"
    cache = TicketCache(path)
    cache.put(KEY, _ticket())
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="quicsrv_client.tickets"):
        assert cache.get(KEY) is None
    assert "mode 644" in caplog.text


def test_a_write_failure_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache = TicketCache(blocker / "tickets.json")  # its parent is a file: nothing can be made
    with caplog.at_level(logging.WARNING, logger="quicsrv_client.tickets"):
        cache.put(KEY, _ticket())
    assert "cannot write ticket cache" in caplog.text


def test_key_and_default_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert ticket_cache_key("::1", 4433, "localhost") == "[::1]:4433 localhost"
    assert ticket_cache_key("example.org", 443, "example.org") == "example.org:443 example.org"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_ticket_cache_path() == tmp_path / "quicsrv" / "tickets.json"
