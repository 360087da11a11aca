"""SSE cursors: round trip, every forgery refused, key rotation honoured."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quicsrv.http.cursor import (
    CURSOR_CHARS,
    FLAG_CHAT,
    FLAG_USAGE,
    InvalidCursor,
    decode_cursor,
    encode_cursor,
)

KEY = b"k" * 32
OTHER_KEY = b"o" * 32
SESSION = bytes(range(16))


@given(
    session=st.binary(min_size=16, max_size=16),
    index=st.integers(min_value=-1, max_value=(1 << 31) - 1),
    flags=st.sampled_from([0, FLAG_CHAT, FLAG_USAGE, FLAG_CHAT | FLAG_USAGE]),
)
def test_a_cursor_round_trips(session, index, flags):
    text = encode_cursor(KEY, session, index, flags)
    assert len(text) == CURSOR_CHARS
    cursor = decode_cursor(text, [OTHER_KEY, KEY])
    assert (cursor.session_id, cursor.index, cursor.flags) == (session, index, flags)
    assert cursor.chat == bool(flags & FLAG_CHAT)
    assert cursor.include_usage == bool(flags & FLAG_USAGE)


def test_a_cursor_from_another_key_is_refused():
    with pytest.raises(InvalidCursor):
        decode_cursor(encode_cursor(OTHER_KEY, SESSION, 3, 0), [KEY])


@given(position=st.integers(min_value=0, max_value=CURSOR_CHARS - 1), data=st.data())
def test_changing_any_character_is_refused(position, data):
    """Every character counts, the last one's padding bits too (the same bytes, but not the
    text this server issued)."""
    text = encode_cursor(KEY, SESSION, 7, FLAG_CHAT)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    replacement = data.draw(st.sampled_from(alphabet).filter(lambda c: c != text[position]))
    with pytest.raises(InvalidCursor):
        decode_cursor(text[:position] + replacement + text[position + 1 :], [KEY])


def test_a_cursor_with_other_padding_bits_is_refused():
    text = encode_cursor(KEY, SESSION, 7, FLAG_CHAT)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    # 37 bytes in 50 characters: the last character's 4 low bits are unused.
    same_bytes = [
        c
        for c in alphabet
        if c != text[-1] and alphabet.index(c) >> 4 == alphabet.index(text[-1]) >> 4
    ]
    assert len(same_bytes) == 15
    for last in same_bytes:
        with pytest.raises(InvalidCursor):
            decode_cursor(text[:-1] + last, [KEY])


@pytest.mark.parametrize(
    "text", ["", "x", "not a cursor at all", "=" * CURSOR_CHARS, "é" * CURSOR_CHARS, "A" * 200]
)
def test_malformed_cursors_are_refused(text):
    with pytest.raises(InvalidCursor):
        decode_cursor(text, [KEY])


def test_no_live_key_verifies_nothing():
    with pytest.raises(InvalidCursor):
        decode_cursor(encode_cursor(KEY, SESSION, 0, 0), [])
