"""truncation auto: a chat over its budget loses its oldest turns, in stable epochs."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby

import pytest
from hypothesis import given
from hypothesis import strategies as st

import quicsrv_proto
from quicsrv.sessions.errors import RequestRejected
from quicsrv.sessions.generation import build_request
from quicsrv.sessions.overflow import fit_history
from quicsrv_proto import ChatMessage, Truncation
from tests.fakes import FakeEngine


def _tokens(messages: Sequence[ChatMessage]) -> int:
    """One token per character, and four for each message's template (a stand-in renderer)."""
    return sum(4 + len(m.content) for m in messages)


def _fit(messages: Sequence[ChatMessage], budget: int) -> tuple[ChatMessage, ...] | None:
    return fit_history(
        messages, budget=budget, prompt_tokens=_tokens, content_tokens=lambda m: len(m.content)
    )


def _chat(turns: int, *, system: bool = True) -> list[ChatMessage]:
    messages = [ChatMessage(role="system", content="Be brief.")] if system else []
    for i in range(turns):
        messages.append(ChatMessage(role="user", content=f"question {i} " + "q" * 20))
        messages.append(ChatMessage(role="assistant", content=f"answer {i} " + "a" * 30))
    messages.append(ChatMessage(role="user", content="and now?"))
    return messages


def test_a_chat_that_fits_is_left_alone():
    chat = _chat(2)
    assert _fit(chat, budget=1000) == tuple(chat)


def test_the_oldest_turns_go_the_system_message_and_the_newest_turn_stay():
    chat = _chat(12)
    kept = _fit(chat, budget=300)
    assert kept is not None and _tokens(kept) <= 300
    assert kept[0] == chat[0] and kept[-1] == chat[-1]
    assert kept[1].role == "user"  # a cut falls between turns, never inside one
    assert kept[1:] == tuple(chat[len(chat) - len(kept) + 1 :])  # the newest, in order


def test_the_cut_stays_put_for_several_turns_so_the_prompt_grows_by_appending():
    budget = 400
    starts = []
    for turns in range(6, 30):
        kept = _fit(_chat(turns), budget=budget)
        assert kept is not None
        starts.append(kept[1].content)
    # The kept history begins at the same turn for runs of consecutive requests.
    runs = [len(list(group)) for _, group in groupby(starts)]
    assert max(runs) >= 3
    assert len(runs) < len(starts) // 2
    # ... and after a cut about half the budget is left for the turns to come.
    for turns in range(6, 30):
        kept = _fit(_chat(turns), budget=budget)
        assert kept is not None and _tokens(kept) <= budget


def test_nothing_fits_when_the_newest_turn_alone_is_too_long():
    chat = [ChatMessage(role="system", content="s"), ChatMessage(role="user", content="x" * 500)]
    assert _fit(chat, budget=100) is None


@given(
    st.lists(
        st.builds(
            ChatMessage,
            role=st.sampled_from(["system", "user", "assistant"]),
            content=st.text(max_size=40),
        ),
        min_size=1,
        max_size=30,
    ),
    st.integers(10, 400),
)
def test_what_is_kept_fits_keeps_every_system_message_and_a_suffix_of_whole_turns(messages, budget):
    kept = _fit(messages, budget)
    if kept is None:
        return
    assert _tokens(kept) <= budget
    assert [m for m in kept if m.role == "system"] == [m for m in messages if m.role == "system"]
    others = [m for m in kept if m.role != "system"]
    originals = [m for m in messages if m.role != "system"]
    assert others == originals[len(originals) - len(others) :]
    if others != originals:
        assert others and others[0].role == "user"


def test_build_request_truncates_only_when_asked():
    engine = FakeEngine(context_per_sequence=200)
    chat = tuple(_chat(8))
    refused = quicsrv_proto.Generate(messages=chat, max_tokens=16)
    with pytest.raises(RequestRejected) as too_long:
        build_request(engine, refused, max_tokens_limit=64)
    assert too_long.value.code == quicsrv_proto.ErrorCode.PROMPT_TOO_LONG
    assert "truncation 'auto'" in too_long.value.message
    asked = quicsrv_proto.Generate(messages=chat, max_tokens=16, truncation=Truncation.AUTO)
    request = build_request(engine, asked, max_tokens_limit=64).spec
    assert len(request.prompt_tokens) + 16 <= 200
    rendered = "".join(chr(t) for t in request.prompt_tokens)
    assert rendered.startswith("<system>Be brief.") and rendered.endswith("<user>and now?")


def test_a_prompt_cannot_ask_for_truncation():
    with pytest.raises(quicsrv_proto.InvalidField):
        quicsrv_proto.Generate.from_payload({"prompt": "hi", "max_tokens": 4, "truncation": "auto"})
    with pytest.raises(quicsrv_proto.InvalidField):
        quicsrv_proto.Generate.from_payload(
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "truncation": "x"}
        )
