"""Tool calls: a function's arguments generated under its JSON schema, as OpenAI returns them.

A request that names a function in ``tool_choice`` becomes a constrained generation: the
function's arguments are generated under its ``parameters`` schema. (:class:`CallText` also
reads ``{"name": <one of them>, "arguments": <its parameters>}``, the shape ``required`` had
before the generic format, for records written then.) What the model wrote is turned into the
call as a pure function of the text, so a resumed stream renders the same argument deltas, and
the call's id is derived from the session (``call_<session id>``), so a resume replays the same
id. ``tool_choice: "auto"`` (the model decides whether to call) and ``"required"`` use the
generic format of :mod:`.tool_format`: the tools in the prompt, text or calls in a grammar.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import ApiError
from .hermes_format import HERMES, hermes_format
from .tool_format import Function, ToolFormat, tool_format

__all__ = ["CallText", "ToolChoice", "ToolFormat", "call_id", "parse_tool_choice"]

#: The start of a call among several functions, up to where its arguments begin.
_WRAPPED = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
MAX_TOOLS = 64


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """The functions a generation calls one of."""

    names: tuple[str, ...]
    schema: str
    """The JSON schema (JSON text) its text is generated under."""

    @property
    def single(self) -> str | None:
        """The function's name when there is one to call (its arguments are the whole text)."""
        return self.names[0] if len(self.names) == 1 else None

    def stored(self) -> list[str]:
        """What a session record keeps of it (see :meth:`from_stored`)."""
        return list(self.names)

    @classmethod
    def from_stored(cls, names: Sequence[str]) -> ToolChoice:
        """A choice read back from a session record, to render its call: only the names are
        kept there (its grammar is in the record already)."""
        return cls(tuple(names), "")


def call_id(session_id: bytes, index: int = 0) -> str:
    """Call ``index``'s id: named by the session, so a resume replays the same ids."""
    return "call_" + session_id.hex() + (f"_{index}" if index else "")


def parse_tool_choice(
    tools: object,
    choice: object,
    *,
    parallel: object = None,
    param: str = "tools",
    nested: bool = True,
    native: str | None = None,
) -> ToolChoice | ToolFormat | None:
    """How a request's tools shape its answer: None (no tools, or ``tool_choice: "none"``); a
    :class:`ToolChoice` (a function named: one call of it); a :class:`ToolFormat` (``auto``,
    the default with tools, or ``required``: the generic format, see :mod:`.tool_format`).
    ``parallel``: ``parallel_tool_calls`` (default true, as OpenAI's). ``nested``: chat
    completions' ``{"type": "function", "function": {...}}``; else the Responses API's flat
    ``{"type": "function", "name", "parameters"}``. ``native``: the chat template's own
    tool-call format (:data:`.hermes_format.HERMES`: every choice but ``none`` is then a
    :class:`ToolFormat` in it, a named function its only callable one). Raises ApiError."""
    if parallel is not None and not isinstance(parallel, bool):
        raise _invalid("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise _invalid("tool_choice needs tools", "tool_choice")
        return None
    functions = _functions(tools, param, nested)
    if choice == "none":
        return None
    if native == HERMES:
        listed = list(functions.values())
        if choice in (None, "auto", "required"):
            parallel_calls = parallel is not False
            return hermes_format(
                listed, listed, required=choice == "required", parallel=parallel_calls
            )
        name = _named(choice, nested)
        if name not in functions:
            raise _invalid(
                f"tool_choice names {name!r}, which is not among the tools", "tool_choice"
            )
        return hermes_format(listed, [functions[name]], required=True, parallel=False)
    if choice in (None, "auto", "required"):
        return tool_format(
            list(functions.values()), required=choice == "required", parallel=parallel is not False
        )
    name = _named(choice, nested)
    if name not in functions:
        raise _invalid(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return ToolChoice((name,), _schema({name: functions[name].parameters}))


def _functions(tools: object, param: str, nested: bool) -> dict[str, Function]:
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _invalid(f"{param} must be an array of at most {MAX_TOOLS} functions", param)
    functions: dict[str, Function] = {}
    for i, tool in enumerate(tools):
        where = f"{param}[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ApiError(
                400,
                f"{where}: only function tools are supported",
                code="unsupported_value",
                param=where,
            )
        spec = tool.get("function") if nested else tool
        if not isinstance(spec, dict):
            raise _invalid(f"{where}.function must be an object", where)
        name = spec.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _invalid(f"{where}: a function name is 1-64 of a-z A-Z 0-9 _ -", where)
        if name in functions:
            raise _invalid(f"{where}: two functions are named {name!r}", where)
        parameters = spec.get("parameters")
        if parameters is None:
            parameters = _EMPTY_PARAMETERS
        if not isinstance(parameters, dict):
            raise _invalid(f"{where}.parameters must be a JSON schema object", where)
        description = spec.get("description")
        if description is not None and not isinstance(description, str):
            raise _invalid(f"{where}.description must be a string", where)
        functions[name] = Function(name, description, parameters)
    return functions


def _named(choice: object, nested: bool) -> str:
    if isinstance(choice, dict) and choice.get("type") == "function":
        spec = choice.get("function") if nested else choice
        if isinstance(spec, dict) and isinstance(spec.get("name"), str):
            return str(spec["name"])
    raise _invalid("tool_choice must be none, auto, required or a function by name", "tool_choice")


def _schema(functions: dict[str, dict[str, Any]]) -> str:
    if len(functions) == 1:
        [parameters] = functions.values()
        return json.dumps(parameters, separators=(",", ":"))
    wrapped = [
        {
            "type": "object",
            # name first: the call's name is known before its arguments stream.
            "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, parameters in functions.items()
    ]
    return json.dumps({"anyOf": wrapped}, separators=(",", ":"))


class CallText:
    """Text in, the call out: the function's name (once known) and argument deltas.

    One function: the text is its arguments. Several: the text is ``{"name": ..., "arguments":
    ...}``; the name is known once the prefix up to the arguments has arrived, and the wrapper's
    closing brace is held back until the end (whitespace and braces at the end of the text so
    far may still be the arguments' own).
    """

    def __init__(self, choice: ToolChoice, text_before: str = "") -> None:
        self._single = choice.single
        self.name: str | None = choice.single
        self._text = ""
        self._sent = 0  # argument characters released so far
        self.push(text_before)  # a resumed stream starts where the deltas it skips left off

    def push(self, text: str) -> str:
        """The argument delta that ``text`` (the next piece of the model's text) releases."""
        self._text += text
        if self._single is not None:
            delta = self._text[self._sent :]
            self._sent = len(self._text)
            return delta
        start = self._arguments_start()
        if start is None:
            return ""
        arguments = self._text[start:]
        # Everything but a trailing run that may be the wrapper's closing brace.
        trailing = re.search(r"[\s}]*$", arguments)
        releasable = trailing.start() if trailing else len(arguments)
        delta = arguments[self._sent : releasable]
        self._sent = max(self._sent, releasable)
        return delta

    def finish(self, tail: str) -> str:
        """The last delta, once the text has ended with ``tail``."""
        delta = self.push(tail)
        if self._single is not None:
            return delta
        start = self._arguments_start()
        if start is None:
            return delta
        arguments = self._text[start:].rstrip()
        if arguments.endswith("}"):
            arguments = arguments[:-1].rstrip()  # the wrapper's brace
        rest = arguments[self._sent :]
        self._sent = max(self._sent, len(arguments))
        return delta + rest

    def arguments(self) -> str:
        """All the arguments released so far."""
        start = 0 if self._single is not None else self._arguments_start()
        return "" if start is None else self._text[start:][: self._sent]

    def _arguments_start(self) -> int | None:
        match = _WRAPPED.match(self._text)
        if match is None:
            return None
        if self.name is None:
            try:
                self.name = json.loads('"' + match.group(1) + '"')
            except ValueError:
                self.name = match.group(1)
        return match.end()


def _invalid(message: str, param: str) -> ApiError:
    return ApiError(400, message, code="invalid_value", param=param)
