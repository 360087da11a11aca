"""The formats a tool-using answer comes in, by the name its session record keeps
(``api["answer"]``): the generic one (:mod:`.tool_format`) or the template's own
(:mod:`.hermes_format`). Every API reads and renders answers through here, so a resumed
stream parses the text as the first one did."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import hermes_format, tool_format
from .hermes_format import HERMES, HermesParser
from .tool_format import GENERIC, AnswerParser

__all__ = ["AnyParser", "answer_format", "answer_parser", "calls_text", "parse_answer"]

AnyParser = AnswerParser | HermesParser


def answer_format(api: Mapping[str, Any] | None) -> str | None:
    """The answer's format a session record's ``api`` names (None: not a tool answer)."""
    answer = None if api is None else api.get("answer")
    return answer if answer in (GENERIC, HERMES) else None


def answer_parser(answer: str) -> AnyParser:
    """A parser of answers in format ``answer``."""
    return HermesParser() if answer == HERMES else AnswerParser()


def parse_answer(answer: str, text: str) -> AnyParser:
    """The whole answer ``text`` (in format ``answer``), read."""
    parser = answer_parser(answer)
    parser.push(text)
    return parser


def calls_text(answer: str | None, calls: list[tuple[str, str]]) -> str:
    """Earlier calls, (name, arguments as JSON text), as an assistant turn shows them to a
    model whose tools are in format ``answer`` (None: the generic way)."""
    if answer == HERMES:
        return hermes_format.calls_text(calls)
    return tool_format.calls_text(calls)
