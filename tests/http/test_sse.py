"""The SSE encoder: events, cursors, and a resumed stream that is exactly the tail."""

from __future__ import annotations

import json

import quicsrv_proto
from quicsrv.http.cursor import decode_cursor
from quicsrv.http.sse import KEEPALIVE_COMMENT, SseEncoder, StreamShape
from quicsrv_proto import EndReason, ErrorCode

KEY = b"k" * 32
SESSION = b"s" * 16


def _frames() -> list[quicsrv_proto.Frame]:
    return [
        quicsrv_proto.Checkpoint(session_id=SESSION, index=-1, snapshot_hash=b"h" * 32),
        quicsrv_proto.Token(index=0, token_id=1, text="Hel"),
        quicsrv_proto.Token(index=1, token_id=2, text=""),  # half a character: no event
        quicsrv_proto.Token(index=2, token_id=3, text="lo"),
        quicsrv_proto.Checkpoint(session_id=SESSION, index=2, snapshot_hash=b"h" * 32),
        quicsrv_proto.End(reason=EndReason.LENGTH, prompt_tokens=4, completion_tokens=3, text="!"),
    ]


def _shape(**changes) -> StreamShape:
    values = dict(session_id=SESSION, chat=True, include_usage=True, model="m", created=1)
    return StreamShape(**{**values, **changes})


def _events(data: bytes) -> list[tuple[str | None, str]]:
    events = []
    for block in data.decode().split("\n\n")[:-1]:
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((fields.get("id"), fields["data"]))
    return events


def _encode(encoder: SseEncoder, frames: list[quicsrv_proto.Frame]) -> bytes:
    return b"".join(encoder.encode(f) for f in frames)


def test_a_whole_chat_stream():
    encoder = SseEncoder(_shape(), mac_key=KEY)
    events = _events(_encode(encoder, _frames()))
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Hello!"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 3,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    indices = [decode_cursor(i, [KEY]).index for i, _ in events[:-1] if i is not None]
    assert indices == [-1, 0, 2, 3, 4]
    assert encoder.finished


def test_after_any_cursor_a_resumed_stream_is_exactly_the_tail():
    frames = _frames()
    whole = _events(_encode(SseEncoder(_shape(), mac_key=KEY), frames))
    for position, (cursor_text, _) in enumerate(whole[:-1]):
        cursor = decode_cursor(cursor_text, [KEY])
        resumed = SseEncoder(_shape(), mac_key=KEY, after=cursor.index)
        # The session replays from the token after the cursor (every frame, at worst).
        tail = _events(_encode(resumed, frames))
        assert tail == whole[position + 1 :]


def test_text_completion_chunks_without_usage():
    encoder = SseEncoder(_shape(chat=False, include_usage=False), mac_key=KEY)
    chunks = [json.loads(d) for _, d in _events(_encode(encoder, _frames()))[:-1]]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello!"


def test_errors_and_interruptions_end_the_stream_without_an_id():
    for frame, code in [
        (quicsrv_proto.Error(code=ErrorCode.ENGINE_UNAVAILABLE, message="x"), "engine_unavailable"),
        (quicsrv_proto.End(reason=EndReason.SHUTDOWN), "shutting_down"),
        (quicsrv_proto.End(reason=EndReason.SUPERSEDED), "superseded"),
    ]:
        encoder = SseEncoder(_shape(), mac_key=KEY)
        events = _events(encoder.encode(frame))
        assert len(events) == 1 and events[0][0] is None
        assert json.loads(events[0][1])["error"]["code"] == code
        assert encoder.finished


def test_a_restart_tells_the_client_when_and_how_to_resume():
    encoder = SseEncoder(_shape(), mac_key=KEY)
    data = encoder.encode(quicsrv_proto.End(reason=EndReason.SHUTDOWN))
    assert data.startswith(b"retry: 3000\n")
    assert b"\nid:" not in data and not data.startswith(b"id:")  # resume from the last id
    error = json.loads(data.split(b"data: ", 1)[1])["error"]
    assert (error["code"], error["retry_after_s"]) == ("shutting_down", 3.0)
    assert "Last-Event-ID" in error["message"]


def test_a_keep_alive_between_events_gives_the_openai_sdk_no_empty_event() -> None:
    """The SDK's parser (as it is) dispatches an event on a blank line once it has seen an id,
    data or none: a keep-alive comment must not end with one."""
    from openai._streaming import SSEDecoder

    first = b'id: a\ndata: {"n": 1}\n\n'
    second = b'id: b\ndata: {"n": 2}\n\n'
    events = list(SSEDecoder().iter_bytes(iter([first, KEEPALIVE_COMMENT, second])))
    assert [(e.id, json.loads(e.data)) for e in events] == [("a", {"n": 1}), ("b", {"n": 2})]
