"""previous_response_id: the next prompt starts with the previous turn's own token ids when
the chat template is prefix-stable for the conversation, and is rendered afresh otherwise."""

from __future__ import annotations

import quicsrv_proto
from quicsrv.sessions.generation import PriorTurn, build_request
from quicsrv_proto import ChatMessage
from tests.fakes import FakeEngine

# Stand-in ids of the answer "hi", as the engine sampled them: not what "hi" tokenizes to, so a
# prompt that holds them can only have taken them from the stored turn.
SAMPLED = (9001, 9002)
FIRST = (ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Q?"))


class _ChatTemplateEngine(FakeEngine):
    """Renders like ChatML: every message closed, then the assistant's opening for the answer."""

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        turns = "".join(f"<{m['role']}>{m['content']}<end>" for m in messages)
        return turns + "<assistant>"


class _RewritingEngine(_ChatTemplateEngine):
    """A template that renders earlier answers differently (as some strip reasoning)."""

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        shown = [
            {**m, "content": "…"} if m["role"] == "assistant" and i < last_user else m
            for i, m in enumerate(messages)
        ]
        return super().render_chat(shown)


def _prior(engine: FakeEngine, *, exact: bool = True, prompt: tuple[int, ...] | None = None):
    rendered = engine.render_chat([{"role": m.role, "content": m.content} for m in FIRST])
    tokens = tuple(engine.tokenize(rendered, add_special=False)) if prompt is None else prompt
    return PriorTurn(
        messages=FIRST, prompt_tokens=tokens, generated=SAMPLED, answer="hi", exact=exact
    )


def _next_turn() -> quicsrv_proto.Generate:
    messages = (
        *FIRST,
        ChatMessage(role="assistant", content="hi"),
        ChatMessage(role="user", content="More?"),
    )
    return quicsrv_proto.Generate(messages=messages, max_tokens=8)


def _full(engine: FakeEngine, frame: quicsrv_proto.Generate) -> tuple[int, ...]:
    assert frame.messages is not None
    text = engine.render_chat([{"role": m.role, "content": m.content} for m in frame.messages])
    return tuple(engine.tokenize(text, add_special=False))


def test_a_prefix_stable_chat_continues_from_the_stored_tokens():
    engine = _ChatTemplateEngine(context_per_sequence=4096)
    prior = _prior(engine)
    prepared = build_request(engine, _next_turn(), max_tokens_limit=64, prior=prior)
    rest = tuple(engine.tokenize("<end><user>More?<end><assistant>", add_special=False))
    assert prepared.continued
    assert prepared.spec.prompt_tokens == (*prior.prompt_tokens, *SAMPLED, *rest)
    assert prepared.messages == _next_turn().messages


def test_a_template_that_rewrites_earlier_turns_is_rendered_afresh():
    engine = _RewritingEngine(context_per_sequence=4096)
    frame = _next_turn()
    prepared = build_request(engine, frame, max_tokens_limit=64, prior=_prior(engine))
    assert not prepared.continued
    assert prepared.spec.prompt_tokens == _full(engine, frame)


def test_an_answer_cut_by_a_stop_sequence_or_a_changed_prompt_is_rendered_afresh():
    engine = _ChatTemplateEngine(context_per_sequence=4096)
    frame = _next_turn()
    for prior in (_prior(engine, exact=False), _prior(engine, prompt=(1, 2, 3))):
        prepared = build_request(engine, frame, max_tokens_limit=64, prior=prior)
        assert not prepared.continued
        assert prepared.spec.prompt_tokens == _full(engine, frame)


def test_a_chat_that_does_not_start_with_the_prior_turn_is_rendered_afresh():
    engine = _ChatTemplateEngine(context_per_sequence=4096)
    frame = quicsrv_proto.Generate(
        messages=(ChatMessage(role="user", content="Another chat"),), max_tokens=8
    )
    prepared = build_request(engine, frame, max_tokens_limit=64, prior=_prior(engine))
    assert not prepared.continued and prepared.spec.prompt_tokens == _full(engine, frame)
