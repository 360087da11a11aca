"""Tool calls in the chat template's own syntax, for a template in the Hermes style.

A GGUF whose chat template renders tools and speaks of ``<tool_call>`` (Qwen 2.5/3, Hermes,
SmolLM3 and many more; detected by the engine's vocabulary, ``ModelInfo.tool_call_format``) was
trained to call functions its own way, so it gets that instead of the generic format of
:mod:`.tool_format`:

- the tools go to the template (GENERATE's ``tools``, OpenAI's shape), which lists them in
  its system message; earlier calls are shown as the template shows them
  (:func:`calls_text`: ``<tool_call>`` blocks), tool results as ``role: "tool"`` messages;
- the answer is generated under the grammar of ``<tool_call>\\n{"name": ..., "arguments":
  ...}\\n</tool_call>`` blocks (one, or several with ``parallel_tool_calls``), each call's
  arguments under its function's ``parameters``; with ``tool_choice: "auto"`` a text answer
  may come instead, as any text that does not start with ``<``
  (:mod:`quicsrv.engine.tool_call_grammar` says why);
- :class:`HermesParser` reads text or calls out of the generated text, a pure function of it
  (as :class:`.tool_format.AnswerParser` does for the generic format), so a resumed or
  replayed stream renders the same deltas.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from ..engine.tool_call_grammar import tool_call_blocks_schema
from .tool_format import (
    AnswerParser,
    Function,
    Piece,
    TextDelta,
    ToolFormat,
    call_schema,
    merged_pieces,
)

__all__ = ["HERMES", "HermesParser", "calls_text", "hermes_format"]

#: What ``SessionRecord.api["answer"]`` says of a generation in this format (and the value of
#: ``ModelInfo.tool_call_format`` that asks for it).
HERMES = "hermes"
_OPEN = "<tool_call>"
_CLOSE = "</tool_call>"
_SPACE = frozenset(" \t\n\r")


def hermes_format(
    functions: Sequence[Function], called: Sequence[Function], *, required: bool, parallel: bool
) -> ToolFormat:
    """The Hermes format: every one of ``functions`` shown to the template, calls of one of
    ``called`` (all of them, or the one ``tool_choice`` names) allowed in the answer."""
    listed = [
        {
            "type": "function",
            "function": {
                "name": f.name,
                **({"description": f.description} if f.description else {}),
                "parameters": f.parameters,
            },
        }
        for f in functions
    ]
    return ToolFormat(
        names=tuple(f.name for f in called),
        schema=tool_call_blocks_schema(call_schema(called), parallel=parallel, text=not required),
        prompt="",
        required=required,
        parallel=parallel,
        answer=HERMES,
        template_tools=json.dumps(listed, ensure_ascii=False, separators=(",", ":")),
    )


def calls_text(calls: list[tuple[str, str]]) -> str:
    """An assistant turn's earlier calls, (name, arguments as JSON text), as a Hermes-style
    template shows them (Qwen 2.5's renders ``message.tool_calls`` so): one block each."""
    return "\n".join(
        f'{_OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '
        f"{arguments or '{}'}}}\n{_CLOSE}"
        for name, arguments in calls
    )


class HermesParser:
    """Text in, pieces out, as :class:`.tool_format.AnswerParser` (the same attributes):
    a text answer, or ``<tool_call>`` blocks whose JSON is read by an AnswerParser fed the
    generic format's ``{"tool_calls": [...`` around it.

    Nothing is released while the text so far may still be the start of ``<tool_call>``; a
    text answer is then everything as it comes. After a call's JSON closes, ``</tool_call>``
    and the next block's ``<tool_call>`` are read; anything else ends the answer."""

    def __init__(self) -> None:
        self.kind: str | None = None
        """``"text"`` or ``"calls"`` once the answer's first characters have been read."""
        self.text = ""
        """The text answer released so far."""
        self._calls = AnswerParser()
        self._state = "start"
        self._tag = ""  # a tag being read

    @property
    def calls(self) -> list[tuple[str, str]]:
        """The calls so far: (name, arguments released so far)."""
        return self._calls.calls

    @property
    def done(self) -> bool:
        """The answer is complete (or stopped making sense)."""
        return self._state == "done" or (self._state == "call" and self._calls.done)

    def push(self, text: str) -> list[Piece]:
        """The pieces ``text`` (the next part of the generated text) completes."""
        out: list[Piece] = []
        for char in text:
            out.extend(self._step(char))
        return merged_pieces(out)

    def _step(self, c: str) -> list[Piece]:
        state = self._state
        if state == "text":
            self.text += c
            return [TextDelta(c)]
        if state == "call":
            pieces = self._calls.push(c)
            if self._calls.call_closed:
                self._state, self._tag = "close", ""
            return pieces
        if state == "start":
            self._tag += c
            if self._tag == _OPEN:
                self.kind, self._state = "calls", "call"
                return self._calls.push('{"tool_calls":[')
            if _OPEN.startswith(self._tag):
                return []
            self.kind, self._state = "text", "text"
            self.text, held = self._tag, self._tag
            return [TextDelta(held)]
        if state in ("close", "next"):
            tag = _CLOSE if state == "close" else _OPEN
            if not self._tag and c in _SPACE:
                return []
            self._tag += c
            if self._tag == tag:
                self._tag = ""
                if state == "close":
                    self._state = "next"
                    return []
                self._state = "call"
                return self._calls.push(",")
            if not tag.startswith(self._tag):
                self._state = "done"
        return []
