"""The data of the two lm-evaluation-harness tasks in ``loadtest/eval/tasks/``, made here, from
a fixed seed, so that no dataset is downloaded and every run scores the same items (issue 43).

- ``quicsrv_mc`` (``multiple_choice``, scored by log-likelihood): 300 questions with four
  choices each: 100 sums, differences and products of small numbers, 100 "what comes next"
  (days, months, letters, number words, counting by 2 to 10), 100 word facts (opposites,
  capitals, colours, animal sounds, plurals). The continuation is ``" " + choice``.
- ``quicsrv_gen`` (``generate_until``, exact match): 100 three-shot sums and next-in-sequence
  questions, answered until the end of the line.

Run from the repository root (the tasks name their data files relative to it)::

    python -m loadtest.eval.make_tasks          # (re)write loadtest/eval/data/*.jsonl
    python -m loadtest.eval.make_tasks --check  # exit 1 if the files differ from the seed's

The committed files are this module's output; ``tests/loadtest/test_eval_tasks.py`` checks that
they still are.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["DATA", "SEED", "generation_items", "main", "multiple_choice_items", "rendered"]

SEED = 43
DATA = Path(__file__).resolve().parent / "data"

_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_MONTHS = [
    "January", "February", "March", "April", "May", "June",
    "July", "August", "September", "October", "November", "December",
]  # fmt: skip
_NUMBER_WORDS = [
    "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve",
]  # fmt: skip
_LETTERS = [chr(c) for c in range(ord("A"), ord("Z") + 1)]

_OPPOSITES = [
    ("hot", "cold"), ("up", "down"), ("big", "small"), ("fast", "slow"), ("day", "night"),
    ("open", "closed"), ("happy", "sad"), ("old", "new"), ("early", "late"), ("full", "empty"),
    ("light", "dark"), ("wet", "dry"), ("high", "low"), ("left", "right"), ("rich", "poor"),
    ("hard", "soft"), ("win", "lose"), ("buy", "sell"), ("in", "out"), ("yes", "no"),
]  # fmt: skip
_CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Japan", "Tokyo"), ("England", "London"), ("Russia", "Moscow"), ("Egypt", "Cairo"),
    ("China", "Beijing"), ("Greece", "Athens"), ("Canada", "Ottawa"), ("Portugal", "Lisbon"),
    ("Austria", "Vienna"), ("Ireland", "Dublin"), ("Norway", "Oslo"), ("Kenya", "Nairobi"),
    ("Peru", "Lima"), ("Poland", "Warsaw"), ("Sweden", "Stockholm"), ("Cuba", "Havana"),
]  # fmt: skip
_COLOURS = [
    ("the sky on a clear day", "blue"), ("grass", "green"), ("snow", "white"),
    ("coal", "black"), ("a ripe banana", "yellow"), ("a ripe tomato", "red"),
    ("an orange", "orange"), ("chocolate", "brown"), ("a lemon", "yellow"), ("blood", "red"),
]  # fmt: skip
_COLOUR_NAMES = ["blue", "green", "white", "black", "yellow", "red", "orange", "brown", "purple"]
_SOUNDS = [
    ("dog", "barks"), ("cat", "meows"), ("cow", "moos"), ("duck", "quacks"), ("lion", "roars"),
    ("sheep", "bleats"), ("horse", "neighs"), ("snake", "hisses"), ("owl", "hoots"),
    ("pig", "oinks"),
]  # fmt: skip
_PLURALS = [
    ("mouse", "mice"), ("child", "children"), ("foot", "feet"), ("tooth", "teeth"),
    ("man", "men"), ("woman", "women"), ("goose", "geese"), ("person", "people"),
    ("box", "boxes"), ("city", "cities"),
]  # fmt: skip

Item = dict[str, Any]


def _choice_item(
    rng: random.Random, kind: str, question: str, answer: str, wrong: Sequence[str]
) -> Item:
    """A four-choice item: ``answer`` and three of ``wrong`` (distinct), in a seeded order."""
    distractors = rng.sample([w for w in dict.fromkeys(wrong) if w != answer], 3)
    choices = [answer, *distractors]
    rng.shuffle(choices)
    return {
        "kind": kind,
        "question": f"Question: {question}\nAnswer:",
        "choices": choices,
        "answer": choices.index(answer),
    }


def _arithmetic(rng: random.Random) -> Item:
    op = rng.choice(["plus", "minus", "times"])
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    if op == "minus" and b > a:
        a, b = b, a
    value = {"plus": a + b, "minus": a - b, "times": a * b}[op]
    wrong = [str(value + d) for d in (-10, -2, -1, 1, 2, 10) if value + d >= 0]
    return _choice_item(rng, "arithmetic", f"What is {a} {op} {b}?", str(value), wrong)


def _sequence(rng: random.Random) -> tuple[str, list[str], str, list[str]]:
    """(kind, shown terms, next term, terms that are not next)."""
    kind = rng.choice(["days", "months", "letters", "number words", "counting"])
    if kind == "counting":
        step, start = rng.randint(2, 10), rng.randint(0, 20)
        terms = [str(start + step * i) for i in range(5)]
        wrong = [str(start + step * 4 + d) for d in (-step, 1, step + 1, 2 * step, step - 1)]
        return kind, terms[:4], terms[4], wrong
    pool = {
        "days": _DAYS,
        "months": _MONTHS,
        "letters": _LETTERS,
        "number words": _NUMBER_WORDS,
    }[kind]
    start = rng.randrange(len(pool) - 4)
    terms = pool[start : start + 4]
    following = pool[start + 4]
    return kind, terms, following, [p for p in pool if p not in (*terms, following)] + terms[:2]


def _next_in_sequence(rng: random.Random) -> Item:
    _, terms, following, wrong = _sequence(rng)
    return _choice_item(
        rng, "sequence", f"What comes next: {', '.join(terms)}, ...?", following, wrong
    )


def _fact(rng: random.Random) -> Item:
    table = rng.choice(["opposite", "capital", "colour", "sound", "plural"])
    if table == "opposite":
        word, answer = rng.choice(_OPPOSITES)
        if rng.random() < 0.5:
            word, answer = answer, word
        wrong = [w for pair in _OPPOSITES for w in pair if w not in (word, answer)]
        return _choice_item(rng, table, f"What is the opposite of {word}?", answer, wrong)
    if table == "capital":
        country, city = rng.choice(_CAPITALS)
        if rng.random() < 0.5:
            question = f"Which country has the capital {city}?"
            return _choice_item(rng, table, question, country, [c for c, _ in _CAPITALS])
        wrong = [c for _, c in _CAPITALS]
        return _choice_item(rng, table, f"What is the capital of {country}?", city, wrong)
    if table == "colour":
        thing, answer = rng.choice(_COLOURS)
        return _choice_item(rng, table, f"What colour is {thing}?", answer, _COLOUR_NAMES)
    if table == "sound":
        animal, answer = rng.choice(_SOUNDS)
        wrong = [s for _, s in _SOUNDS]
        return _choice_item(rng, table, f"Which verb is the sound a {animal} makes?", answer, wrong)
    word, answer = rng.choice(_PLURALS)
    wrong = [p for _, p in _PLURALS] + [word + "s", word + "es"]
    return _choice_item(rng, table, f"What is the plural of {word}?", answer, wrong)


def multiple_choice_items(seed: int = SEED, per_kind: int = 100) -> list[Item]:
    """``quicsrv_mc``'s items: ``per_kind`` of each of the three kinds, in a seeded order;
    no question twice."""
    rng = random.Random(seed)
    items: list[Item] = []
    makers: list[Callable[[random.Random], Item]] = [_arithmetic, _next_in_sequence, _fact]
    for make in makers:
        seen: set[str] = set()
        for _ in range(100 * per_kind):  # the fact tables hold ~110 distinct questions
            if len(seen) == per_kind:
                break
            item = make(rng)
            if item["question"] not in seen:
                seen.add(item["question"])
                items.append(item)
        else:
            raise ValueError(f"{make.__name__}: fewer than {per_kind} distinct questions")
    rng.shuffle(items)
    return [{"id": i, **item} for i, item in enumerate(items)]


def generation_items(seed: int = SEED + 1, count: int = 100) -> list[Item]:
    """``quicsrv_gen``'s items: three solved examples then the question, alternately sums and
    next-in-sequence; the answer is the first line of the continuation."""
    rng = random.Random(seed)
    items: list[Item] = []
    seen: set[str] = set()

    def sum_example() -> tuple[str, str]:
        a, b = rng.randint(1, 30), rng.randint(1, 30)
        return f"Q: What is {a} plus {b}?\nA:", str(a + b)

    def sequence_example() -> tuple[str, str]:
        _, terms, following, _ = _sequence(rng)
        return f"Q: What comes next: {', '.join(terms)}, ...?\nA:", following

    while len(items) < count:
        make = sum_example if len(items) % 2 == 0 else sequence_example
        shots = [make() for _ in range(3)]
        question, answer = make()
        if question in seen or any(q == question for q, _ in shots):
            continue
        seen.add(question)
        prompt = "".join(f"{q} {a}\n" for q, a in shots) + question
        items.append({"id": len(items), "prompt": prompt, "answer": answer})
    return items


def rendered() -> dict[str, str]:
    """The data files' contents, by file name (one JSON object a line)."""
    return {
        name: "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items)
        for name, items in (
            ("quicsrv_mc.jsonl", multiple_choice_items()),
            ("quicsrv_gen.jsonl", generation_items()),
        )
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.eval.make_tasks")
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    stale = []
    for name, text in rendered().items():
        path = DATA / name
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(name)
        else:
            DATA.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"{path}: {text.count(chr(10))} items")
    if stale:
        print(
            f"stale: {', '.join(stale)} (run python -m loadtest.eval.make_tasks)", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
