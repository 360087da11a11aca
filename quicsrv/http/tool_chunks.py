"""A tool answer (:mod:`.tool_answers`: the generic format or the template's) as chat
completions show it: content deltas or ``tool_calls`` deltas in chunks, and the whole
``message`` of a ``stream: false`` answer.

Call ``i`` has the id ``call_<session id>`` (``_<i>`` after it for the second call on), so
a resumed stream names the calls as the first one did.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .tool_answers import parse_answer
from .tool_calls import call_id
from .tool_format import GENERIC, ArgumentsDelta, CallStarted, Piece, TextDelta

__all__ = ["chat_delta", "chat_message"]


def chat_delta(session_id: bytes, pieces: Sequence[Piece]) -> dict[str, Any]:
    """A chunk's ``delta`` fields for ``pieces`` (``content`` and/or ``tool_calls``, one entry
    per call touched; a call's first entry has its id, type and name); {} for none."""
    delta: dict[str, Any] = {}
    text = "".join(p.text for p in pieces if isinstance(p, TextDelta))
    if text:
        delta["content"] = text
    entries: list[dict[str, Any]] = []
    for piece in pieces:
        if isinstance(piece, CallStarted):
            entries.append(
                {
                    "index": piece.index,
                    "id": call_id(session_id, piece.index),
                    "type": "function",
                    "function": {"name": piece.name, "arguments": ""},
                }
            )
        elif isinstance(piece, ArgumentsDelta):
            if entries and entries[-1]["index"] == piece.index:
                entries[-1]["function"]["arguments"] += piece.text
            else:
                entries.append({"index": piece.index, "function": {"arguments": piece.text}})
    if entries:
        delta["tool_calls"] = entries
    return delta


def chat_message(
    session_id: bytes, text: str, answer_format: str = GENERIC
) -> tuple[dict[str, Any], bool]:
    """The assistant ``message`` of the whole answer ``text`` (in format ``answer_format``,
    :mod:`.tool_answers`), and whether it calls tools."""
    answer = parse_answer(answer_format, text)
    if not answer.calls:
        return {"role": "assistant", "content": answer.text, "refusal": None}, False
    calls = [
        {
            "id": call_id(session_id, i),
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        for i, (name, arguments) in enumerate(answer.calls)
    ]
    return {"role": "assistant", "content": None, "refusal": None, "tool_calls": calls}, True
