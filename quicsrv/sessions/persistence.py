"""What the sessions keep, opened from their settings in one place: the record store, the MAC
key ring and the KV cells of paused generations.

``store_url`` picks the world: "" (or "file") keeps everything under the data dir, for this
process alone; ``redis://host:port/db`` keeps records, token logs and MAC keys in Redis, and
shares paused KV cells through it (large ones through a shared directory), so that any process
naming the same URL may resume any session. Nothing else in the sessions asks which it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from .file_store import FileSessionStore
from .keys import KeyRing, SharedKeyRing
from .kvstore import KVStore
from .redis_store import RedisSessionStore, connect, connect_async, process_owner_id
from .settings import SessionSettings
from .shared_kv import SharedKV
from .store import SessionStore

__all__ = ["KEYRING_KEY", "Persistence", "open_persistence"]

KEYRING_KEY = "quicsrv:mac-keys"
"""Where a shared store keeps the MAC key ring (``quicsrv keys rotate --store`` too)."""


@dataclass(frozen=True, slots=True)
class Persistence:
    store: SessionStore
    keys: KeyRing
    kv: KVStore

    async def aclose(self) -> None:
        await self.store.aclose()
        self.kv.close()

    def close(self) -> None:
        self.store.close()
        self.kv.close()


def open_persistence(
    settings: SessionSettings, *, clock: Callable[[], float] = time.time
) -> Persistence:
    """Open (or create) the store, key ring and KV store ``settings`` name; raises
    ``redis.RedisError`` when a shared store cannot be reached."""
    shared_kv = None
    store: SessionStore
    keys: KeyRing
    if settings.store_url in ("", "file"):
        store = FileSessionStore(
            settings.data_dir / "sessions",
            ttl_s=settings.ttl_s,
            max_sessions=settings.max_sessions,
            max_disk_bytes=settings.max_disk_bytes,
            clock=clock,
        )
        keys = (
            KeyRing.from_secret(settings.mac_key)
            if settings.mac_key is not None
            else KeyRing.load_or_create(
                settings.data_dir / "mac-keys.json",
                previous_key_ttl_s=settings.previous_key_ttl_s,
            )
        )
    else:
        client = connect(settings.store_url)
        store = RedisSessionStore(
            client,
            owner_id=process_owner_id(),
            lease_s=settings.lease_s,
            ttl_s=settings.ttl_s,
            max_sessions=settings.max_sessions,
            max_disk_bytes=settings.max_disk_bytes,
            clock=clock,
            reader=connect_async(settings.store_url),
        )
        keys = (
            KeyRing.from_secret(settings.mac_key)
            if settings.mac_key is not None
            else SharedKeyRing(client, KEYRING_KEY, previous_key_ttl_s=settings.previous_key_ttl_s)
        )
        shared_kv = SharedKV(
            client,
            redis_max_bytes=settings.kv_redis_max_bytes,
            shared_dir=settings.kv_shared_dir,
            ttl_s=settings.ttl_s,
        )
    kv = KVStore(
        settings.data_dir / "kv",
        memory_budget_bytes=settings.kv_memory_budget_bytes,
        disk_budget_bytes=settings.kv_disk_budget_bytes,
        shared=shared_kv,
    )
    return Persistence(store=store, keys=keys, kv=kv)
