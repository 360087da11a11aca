"""Tools for any model: the tool list in the prompt, the answer's shape in a grammar.

``tool_choice: "auto"`` (the model decides) and ``"required"`` (it must call) work the way
llama.cpp's server serves a model whose chat template knows no tools (its "generic" format,
``common/chat.cpp``): a system message lists the functions and says how to answer, and the
answer is generated under one JSON schema, so it is always one of

- ``{"response": "<text for the user>"}`` (``auto`` only), or
- ``{"tool_calls": [{"name": "<function>", "arguments": {...}}, ...]}``: one call, or several
  when ``parallel_tool_calls`` is true; each ``arguments`` under its function's ``parameters``.

The prompt and the grammar are part of what the session records (the rendered prompt's tokens
and the grammar's digest are in every checkpoint MAC), and what the client sees — text deltas
or calls with their argument deltas — is taken out of the generated text by
:class:`AnswerParser`, a pure function of that text. So a resumed or replayed stream decides
text or call exactly as the first one did and renders the same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "AnswerParser",
    "ArgumentsDelta",
    "CallStarted",
    "Function",
    "Piece",
    "TextDelta",
    "ToolFormat",
    "calls_text",
    "tool_format",
    "with_tool_prompt",
]

#: What ``SessionRecord.api["answer"]`` says of a generation in this format.
GENERIC = "generic"


@dataclass(frozen=True, slots=True)
class Function:
    """A function tool as the prompt shows it."""

    name: str
    description: str | None
    parameters: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """A request's tools in the generic format: what to add to its prompt and its grammar."""

    names: tuple[str, ...]
    schema: str
    """The JSON schema (JSON text) the answer is generated under."""
    prompt: str
    """The system text that lists the functions and the answer's shape."""
    required: bool
    """The answer is calls only (``tool_choice: "required"``)."""
    parallel: bool
    """Several calls may come in one answer."""
    answer: str = "generic"
    """The answer's format, as the session record names it: :data:`GENERIC`, or
    :data:`.hermes_format.HERMES` (the template's own ``<tool_call>`` blocks)."""
    template_tools: str | None = None
    """The tool list (JSON text, OpenAI's shape) for a template that renders tools (GENERATE's
    ``tools``); None: the tools are in :attr:`prompt`."""


def call_schema(functions: Sequence[Function]) -> dict[str, Any]:
    """The schema of one call of one of ``functions``: ``{"name", "arguments"}``, name
    first (the call is announced, with its name, before its arguments stream)."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": f.name}, "arguments": f.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def tool_format(functions: Sequence[Function], *, required: bool, parallel: bool) -> ToolFormat:
    """The generic format of ``functions`` (at least one)."""
    items = call_schema(functions)
    array: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    call_answer = _object("tool_calls", array)
    schema = call_answer if required else {"anyOf": [call_answer, _object("response", {})]}
    if not required:
        schema["anyOf"][1]["properties"]["response"] = {"type": "string"}
    return ToolFormat(
        names=tuple(f.name for f in functions),
        schema=json.dumps(schema, separators=(",", ":")),
        prompt=_prompt(functions, required=required, parallel=parallel),
        required=required,
        parallel=parallel,
    )


def _object(key: str, value: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {key: value},
        "required": [key],
        "additionalProperties": False,
    }


def _prompt(functions: Sequence[Function], *, required: bool, parallel: bool) -> str:
    """llama.cpp's generic wording, with an example call of the first function: of the wordings
    tried with the default model (30 requests each, half of which a tool could serve), it
    called a tool where one fits most often and made fewest calls where none does; a
    placeholder such as ``<your reply>`` was copied into answers verbatim."""
    listed = []
    for f in functions:
        entry: dict[str, Any] = {"name": f.name}
        if f.description:
            entry["description"] = f.description
        entry["parameters"] = f.parameters
        listed.append(json.dumps(entry, ensure_ascii=False))
    first = functions[0]
    example = json.dumps(
        {"tool_calls": [{"name": first.name, "arguments": "ARGUMENTS"}]}, ensure_ascii=False
    ).replace('"ARGUMENTS"', _example_arguments(first))
    how_many = "one or more calls" if parallel else "exactly one call"
    calls = f"`tool_calls` (a request to call tools: {how_many}), e.g. {example}"
    if required:
        answer = f"Respond in JSON format with {calls}."
    else:
        answer = (
            f"Respond in JSON format, either with {calls}, or with `response` (your reply to "
            'the user\'s request), e.g. {"response": "..."}.'
        )
    return "\n".join(["You have access to these tools:", *listed, "", answer])


def _example_arguments(function: Function) -> str:
    """The function's required parameters (its first three), each valued ``"..."`` or ``...``
    by type: an example of the shape, not of values."""
    parameters = function.parameters if isinstance(function.parameters, dict) else {}
    properties = parameters.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    names = parameters.get("required")
    names = names if isinstance(names, list) else list(properties)
    shown = []
    for name in names[:3]:
        schema = properties.get(name)
        kind = schema.get("type") if isinstance(schema, dict) else None
        shown.append(f"{json.dumps(str(name))}: " + ('"..."' if kind == "string" else "..."))
    return "{" + ", ".join(shown) + "}"


def calls_text(calls: list[tuple[str, str]]) -> str:
    """An assistant turn's earlier calls, (name, arguments as JSON text), as the conversation
    shows them to a model whose template knows no tools: each call as JSON, one a line. Every
    API renders the calls in its history this one way. Not in the answer's own shape
    (``{"tool_calls": [...]}``): shown that, the default model wrote it again after the
    tool's result, call after call (the Agents SDK's loop ran past its max_turns)."""
    return "\n".join(
        f'{{"name": {json.dumps(name)}, "arguments": {arguments or "{}"}}}'
        for name, arguments in calls
    )


def with_tool_prompt(messages: list[dict[str, str]], prompt: str) -> list[dict[str, str]]:
    """``messages`` with the tool prompt added to their system message (a first one is made
    when there is none), as llama.cpp's ``add_system`` does."""
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        text = first["content"] + "\n\n" + prompt if first["content"] else prompt
        return [{"role": "system", "content": text}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def system_text(instructions: str | None, tools: object) -> str | None:
    """The Responses API's system message: its ``instructions``, then the tool prompt when
    ``tools`` is a :class:`ToolFormat` (one message, kept apart from the input's own)."""
    if not isinstance(tools, ToolFormat) or not tools.prompt:  # (the template shows them)
        return instructions
    return tools.prompt if not instructions else instructions + "\n\n" + tools.prompt


def fields(tools: ToolFormat, given: object, choice: object) -> dict[str, Any]:
    """What a Responses record keeps of a request with tools (generic or the template's):
    the answer's format, and the tools and choice it echoes."""
    return {
        "answer": tools.answer,
        "tools": given,
        "tool_choice": choice or "auto",
        "parallel_tool_calls": tools.parallel,
    }


# --- the answer, as it streams -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TextDelta:
    """More of the text answer (the ``response`` string, unescaped)."""

    text: str


@dataclass(frozen=True, slots=True)
class CallStarted:
    """Call ``index`` (0, 1, ...) begins; its function's name is known."""

    index: int
    name: str


@dataclass(frozen=True, slots=True)
class ArgumentsDelta:
    """More of call ``index``'s arguments (JSON text, as generated)."""

    index: int
    text: str


Piece = TextDelta | CallStarted | ArgumentsDelta

_SPACE = frozenset(" \t\n\r")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


class AnswerParser:
    """Text in, pieces out: a character-level state machine over the generated JSON.

    It reads what the grammar allows (whitespace anywhere JSON has it) and stops reading at
    anything else, so no text can make it fail. A ``\\`` escape in the text answer is held back
    until it is whole (a surrogate pair until both halves are there); a call is announced once
    its name's closing quote has arrived, and its arguments are released character by character.
    """

    def __init__(self) -> None:
        self.kind: str | None = None
        """``"text"`` or ``"calls"`` once the answer's key has been read."""
        self.text = ""
        """The text answer released so far."""
        self.calls: list[tuple[str, str]] = []
        """The calls so far: (name, arguments released so far)."""
        self._state = "open"
        self._key = ""  # the answer's key
        self._buffer = ""  # a string being read
        self._escape = ""  # a text escape being read, from its backslash
        self._member = ""  # the call member whose value comes next
        self._named = False  # the call being read has its name (its arguments may come)
        self._depth = 0  # nesting inside a call's arguments
        self._in_string = False
        self._string_escape = False
        self._out: list[Piece] = []

    def push(self, text: str) -> list[Piece]:
        """The pieces ``text`` (the next part of the generated text) completes."""
        for char in text:
            self._step(char)
        out, self._out = self._out, []
        return merged_pieces(out)

    @property
    def done(self) -> bool:
        """The answer's JSON is complete (or stopped making sense)."""
        return self._state == "done"

    @property
    def call_closed(self) -> bool:
        """A call's object has just closed (a comma or the array's end comes next)."""
        return self._state == "after call"

    def _step(self, c: str) -> None:
        state = self._state
        if state == "text":
            self._text_char(c)
        elif state == "arguments":
            self._arguments_char(c)
        elif state in ("key", "call key", "name", "skip"):
            self._string_char(c)
        elif c in _SPACE:
            return
        elif state == "open":
            self._expect(c, "{", "key open")
        elif state == "key open":
            self._expect(c, '"', "key")
        elif state == "colon":
            self._expect(c, ":", "value")
        elif state == "value":
            if self._key == "response" and c == '"':
                self.kind, self._state = "text", "text"
            elif self._key == "tool_calls" and c == "[":
                self.kind, self._state = "calls", "call open"
            else:
                self._state = "done"
        elif state == "call open":
            self._named = False
            self._expect(c, "{", "call key open")
        elif state == "call key open":
            if c == "}":
                self._state = "after call"
            else:
                self._expect(c, '"', "call key")
        elif state == "call colon":
            self._expect(c, ":", "call value")
        elif state == "call value":
            self._call_value(c)
        elif state == "after member":
            if c == ",":
                self._state = "call key open"
            else:
                self._expect(c, "}", "after call")
        elif state == "after call":
            if c == ",":
                self._state = "call open"
            else:
                self._state = "done"  # "]", then the closing brace: nothing more to say
        else:
            self._state = "done"

    def _expect(self, c: str, wanted: str, then: str) -> None:
        self._state = then if c == wanted else "done"

    def _string_char(self, c: str) -> None:
        """A key, a call's name, or a skipped string member (an id), up to its closing quote."""
        state = self._state
        if self._string_escape:
            self._string_escape = False
            self._buffer += "\\" + c
            return
        if c == "\\":
            self._string_escape = True
            return
        if c != '"':
            self._buffer += c
            return
        value, self._buffer = _unescaped(self._buffer), ""
        if state == "key":
            self._key, self._state = value, "colon"
        elif state == "call key":
            self._member, self._state = value, "call colon"
        elif state == "name":
            self._named = True
            self.calls.append((value, ""))
            self._out.append(CallStarted(len(self.calls) - 1, value))
            self._state = "after member"
        else:  # skip
            self._state = "after member"

    def _call_value(self, c: str) -> None:
        if self._member == "name" and c == '"':
            self._state = "name"
        elif self._member == "arguments" and self._named:
            self._state, self._depth = "arguments", 0
            self._in_string = self._string_escape = False
            self._arguments_char(c)
        elif c == '"':
            self._state = "skip"
        else:
            self._state = "done"

    def _arguments_char(self, c: str) -> None:
        """One character of a call's arguments (any JSON value), until the value ends."""
        if self._in_string:
            if self._string_escape:
                self._string_escape = False
            elif c == "\\":
                self._string_escape = True
            elif c == '"':
                self._in_string = False
                if self._depth == 0:
                    self._release(c)
                    self._state = "after member"
                    return
            self._release(c)
            return
        if c in "{[":
            self._depth += 1
        elif c in "}]":
            if self._depth == 0:  # a bare literal ended at its container's bracket
                self._state = "after member"
                self._step(c)
                return
            self._depth -= 1
            if self._depth == 0:
                self._release(c)
                self._state = "after member"
                return
        elif c == '"':
            self._in_string = True
        elif self._depth == 0 and (c == "," or c in _SPACE):
            self._state = "after member"
            self._step(c)
            return
        self._release(c)

    def _release(self, c: str) -> None:
        index = len(self.calls) - 1
        name, arguments = self.calls[index]
        self.calls[index] = (name, arguments + c)
        self._out.append(ArgumentsDelta(index, c))

    def _text_char(self, c: str) -> None:
        if not self._escape:
            if c == "\\":
                self._escape = c
            elif c == '"':
                self._state = "done"  # the text's end: the closing brace follows
            else:
                self._emit_text(c)
            return
        self._escape += c
        decoded, rest = _escape_value(self._escape)
        if decoded is None:
            return  # not whole yet
        self._escape = ""
        self._emit_text(decoded)
        for char in rest:  # what followed a lone high surrogate
            self._text_char(char)

    def _emit_text(self, text: str) -> None:
        if text:
            self.text += text
            self._out.append(TextDelta(text))


#: What stands for a surrogate that is not half of a pair (it is no character: UTF-8 has none).
_REPLACEMENT = "\ufffd"


def _escape_value(escape: str) -> tuple[str | None, str]:
    """What a JSON escape (from its backslash) stands for, and what followed it that is not
    part of it; None while it is not whole yet."""
    if len(escape) < 2:
        return None, ""
    if escape[1] != "u":
        return _ESCAPES.get(escape[1], _REPLACEMENT), ""
    unit = _hex4(escape, 2)
    if unit is None:
        return (None, "") if len(escape) < 6 else (_REPLACEMENT, "")
    if 0xDC00 <= unit < 0xE000:
        return _REPLACEMENT, ""  # a low half without its high one
    if not 0xD800 <= unit < 0xDC00:
        return chr(unit), ""
    # A high surrogate: its low half must follow as \uDC00-\uDFFF.
    tail = escape[6:]
    if not "\\u".startswith(tail[:2]):
        return _REPLACEMENT, tail
    low = _hex4(escape, 8)
    if low is None:
        return (None, "") if len(escape) < 12 else (_REPLACEMENT, tail)
    if not 0xDC00 <= low < 0xE000:
        return _REPLACEMENT, tail
    return chr(0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00)), ""


def _hex4(text: str, start: int) -> int | None:
    digits = text[start : start + 4]
    if len(digits) < 4 or not all(d in "0123456789abcdefABCDEF" for d in digits):
        return None
    return int(digits, 16)


def _unescaped(raw: str) -> str:
    try:
        value = json.loads('"' + raw + '"')
    except ValueError:
        return raw
    return str(value)


def merged_pieces(pieces: list[Piece]) -> list[Piece]:
    """Consecutive deltas of the same kind (and call) joined into one."""
    merged: list[Piece] = []
    for piece in pieces:
        last = merged[-1] if merged else None
        if isinstance(piece, TextDelta) and isinstance(last, TextDelta):
            merged[-1] = TextDelta(last.text + piece.text)
        elif (
            isinstance(piece, ArgumentsDelta)
            and isinstance(last, ArgumentsDelta)
            and last.index == piece.index
        ):
            merged[-1] = ArgumentsDelta(piece.index, last.text + piece.text)
        else:
            merged.append(piece)
    return merged


def parse_answer(text: str) -> AnswerParser:
    """The whole answer ``text``, read."""
    parser = AnswerParser()
    parser.push(text)
    return parser


def stored(api: Mapping[str, Any] | None) -> bool:
    """Whether a session record's ``api`` says its answer is in the generic format."""
    return api is not None and api.get("answer") == GENERIC
