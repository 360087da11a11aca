"""API keys: hashed at rest, Bearer parsing, several keys, the keys file reread on change."""

from __future__ import annotations

from pathlib import Path

import pytest

from quicsrv.apikeys import (
    AccessDenied,
    ApiKeys,
    ClientId,
    KeyFileError,
    hash_key,
    key_id,
    new_key,
)
from quicsrv.cli import main
from quicsrv.rate_limits import Quota, RateLimits


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_no_key_configured_means_open():
    assert not ApiKeys().enabled
    assert ApiKeys().identify(b"Bearer anything") is None


def test_a_plain_key_is_accepted_only_as_a_bearer_credential():
    key = new_key()
    keys = ApiKeys([key])
    assert keys.enabled
    assert keys.identify(f"Bearer {key}".encode()) == key_id(hash_key(key))
    assert keys.identify(f"bearer  {key} ".encode()) == key_id(hash_key(key))
    for bad in (None, b"", key.encode(), f"Basic {key}".encode(), b"Bearer ", b"Bearer x"):
        assert keys.identify(bad) is None
    assert keys.identify(b"Bearer " + b"\xff" * 8) is None
    assert keys.identify(b"Bearer " + b"a" * 100_000) is None


def test_authorize_names_the_client_by_key_or_by_connection():
    assert ApiKeys().authorize(None, connection="conn:7") == ClientId("conn:7", None)
    key = new_key()
    keys = ApiKeys([key])
    expected = key_id(hash_key(key))
    # With keys, the key is the client, whichever connection it comes over.
    for connection in ("conn:1", "conn:2"):
        assert keys.authorize(f"Bearer {key}".encode(), connection=connection) == ClientId(
            expected, expected
        )
    with pytest.raises(AccessDenied, match="required") as missing:
        keys.authorize(None, connection="conn:1")
    assert not missing.value.presented
    with pytest.raises(AccessDenied, match="not valid") as wrong:
        keys.authorize(b"Bearer qs_wrong", connection="conn:1")
    assert wrong.value.presented


def test_the_keys_file_holds_hashes_and_is_reread_when_it_changes(tmp_path: Path):
    first, second = new_key(), new_key()
    path = tmp_path / "keys"
    path.write_text(f"# team keys\n{hash_key(first)} alice\n\n")
    clock = _Clock()
    keys = ApiKeys(keys_file=path, clock=clock)
    assert first not in path.read_text()  # only the hash is at rest
    assert keys.identify(f"Bearer {first}".encode()) is not None
    assert keys.identify(f"Bearer {second}".encode()) is None
    # Revoke the first key, add the second: picked up without a restart.
    path.write_text(f"{hash_key(second)} bob  # added later\n")
    clock.now += 5.0
    assert keys.identify(f"Bearer {first}".encode()) is None
    assert keys.identify(f"Bearer {second}".encode()) == key_id(hash_key(second))
    assert len(keys) == 1


def test_a_broken_keys_file_keeps_the_previous_keys(tmp_path: Path):
    key = new_key()
    path = tmp_path / "keys"
    path.write_text(hash_key(key) + "\n")
    clock = _Clock()
    keys = ApiKeys(keys_file=path, clock=clock)
    path.write_text(key + "\n")  # someone pasted the plain key instead of its hash
    clock.now += 5.0
    assert keys.identify(f"Bearer {key}".encode()) is not None


def test_a_broken_keys_file_at_start_is_an_error(tmp_path: Path):
    path = tmp_path / "keys"
    path.write_text("not-a-hash\n")
    with pytest.raises(KeyFileError, match="keys:1"):
        ApiKeys(keys_file=path)
    with pytest.raises(KeyFileError, match="cannot read"):
        ApiKeys(keys_file=tmp_path / "missing")


def test_the_cli_makes_a_key_and_appends_its_hash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    path = tmp_path / "keys"
    assert main(["api-key", "new", "--name", "ci", "--append", str(path)]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("qs_")
    assert path.read_text() == f"{hash_key(key)} ci\n"
    assert path.stat().st_mode & 0o777 == 0o600
    assert ApiKeys(keys_file=path).identify(f"Bearer {key}".encode()) is not None
    assert main(["api-key", "hash", key]) == 0
    assert capsys.readouterr().out.strip() == hash_key(key)


def test_a_keys_file_line_may_set_its_keys_rate_limits(tmp_path: Path):
    limited, unlimited, default = new_key(), new_key(), new_key()
    path = tmp_path / "keys"
    path.write_text(
        f"{hash_key(limited)} alice rpm=30 tpm=5000\n"
        f"{hash_key(unlimited)} rpm=0  # no request limit, the default token limit\n"
        f"{hash_key(default)} carol\n"
    )
    keys = ApiKeys(
        keys_file=path, rate_limits=RateLimits(requests_per_minute=10, tokens_per_minute=99)
    )

    def quota(key: str) -> Quota:
        return keys.authorize(f"Bearer {key}".encode(), connection="conn:1").quota

    assert quota(limited) == Quota(
        key_id(hash_key(limited)), RateLimits(requests_per_minute=30, tokens_per_minute=5000)
    )
    assert quota(unlimited).limits == RateLimits(requests_per_minute=0, tokens_per_minute=99)
    assert quota(default).limits == RateLimits(requests_per_minute=10, tokens_per_minute=99)


@pytest.mark.parametrize(
    ("words", "error"),
    [
        ("rpm=ten", "not a whole number"),
        ("rpm=-1", "not a whole number"),
        ("qpm=3", "unknown setting 'qpm'"),
    ],
)
def test_a_bad_limit_in_the_keys_file_names_its_line(tmp_path: Path, words: str, error: str):
    path = tmp_path / "keys"
    path.write_text(f"# keys\n{hash_key(new_key())} alice {words}\n")
    with pytest.raises(KeyFileError, match=f"keys:2: .*{error}"):
        ApiKeys(keys_file=path)


def test_an_open_servers_quota_is_the_peers_address_not_its_connection():
    limits = RateLimits(requests_per_minute=5)
    keys = ApiKeys(rate_limits=limits)
    one = keys.authorize(None, connection="conn:1", address="192.0.2.7")
    other = keys.authorize(None, connection="conn:2", address="::ffff:192.0.2.7")
    assert one.name != other.name  # fair shares stay per connection...
    assert one.quota == other.quota == Quota("addr:192.0.2.7", limits)  # ...budgets per address
