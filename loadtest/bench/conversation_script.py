"""The scripted conversation of ``loadtest.bench.conversation``: its user turns, the history a
client resends each turn, and how much of a turn's tokens a prefix cache could keep.

Pure: no model, no clock. A tokenizer comes in as a callable, so tests count words instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["Message", "common_prefix", "history", "user_turns"]

Message = dict[str, str]

#: Plain English to cut user turns from: what the text says does not matter, only that every
#: turn is different, fixed, and tokenizes like ordinary prose (~1.3 tokens a word here).
_SOURCE = (
    "I am planning a small vegetable garden behind the house and would like your help with "
    "the details. The plot is about six metres long and three metres wide, it faces south, "
    "and the soil is heavy clay that stays wet for days after rain. Last year I grew tomatoes "
    "in pots on the terrace and they did well until the leaves turned yellow in August. This "
    "year I want beans, carrots, lettuce, onions and a few courgettes, and perhaps some herbs "
    "near the kitchen door. I have a compost heap that is two years old, a rain barrel, and "
    "very little time during the week, so whatever I choose must survive a few days without "
    "attention. My neighbour says raised beds would solve the drainage problem, but the wood "
    "is expensive and I am not sure how deep they need to be. I also wonder whether I should "
    "dig the clay in autumn or leave it until spring, and how much sand or grit would make a "
    "difference. Slugs were a plague last summer; I would prefer not to use pellets because "
    "of the hedgehogs. Please think about the order of sowing, what can follow what in the "
    "same bed, and which crops are worth the space for a beginner with a small family."
).split()


def user_turns(turns: int, tokens_per_turn: int, count_tokens: Callable[[str], int]) -> list[str]:
    """``turns`` user messages of at least ``tokens_per_turn`` tokens each (whole words, so a
    token or two more), each starting at another place in the source text, cycling through it.
    """
    messages = []
    for turn in range(turns):
        # 37 is prime to the source's length: each turn opens on a different word.
        start = (turn * 37) % len(_SOURCE)
        words = [f"(Message {turn + 1}.)"]
        i = start
        while count_tokens(" ".join(words)) < tokens_per_turn:
            words.append(_SOURCE[i % len(_SOURCE)])
            i += 1
        messages.append(" ".join(words))
    return messages


def history(users: Sequence[str], answers: Sequence[str], turn: int) -> list[Message]:
    """What the client sends for ``turn`` (0-based): every earlier user message and the answer it
    got, then this turn's user message. A chat client resends all of it every time."""
    if len(answers) < turn:
        raise ValueError(f"turn {turn} needs {turn} earlier answers, got {len(answers)}")
    messages: list[Message] = []
    for user, answer in zip(users[:turn], answers[:turn], strict=True):
        messages.append({"role": "user", "content": user})
        messages.append({"role": "assistant", "content": answer})
    messages.append({"role": "user", "content": users[turn]})
    return messages


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share: what a prefix cache holding ``a`` could
    keep of ``b``."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
