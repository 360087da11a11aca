"""Resumable sessions end to end: the real model, the real server, real QUIC on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

import quicsrv_proto
from quicsrv.config import ResumeConflict
from quicsrv.sessions.flow import MAX_AHEAD_FACTOR
from quicsrv.sessions.manager import SessionManager
from quicsrv_client import (
    CheckpointReceived,
    Client,
    Event,
    GenerationEnded,
    ResumePosition,
    ServerError,
    SessionStarted,
    TokenReceived,
)
from quicsrv_proto import ErrorCode
from tests.helpers import running_server, session_settings, uncached

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

# A prompt whose continuation holds characters split across tokens (checked below): emoji are
# several byte-level tokens each, whatever the attention kernel or sampler makes of the text.
PROMPT = "List ten emoji: 🍎 🍌 🍇"
MAX_TOKENS = 48


@dataclass
class Joined:
    ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    paths: list[str | None] = field(default_factory=list)
    end: GenerationEnded | None = None

    @property
    def joined_text(self) -> str:
        return "".join(self.text)


async def _uninterrupted(port: int, ca, **params) -> Joined:
    out = Joined()
    async with Client("127.0.0.1", port, ca=ca) as c:
        async for event in c.generate(PROMPT, **params):
            _take(out, event)
    return out


def _take(out: Joined, event: Event) -> None:
    if isinstance(event, TokenReceived):
        out.ids.append(event.token_id)
        out.text.append(event.text)
    elif isinstance(event, GenerationEnded):
        out.text.append(event.text)
        out.end = event


async def _run_with_cuts(server, ca, should_cut: Callable[[Event], bool], **params) -> Joined:
    """Generate; whenever ``should_cut`` says so, drop the connection, wait until the server
    has paused the generation (so the resume meets a session at rest, whatever the machine's
    speed), and resume on a new connection."""
    out = Joined()
    position: ResumePosition | None = None
    while out.end is None:
        if position is not None:
            live = server.sessions.live(bytes.fromhex(position.session_id))
            if live is not None:
                await asyncio.wait_for(live.idle.wait(), timeout=60)
        client = Client("127.0.0.1", server.port, ca=ca)
        await client.connect()
        generation = (
            client.generate(PROMPT, **params) if position is None else client.resume_from(position)
        )
        async for event in generation:
            _take(out, event)
            if isinstance(event, SessionStarted) and position is not None:
                out.paths.append(event.resume_path)
            if out.end is None and should_cut(event) and generation.position is not None:
                break
        position = generation.position
        await client.close()  # the cut, or the end
    return out


def _cut_points(reference: Joined) -> tuple[set[int], set[int]]:
    """Token indices and checkpoint indices to cut at: 20 in all, whatever text the model
    happens to produce on this CPU (only the split characters' positions depend on it)."""
    utf8_splits = [i for i, t in enumerate(reference.text[:-1]) if t == ""]
    assert utf8_splits, "the prompt must produce a character split across tokens"
    last = len(reference.ids) - 1
    checkpoints = {-1, 15, 31}  # right after CHECKPOINT(-1) (no token yet), and at two more
    # Inside characters, around a checkpoint, just before END (last token missing, or only END).
    # (Not at a checkpoint's own token: after that cut the checkpoint is never sent again.)
    tokens = {*utf8_splits[:4], 0, 14, 16, last - 1, last} - checkpoints
    # Then spread over the rest of the generation until there are 20.
    fillers = sorted(set(range(1, last)) - tokens - checkpoints, key=lambda i: (i * 7) % last)
    tokens.update(fillers[: 20 - len(checkpoints) - len(tokens)])
    assert len(tokens) + len(checkpoints) == 20
    return tokens, checkpoints


def _cutter(tokens: set[int], checkpoints: set[int]) -> Callable[[Event], bool]:
    done: set[tuple[str, int]] = set()

    def should_cut(event: Event) -> bool:
        key: tuple[str, int] | None = None
        if isinstance(event, TokenReceived) and event.index in tokens:
            key = ("token", event.index)
        elif isinstance(event, CheckpointReceived) and event.index in checkpoints:
            key = ("checkpoint", event.index)
        if key is None or key in done:
            return False
        done.add(key)
        return True

    return should_cut


@pytest.mark.parametrize(
    ("params", "kv_budget"),
    [
        (dict(temperature=0.0), 256 << 20),  # greedy, KV kept in memory: kv-restore
        (dict(temperature=0.9, top_k=40, top_p=0.95, seed=11), 0),  # sampled, no KV: replay
    ],
    ids=["greedy-kv-restore", "seeded-replay"],
)
async def test_cut_at_20_points_and_resume_gives_the_uninterrupted_output(
    engine, certs, tmp_path, params, kv_budget
):
    params = dict(params, max_tokens=MAX_TOKENS, ignore_eos=True)
    # A short allowance: a cut reader's generation pauses a few tokens on instead of running
    # to its end on a fast machine, so the resumes really rebuild the decoder state.
    settings = session_settings(
        tmp_path,
        kv_memory_budget_bytes=kv_budget,
        kv_disk_budget_bytes=kv_budget,
        max_tokens_ahead=4,
    )
    async with running_server(engine, certs, sessions=settings) as server:
        reference = await _uninterrupted(server.port, certs.ca_cert, **params)
        tokens, checkpoints = _cut_points(reference)
        joined = await _run_with_cuts(server, certs.ca_cert, _cutter(tokens, checkpoints), **params)
    assert joined.ids == reference.ids
    assert joined.joined_text == reference.joined_text
    assert uncached(joined.end) == uncached(reference.end)
    assert len(joined.paths) == 20
    expected = "kv-restore" if kv_budget else "replay"
    # Cuts before any token or after the last one need no engine ("none").
    assert expected in joined.paths
    assert set(joined.paths) <= {expected, "none"}


async def _start_and_cut(server, ca, n_tokens: int, **params) -> ResumePosition:
    """Start a generation, drop the connection after ``n_tokens``, wait until the server has
    paused it (so what follows meets a session at rest)."""
    live = None
    async with Client("127.0.0.1", server.port, ca=ca) as c:
        generation = c.generate(PROMPT, **params)
        async for event in generation:
            if isinstance(event, SessionStarted):
                live = server.sessions.live(bytes.fromhex(event.session_id))
            if isinstance(event, TokenReceived) and event.index == n_tokens - 1:
                break
        position = generation.position
    assert position is not None and live is not None
    await asyncio.wait_for(live.idle.wait(), timeout=60)
    return position


async def _resume_error(port: int, ca, position: ResumePosition, **changes) -> ServerError:
    fields = dict(
        session=position.session_id,
        last_index=position.last_index,
        snapshot_hash=position.snapshot_hash,
        checkpoint_index=position.checkpoint_index,
    )
    fields.update(changes)
    async with Client("127.0.0.1", port, ca=ca) as c:
        with pytest.raises(ServerError) as info:
            async for _ in c.resume(
                fields.pop("session"),
                fields.pop("last_index"),
                fields.pop("snapshot_hash"),
                **fields,
            ):
                pass
        # The connection is still good for a real request.
        ok = await c.generate_text(PROMPT, max_tokens=4, ignore_eos=True)
        assert len(ok.token_ids) == 4
    return info.value


async def test_forged_foreign_unknown_and_beyond_get_their_codes(engine, certs, tmp_path):
    params = dict(max_tokens=24, ignore_eos=True)
    async with running_server(engine, certs, sessions=session_settings(tmp_path)) as server:
        port, ca = server.port, certs.ca_cert
        mine = await _start_and_cut(server, ca, 20, **params)
        other = await _start_and_cut(server, ca, 20, **params)
        forged = bytes(b ^ 1 for b in mine.snapshot_hash)
        assert (await _resume_error(port, ca, mine, snapshot_hash=forged)).code == (
            ErrorCode.HASH_MISMATCH
        )
        foreign = await _resume_error(port, ca, mine, snapshot_hash=other.snapshot_hash)
        assert foreign.code == ErrorCode.HASH_MISMATCH and foreign.http_status == 403
        unknown = await _resume_error(port, ca, mine, session="00" * 16)
        assert unknown.code == ErrorCode.UNKNOWN_SESSION and unknown.http_status == 404
        beyond = await _resume_error(port, ca, mine, last_index=500)
        assert beyond.code == ErrorCode.INDEX_BEYOND_SNAPSHOT
        # None of that disturbed the session: it still resumes.
        async with Client("127.0.0.1", port, ca=ca) as c:
            rest = [e async for e in c.resume_from(mine) if isinstance(e, TokenReceived)]
        assert [e.index for e in rest] == list(range(mine.last_index + 1, 24))


class _Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


async def test_an_expired_session_gets_expired(engine, certs, tmp_path):
    clock = _Clock()
    sessions = SessionManager(engine, session_settings(tmp_path, ttl_s=60.0), clock=clock)
    async with running_server(engine, certs, sessions=sessions) as server:
        position = await _start_and_cut(server, certs.ca_cert, 4, max_tokens=8)
        clock.now += 3600
        error = await _resume_error(server.port, certs.ca_cert, position)
        assert error.code == ErrorCode.SESSION_EXPIRED and error.http_status == 410
        # Swept from memory and disk, it stays "expired" (not "unknown") to its owner.
        assert sessions.store.get(bytes.fromhex(position.session_id)) is None
        again = await _resume_error(server.port, certs.ca_cert, position)
        assert again.code == ErrorCode.SESSION_EXPIRED


class _OtherModel:
    """The same engine claiming different weights."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.model_digest = b"\xff" * 32

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


async def test_a_changed_model_is_refused(engine, certs, tmp_path):
    settings = session_settings(tmp_path, mac_key=b"k" * 32)
    async with running_server(engine, certs, sessions=settings) as server:
        position = await _start_and_cut(server, certs.ca_cert, 4, max_tokens=8)
    other = _OtherModel(engine)
    async with running_server(other, certs, sessions=settings) as server:
        error = await _resume_error(server.port, certs.ca_cert, position)
    assert error.code == ErrorCode.MODEL_CHANGED and error.http_status == 409


async def _first_tokens(generation, n: int) -> list[Event]:
    events: list[Event] = []
    async for event in generation:
        events.append(event)
        if isinstance(event, TokenReceived) and event.index == n - 1:
            break
    return events


async def test_a_closed_connection_pauses_at_once_not_after_the_drain_period(
    engine, certs, tmp_path, monkeypatch
):
    """aioquic reports a peer's CONNECTION_CLOSE three probe timeouts late (its draining
    period); the server detaches as soon as the close arrives, so the engine stops within
    a step of the reader leaving."""
    from aioquic.quic.connection import QuicConnectionState

    from quicsrv.transport.streams import RequestStreams

    states: list[QuicConnectionState] = []
    close_all = RequestStreams.close_all

    def recording(self: RequestStreams) -> None:
        states.append(self.host._quic._state)  # type: ignore[attr-defined]
        close_all(self)

    monkeypatch.setattr(RequestStreams, "close_all", recording)
    async with running_server(engine, certs, sessions=session_settings(tmp_path)) as server:
        position = await _start_and_cut(server, certs.ca_cert, 4, max_tokens=400, ignore_eos=True)
        record = server.sessions.store.get(bytes.fromhex(position.session_id))
        assert record is not None and record.end is None  # paused, not finished
    assert states and states[0] is QuicConnectionState.DRAINING  # not TERMINATED: no waiting


async def test_a_second_resume_supersedes_the_first_reader(engine, certs, tmp_path):
    # Long enough that the cut generation is still running when the first resume attaches.
    params = dict(max_tokens=160, ignore_eos=True)
    async with running_server(engine, certs, sessions=session_settings(tmp_path)) as server:
        port, ca = server.port, certs.ca_cert
        reference = await _uninterrupted(port, ca, **params)
        position = await _start_and_cut(server, ca, 10, **params)
        async with (
            Client("127.0.0.1", port, ca=ca) as first,
            Client("127.0.0.1", port, ca=ca) as second,
        ):
            old = first.resume_from(position)
            await _first_tokens(old, 12)
            new = second.resume_from(position)
            new_events = [e async for e in new]
            old_rest = [e async for e in old]
    # The old stream ended with `superseded`; the new one got everything after the position.
    assert isinstance(old_rest[-1], GenerationEnded)
    assert old_rest[-1].reason is quicsrv_proto.EndReason.SUPERSEDED
    new_ids = [e.token_id for e in new_events if isinstance(e, TokenReceived)]
    assert new_ids == reference.ids[position.last_index + 1 :]


async def test_with_refuse_a_second_resume_gets_session_busy(engine, certs, tmp_path):
    settings = session_settings(tmp_path, on_conflict=ResumeConflict.REFUSE)
    params = dict(max_tokens=200, ignore_eos=True)
    async with running_server(engine, certs, sessions=settings) as server:
        port, ca = server.port, certs.ca_cert
        position = await _start_and_cut(server, ca, 4, **params)
        async with Client("127.0.0.1", port, ca=ca) as c:
            reader = c.resume_from(position)
            await _first_tokens(reader, 6)
            error = await _resume_error(port, ca, position)
            assert error.code == ErrorCode.SESSION_BUSY
            await reader.aclose()


async def test_a_stalled_reader_pauses_within_the_bound_while_its_neighbour_runs(
    engine, certs, tmp_path
):
    ahead = 16
    settings = session_settings(tmp_path, max_tokens_ahead=ahead)
    async with running_server(engine, certs, sessions=settings) as server:
        port, ca = server.port, certs.ca_cert
        solo = await _uninterrupted(port, ca, max_tokens=160, ignore_eos=True)
        async with Client("127.0.0.1", port, ca=ca, read_window_bytes=1024) as c:
            stalled = c.generate(PROMPT, max_tokens=160, ignore_eos=True)
            head = await _first_tokens(stalled, 2)
            started = next(e for e in head if isinstance(e, SessionStarted))
            session = server.sessions.live(bytes.fromhex(started.session_id))
            assert session is not None
            # The reader stops here. Its neighbour on the same connection runs to the end.
            neighbour = await c.generate_text(PROMPT, max_tokens=64, ignore_eos=True)
            await asyncio.wait_for(session.paused.wait(), timeout=120)
            generated = len(session.record.generated)
            acknowledged = session.acknowledged_tokens
            rest = [e async for e in stalled]  # the reader drains: no new request needed
    assert len(neighbour.token_ids) == 64
    # The allowance covers the tokens in flight of a reader keeping up (sessions.flow): past
    # max_tokens_ahead where its delay needs it, never past MAX_AHEAD_FACTOR times it.
    assert generated - acknowledged <= ahead * MAX_AHEAD_FACTOR
    assert generated < 160  # it paused rather than generating for nobody
    ids = [e.token_id for e in head + rest if isinstance(e, TokenReceived)]
    assert ids == solo.ids


async def test_kv_blobs_spill_to_disk_and_resumes_still_restore_them(engine, certs, tmp_path):
    # Everything spills; the small allowance makes each cut pause well before the end, so
    # the session keeps a blob however fast the engine runs.
    settings = session_settings(tmp_path, kv_memory_budget_bytes=1, max_tokens_ahead=8)
    params = dict(max_tokens=48, ignore_eos=True)
    async with running_server(engine, certs, sessions=settings) as server:
        port, ca = server.port, certs.ca_cert
        reference = await _uninterrupted(port, ca, **params)
        positions = [await _start_and_cut(server, ca, 8, **params) for _ in range(3)]
        await asyncio.wrap_future(server.sessions.kv.flush())  # spills run on their thread
        usage = server.sessions.kv.usage()
        assert usage.disk_blobs == 3 and usage.memory_blobs == 0
        for position in positions:
            async with Client("127.0.0.1", port, ca=ca) as c:
                resumed = c.resume_from(position)
                rest = [e async for e in resumed]
            assert resumed.resume_path == "kv-restore"
            ids = [e.token_id for e in rest if isinstance(e, TokenReceived)]
            assert reference.ids[:8] + ids == reference.ids
