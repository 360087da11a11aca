"""When a sequence's tokens first show its reader text (UTF-8 as the text stream decodes it)."""

from __future__ import annotations

from quicsrv.engine.first_text import FirstText


def test_the_text_shows_with_the_piece_that_completes_a_character() -> None:
    first = FirstText()
    curly = "“".encode()
    assert [first.feed(p) for p in (b"", curly[:2], curly[2:], b"more")] == [
        False,
        False,
        True,
        False,
    ]
    assert first.shown


def test_a_newline_is_text_and_a_readers_text_shown_before_is_never_shown_again() -> None:
    assert FirstText().feed(b"\n")
    resumed = FirstText(shown=True)
    assert not resumed.feed(b"text")
    assert resumed.shown
