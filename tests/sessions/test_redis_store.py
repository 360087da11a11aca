"""The Redis backends against a real redis-server: records and token logs, leases and
takeover, the shared keyring, single-use tickets (no model, no QUIC)."""

from __future__ import annotations

import asyncio
import datetime
import threading
import time

import pytest

from quicsrv.sessions.keys import SharedKeyRing
from quicsrv.sessions.record import SessionEnd, SessionRecord
from quicsrv.sessions.store import AppendOutcome, StoreUnavailable
from quicsrv_proto import EndReason
from tests.sessions.test_store import _record

redis = pytest.importorskip("redis")

from aioquic.tls import CipherSuite, SessionTicket  # noqa: E402

from quicsrv.sessions.redis_store import RedisSessionStore, connect, connect_async  # noqa: E402
from quicsrv.transport.redis_tickets import RedisTicketStore  # noqa: E402


class _Appended:
    """Collects the store's per-batch verdicts; ``wait`` until one for ``record`` came."""

    def __init__(self) -> None:
        self.seen: list[tuple[SessionRecord, str | None]] = []
        self._changed = asyncio.Event()

    def __call__(self, record: SessionRecord, outcome: AppendOutcome, problem: str) -> None:
        # None when durable, else the outcome's name ("taken", "failed").
        self.seen.append((record, None if outcome is AppendOutcome.DURABLE else outcome.value))
        self._changed.set()

    async def wait(self, record: SessionRecord, count: int = 1) -> list[str | None]:
        async with asyncio.timeout(10):
            while sum(1 for r, _ in self.seen if r is record) < count:
                self._changed.clear()
                await self._changed.wait()
        return [p for r, p in self.seen if r is record]


def _store(url: str, owner: str, *, lease_s: float = 30.0) -> RedisSessionStore:
    return RedisSessionStore(
        connect(url),
        reader=connect_async(url),
        owner_id=owner,
        lease_s=lease_s,
        ttl_s=60.0,
        max_sessions=100,
        max_disk_bytes=1 << 20,
        clock=time.time,
    )


@pytest.mark.asyncio
async def test_another_process_reads_the_record_and_its_durable_tokens(redis_url):
    a, b = _store(redis_url, "a"), _store(redis_url, "b")
    appended = _Appended()
    a.on_appended = appended
    record = _record(b"s" * 16, expires=time.time() + 60)
    a.add(record)
    for token in (11, 12, 13):
        a.append_token(record, token)
    # Nothing may be sent before Redis confirmed it.
    assert a.durable_tokens(record) < 3
    await appended.wait(record)
    await asyncio.wrap_future(a.flush())
    assert a.durable_tokens(record) == 3
    record.end = SessionEnd(EndReason.LENGTH, 3)
    await asyncio.wrap_future(a.save(record))

    fetched = await b.fetch(record.session_id)
    assert fetched is not None and fetched.owner == "a"
    assert list(fetched.record.generated) == [11, 12, 13]
    assert fetched.record.end == SessionEnd(EndReason.LENGTH, 3)
    assert fetched.record.snapshot() == record.snapshot()
    # Everything expires with the session (Redis's own clock is the wall clock).
    client = connect(redis_url)
    ttls = [client.pttl(k) for k in client.keys(f"quicsrv:s:{record.session_id.hex()}:*")]
    assert len(ttls) == 3 and all(t > 0 for t in ttls)
    for store in (a, b):
        await store.aclose()


@pytest.mark.asyncio
async def test_a_takeover_stops_the_old_owner_writing(redis_url):
    a, b = _store(redis_url, "a"), _store(redis_url, "b")
    appended = _Appended()
    a.on_appended = appended
    record = _record(b"t" * 16, expires=time.time() + 60)
    a.add(record)
    a.append_token(record, 1)
    assert await appended.wait(record) == [None]

    claimed = await b.claim(record.session_id)
    assert claimed is not None and claimed.owner == "a"  # who held it until now
    assert list(claimed.record.generated) == [1]

    a.append_token(record, 2)  # the old owner still decodes: refused, and told so
    assert await appended.wait(record, 2) == [None, "taken"]
    again = await b.fetch(record.session_id)
    assert again is not None and again.owner == "b"
    assert list(again.record.generated) == [1]
    for store in (a, b):
        await store.aclose()


@pytest.mark.asyncio
async def test_an_expired_lease_is_simply_taken(redis_url):
    a, b = _store(redis_url, "a", lease_s=0.001), _store(redis_url, "b")
    record = _record(b"u" * 16, expires=time.time() + 60)
    a.add(record)
    await asyncio.wrap_future(a.flush())
    client = connect(redis_url)
    lease = f"quicsrv:s:{record.session_id.hex()}:lease"
    client.delete(lease)  # what PX does once the owner stopped writing (a kill -9)
    claimed = await b.claim(record.session_id)
    assert claimed is not None and claimed.owner == ""
    assert client.get(lease) == b"b"
    for store in (a, b):
        await store.aclose()


@pytest.mark.asyncio
async def test_claiming_an_unknown_session_finds_nothing(redis_url):
    b = _store(redis_url, "b")
    assert await b.claim(b"x" * 16) is None
    assert await b.fetch(b"x" * 16) is None
    await b.aclose()


def test_the_keyring_is_shared_and_rotations_reach_every_process(redis_url):
    one = SharedKeyRing(connect(redis_url), "quicsrv:mac-keys", previous_key_ttl_s=60.0)
    two = SharedKeyRing(connect(redis_url), "quicsrv:mac-keys", previous_key_ttl_s=60.0)
    assert one.current == two.current  # the second start found the first one's keys
    old = one.current
    one.rotate_shared(now_s=1000.0)
    assert one.current != old
    two.refresh()
    assert two.current == one.current
    assert old in two.verifying_keys(now_s=1010.0)  # older checkpoints still verify
    assert old not in two.verifying_keys(now_s=1100.0)


def _ticket(label: bytes) -> SessionTicket:
    now = datetime.datetime.now(datetime.UTC)
    return SessionTicket(
        age_add=7,
        cipher_suite=CipherSuite.AES_128_GCM_SHA256,
        not_valid_after=now + datetime.timedelta(days=1),
        not_valid_before=now,
        resumption_secret=b"r" * 32,
        server_name="localhost",
        ticket=label,
        max_early_data_size=0xFFFFFFFF,
        other_extensions=[(42, b"x")],
    )


def test_a_ticket_is_taken_once_whichever_process_asks(redis_url):
    issuer = RedisTicketStore(connect(redis_url), ttl_s=60.0)
    ticket = _ticket(b"label-1")
    issuer.add(ticket)
    # Eight "processes" (clients of their own) present the same label at once.
    stores = [RedisTicketStore(connect(redis_url), ttl_s=60.0) for _ in range(8)]
    got: list[SessionTicket | None] = []
    start = threading.Barrier(len(stores))

    def present(store: RedisTicketStore) -> None:
        start.wait()
        got.append(store.pop(b"label-1"))

    threads = [threading.Thread(target=present, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [t for t in got if t is not None]
    assert len(won) == 1
    assert won[0] == ticket
    assert issuer.pop(b"label-1") is None


def test_a_ticket_expires_and_garbage_is_refused(redis_url):
    client = connect(redis_url)
    store = RedisTicketStore(client, ttl_s=60.0)
    store.add(_ticket(b"label-2"))
    assert 0 < client.pttl(f"quicsrv:t:{b'label-2'.hex()}") <= 60_000
    client.set(f"quicsrv:t:{b'bad'.hex()}", b"\xff\x00")
    assert store.pop(b"bad") is None


def test_an_unreachable_redis_costs_a_ticket_not_the_handshake(tmp_path):
    client = redis.Redis(unix_socket_path=str(tmp_path / "none.sock"), retry=None)
    store = RedisTicketStore(client)
    store.add(_ticket(b"label-3"))  # logged, not raised
    assert store.pop(b"label-3") is None


@pytest.mark.asyncio
async def test_an_unreachable_redis_counts_each_failed_operation(tmp_path):
    """What quicsrv_store_failures_total (the store-unreachable alert) counts."""
    store = RedisSessionStore(
        redis.Redis(unix_socket_path=str(tmp_path / "none.sock"), retry=None),
        owner_id="a",
        lease_s=30.0,
        ttl_s=60.0,
        max_sessions=100,
        max_disk_bytes=1 << 20,
        clock=time.time,
    )
    appended = _Appended()
    store.on_appended = appended
    record = _record(b"u" * 16, expires=time.time() + 60)
    assert store.usage().failures == 0
    store.add(record)  # its record's save fails
    await asyncio.wrap_future(store.flush())
    assert store.usage().failures == 1
    store.append_token(record, 11)  # the token's append fails
    assert await appended.wait(record) == ["failed"]
    assert store.usage().failures == 2
    with pytest.raises(StoreUnavailable):  # and a read
        await store.fetch(b"v" * 16)
    assert store.usage().failures == 3
    store.close()


def test_quicsrv_keys_rotate_rotates_the_shared_keyring(redis_url, capsys):
    from quicsrv.cli import main

    ring = SharedKeyRing(connect(redis_url), "quicsrv:mac-keys", previous_key_ttl_s=60.0)
    old = ring.current
    assert main(["keys", "rotate", "--store", redis_url]) == 0
    ring.refresh()
    assert ring.current != old and old in ring.verifying_keys(now_s=time.time())
    assert "rotated the keyring" in capsys.readouterr().out


def _kv(tmp_path, redis_url, name: str, *, shared_dir=None, redis_max_bytes=1 << 20):
    from quicsrv.sessions.kvstore import KVStore
    from quicsrv.sessions.shared_kv import SharedKV

    shared = SharedKV(
        connect(redis_url), redis_max_bytes=redis_max_bytes, shared_dir=shared_dir, ttl_s=60.0
    )
    return KVStore(
        tmp_path / name, memory_budget_bytes=1 << 20, disk_budget_bytes=1 << 20, shared=shared
    )


@pytest.mark.parametrize("where", ["redis", "directory"])
def test_a_paused_blob_reaches_another_process(tmp_path, redis_url, where):
    big = where == "directory"
    options = dict(shared_dir=tmp_path / "shared", redis_max_bytes=100 if big else 1 << 20)
    a, b = _kv(tmp_path, redis_url, "a", **options), _kv(tmp_path, redis_url, "b", **options)
    blob = bytes(range(256)) * 4
    a.put(b"s" * 16, 7, blob)
    a.flush().result(timeout=10)
    assert (tmp_path / "shared" / f"{(b's' * 16).hex()}.kv").exists() is big
    assert not b.has(b"s" * 16, 7)
    assert b.get(b"s" * 16, 8) is None  # covers another token count: never restored
    assert b.pull(b"s" * 16, 7) and b.has(b"s" * 16, 7)
    assert b.get(b"s" * 16, 7) == blob
    b.discard(b"s" * 16)  # b's engine holds the cells now: no copy stays shared
    b.flush().result(timeout=10)
    assert not a.pull(b"t" * 16, 7)
    c = _kv(tmp_path, redis_url, "c", **options)
    assert c.get(b"s" * 16, 7) is None
    for store in (a, b, c):
        store.close()


def test_a_blob_too_big_for_redis_without_a_directory_is_not_shared(tmp_path, redis_url):
    a = _kv(tmp_path, redis_url, "a", redis_max_bytes=100)
    b = _kv(tmp_path, redis_url, "b", redis_max_bytes=100)
    a.put(b"s" * 16, 7, b"x" * 1000)
    a.flush().result(timeout=10)
    assert a.get(b"s" * 16, 7) == b"x" * 1000  # its own copy stays
    assert b.get(b"s" * 16, 7) is None  # a resume elsewhere replays
    a.close()
    b.close()


@pytest.mark.asyncio
async def test_an_outage_is_seen_by_a_write_and_by_the_probe_and_its_end_too(tmp_path):
    from tests.redis_server import redis_server

    with redis_server() as server:
        store = _store(server.url, "a")
        appended = _Appended()
        store.on_appended = appended
        await store.probe()
        assert store.outage() is None
        server.stop()
        record = _record(b"o" * 16, expires=time.time() + 60)
        store.add(record)
        store.append_token(record, 7)
        assert await appended.wait(record) == ["failed"]  # the reader's stream ends here
        assert store.outage() is not None  # seen by the write, before any probe
        await asyncio.to_thread(server.restart)
        await store.probe()
        assert store.outage() is None
        server.stop()
        await store.probe()  # nothing written: the PING alone finds it
        assert "redis.sock" in (store.outage() or "")
        server.restart()
        await store.aclose()


def test_a_redis_that_lost_the_keyring_gets_it_back(redis_url):
    ring = SharedKeyRing(connect(redis_url), "quicsrv:mac-keys", previous_key_ttl_s=60.0)
    stored = connect(redis_url).get("quicsrv:mac-keys")
    connect(redis_url).flushall()  # a restart without persistence
    ring.refresh()
    assert connect(redis_url).get("quicsrv:mac-keys") == stored
    other = SharedKeyRing(connect(redis_url), "quicsrv:mac-keys", previous_key_ttl_s=60.0)
    assert other.verifying_keys(time.time()) == ring.verifying_keys(time.time())
