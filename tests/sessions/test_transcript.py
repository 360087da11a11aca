"""Which frames a session's tokens become (sessions.transcript): no loop, no store."""

from __future__ import annotations

from array import array

from hypothesis import given
from hypothesis import strategies as st

import quicsrv_proto
from quicsrv.engine import SamplingParams
from quicsrv.sessions.keys import KeyRing
from quicsrv.sessions.record import SessionEnd, SessionRecord
from quicsrv.sessions.spec import GenerationSpec
from quicsrv.sessions.transcript import Transcript
from quicsrv_proto import EndReason

KEY = b"k" * 32
# One character's UTF-8 split over two tokens, and the pieces of a stop sequence "<|".
PIECES = {1: b"a", 2: b" b", 3: "é".encode()[:1], 4: "é".encode()[1:], 5: b"<", 6: b"|", 7: b"c"}


def _record(generated=(), stop: tuple[str, ...] = ()) -> SessionRecord:
    spec = GenerationSpec(
        prompt_tokens=(10, 11, 12),
        sampling=SamplingParams(temperature=0.7, seed=42),
        max_tokens=64,
        stop=stop,
        ignore_eos=False,
        prefill_chunk=256,
    )
    return SessionRecord(
        session_id=b"s" * 16,
        model_digest=b"m" * 32,
        spec=spec,
        created_at_s=0.0,
        expires_at_s=100.0,
        generated=array("I", generated),
    )


def _transcript(record: SessionRecord, every: int = 4) -> Transcript:
    return Transcript(record, keys=KeyRing.from_secret(KEY), every=every, piece=PIECES.__getitem__)


def _frames(transcript: Transcript, start: int, stop: int) -> list[quicsrv_proto.Frame]:
    return [frame for _, chunk in transcript.chunks(start, stop) for frame in chunk]


def _grown(tokens: list[int], stop: tuple[str, ...] = (), every: int = 4) -> Transcript:
    """A transcript that followed its record token by token, as a live session's does."""
    record = _record(stop=stop)
    transcript = _transcript(record, every)
    for token in tokens:
        record.generated.append(token)
        transcript.add(PIECES[token])
    return transcript


tokens_st = st.lists(st.sampled_from(sorted(PIECES)), max_size=40)


@given(tokens=tokens_st, every=st.integers(1, 8), data=st.data())
def test_the_frames_of_a_range_are_those_of_its_two_halves(tokens, every, data):
    transcript = _grown(tokens, every=every)
    n = len(tokens)
    k = data.draw(st.integers(0, n))
    assert _frames(transcript, 0, n) == _frames(transcript, 0, k) + _frames(transcript, k, n)


@given(tokens=tokens_st, every=st.integers(1, 8), start=st.integers(0, 40))
def test_chunks_end_at_checkpoints_or_at_the_range_end(tokens, every, start):
    transcript = _grown(tokens, every=every)
    start = min(start, len(tokens))
    expected_index = start
    for end, chunk in transcript.chunks(start, len(tokens)):
        token_frames = [f for f in chunk if isinstance(f, quicsrv_proto.Token)]
        assert [f.index for f in token_frames] == list(range(expected_index, end))
        assert [f.token_id for f in token_frames] == tokens[expected_index:end]
        if end % every == 0:
            checkpoint = chunk[-1]
            assert isinstance(checkpoint, quicsrv_proto.Checkpoint)
            assert checkpoint.index == end - 1
            assert len(chunk) == len(token_frames) + 1
        else:
            assert end == len(tokens) and len(chunk) == len(token_frames)
        expected_index = end
    assert expected_index == len(tokens)


@given(tokens=tokens_st, every=st.integers(1, 8))
def test_a_resumed_transcript_is_the_live_one(tokens, every):
    """Built from the record (a resume, a restart), it gives the very frames the transcript
    that grew with the generation gave."""
    live = _grown(tokens, every=every)
    resumed = _transcript(_record(tokens), every)
    assert len(resumed) == len(live) == len(tokens)
    assert _frames(resumed, 0, len(tokens)) == _frames(live, 0, len(tokens))


@given(tokens=tokens_st)
def test_every_checkpoint_verifies_its_prefix(tokens):
    record = _record(tokens)
    transcript = _transcript(record, every=3)
    snapshot = record.snapshot()
    checkpoints = [transcript.checkpoint(-1)] + [
        f for f in _frames(transcript, 0, len(tokens)) if isinstance(f, quicsrv_proto.Checkpoint)
    ]
    for checkpoint in checkpoints:
        assert checkpoint.session_id == record.session_id
        assert snapshot.verify([KEY], checkpoint.index, checkpoint.snapshot_hash)
        assert not snapshot.verify([b"x" * 32], checkpoint.index, checkpoint.snapshot_hash)


def test_text_is_utf8_safe_and_held_back_while_it_may_start_a_stop_sequence():
    transcript = _grown([1, 3, 4, 5, 7], stop=("<|",))
    texts = [f.text for f in _frames(transcript, 0, 5) if isinstance(f, quicsrv_proto.Token)]
    assert texts == ["a", "", "é", "", "<c"]


def test_a_stop_sequence_ends_the_text_before_it_and_the_end_carries_nothing_more():
    record = _record(stop=("<|",))
    transcript = _transcript(record)
    stopped = []
    for token in (1, 5, 6):
        record.generated.append(token)
        stopped.append(transcript.add(PIECES[token]))
    assert stopped == [False, False, True]
    record.end = SessionEnd(EndReason.STOP, 3)
    transcript.close()
    texts = [f.text for f in _frames(transcript, 0, 3) if isinstance(f, quicsrv_proto.Token)]
    assert texts == ["a", "", ""]
    assert transcript.end() == quicsrv_proto.End(
        reason=EndReason.STOP, prompt_tokens=3, completion_tokens=3, text=""
    )


def test_the_end_releases_what_was_held_back():
    record = _record(stop=("<|",))
    transcript = _transcript(record)
    for token in (1, 5):  # "a", then "<": perhaps a stop sequence's start
        record.generated.append(token)
        transcript.add(PIECES[token])
    record.end = SessionEnd(EndReason.LENGTH, 2)
    transcript.close()
    assert transcript.end().text == "<"
    assert transcript.end().completion_tokens == 2
    # Read back from the record, the ended session ends the same way.
    assert _transcript(record).end() == transcript.end()


def test_the_frames_that_end_a_stream_otherwise():
    transcript = _grown([1, 2, 7])
    assert transcript.shutdown(2) == quicsrv_proto.End(
        reason=EndReason.SHUTDOWN, prompt_tokens=3, completion_tokens=2
    )
    assert transcript.superseded() == quicsrv_proto.End(reason=EndReason.SUPERSEDED)
    assert transcript.superseded("gone") == quicsrv_proto.Error(
        code=quicsrv_proto.ErrorCode.STORE_UNAVAILABLE, message="gone", retry_after_s=1.0
    )


def test_a_pause_is_checkpointed_only_at_the_end_of_what_the_reader_was_sent():
    transcript = _grown([1, 2, 7])
    checkpoint = transcript.pause_checkpoint(3, 3)
    assert checkpoint is not None and checkpoint.index == 2
    assert transcript.pause_checkpoint(2, 3) is None  # the reader has not been sent all
    assert transcript.pause_checkpoint(3, 4) is None  # the engine ran past the record
