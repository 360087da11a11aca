"""A chat over its context budget, cut down by dropping its oldest turns (``truncation: auto``).

What is kept: every system (developer) message, wherever it stands, and the newest turns; a
turn is a user message with the messages that follow it up to the next user message, so a cut
never falls inside one. What goes: the oldest turns, in *epochs*. Epoch boundaries are turn
starts, each about ``1 - KEEP_FRACTION`` of the budget (in content tokens) after the one before,
counted from the first turn: they depend only on the conversation's beginning, so as a chat
grows the same boundaries come back, the chosen one stays put for several turns, and the kept
prompt grows by appending (the prefix cache keeps hitting). When the history from the current
boundary no longer fits, the next boundary is taken: about half the budget is freed at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from quicsrv_proto import ChatMessage

__all__ = ["KEEP_FRACTION", "fit_history"]

KEEP_FRACTION = 0.5
"""After a cut, the kept history is about this fraction of the budget (plus the newest turn)."""


def fit_history(
    messages: Sequence[ChatMessage],
    *,
    budget: int,
    prompt_tokens: Callable[[Sequence[ChatMessage]], int],
    content_tokens: Callable[[ChatMessage], int],
) -> tuple[ChatMessage, ...] | None:
    """The messages to send, the oldest turns dropped until the rendered prompt takes at most
    ``budget`` tokens (``prompt_tokens``: the whole chat rendered and tokenized); None when
    even the system messages and the newest turn do not fit."""
    starts = [i for i, m in enumerate(messages) if m.role == "user"]
    if not starts:
        return tuple(messages) if prompt_tokens(messages) <= budget else None
    for start in _epochs(messages, starts, budget, content_tokens):
        kept = tuple(m for i, m in enumerate(messages) if i >= start or m.role == "system")
        if prompt_tokens(kept) <= budget:
            return kept
    return None


def _epochs(
    messages: Sequence[ChatMessage],
    starts: list[int],
    budget: int,
    content_tokens: Callable[[ChatMessage], int],
) -> list[int]:
    """The turn starts a cut may fall on: the first turn, then one about ``1 - KEEP_FRACTION``
    of the budget later, and so on; the newest turn last (it is always kept)."""
    step = max(1, int(budget * (1 - KEEP_FRACTION)))
    epochs = [starts[0]]
    counted = 0
    for previous, start in zip(starts, starts[1:], strict=False):
        counted += sum(content_tokens(m) for m in messages[previous:start] if m.role != "system")
        if counted >= step:
            epochs.append(start)
            counted = 0
    if epochs[-1] != starts[-1]:
        epochs.append(starts[-1])
    return epochs
