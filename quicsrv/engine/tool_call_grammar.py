"""Tool calls in a chat template's own syntax: ``<tool_call>`` blocks, made a grammar.

A chat template in the Hermes style (Qwen 2.5/3, Hermes, SmolLM3...) teaches its model to call
a function by writing ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``. The
HTTP layer asks for that answer the way it asks for any constrained one, by a JSON text in
GENERATE's ``json_schema``: an object whose only member is :data:`TOOL_CALL_BLOCKS`, naming the
schema of one call (``{"name", "arguments"}`` objects, as the generic format's), whether several
blocks may follow each other, and whether a text answer is allowed instead. So it is recorded,
digested and replayed like every other grammar (the record keeps the GBNF, the MAC its digest).

The text branch (``tool_choice: "auto"``) is any text that does not start with ``<``: llama.cpp
starts a lazy grammar when ``<tool_call>`` appears; this engine applies one grammar from the
first token, so the choice between text and calls has to be made at the first character. A
text answer under it costs one grammar check per token (sample, then check: the drawn token is
kept when allowed, which any token not starting with ``<`` is).
"""

from __future__ import annotations

import json
import re
from typing import Any

from .grammar import Grammar, SchemaRejected, grammar_for_schema, grammar_of_gbnf

__all__ = [
    "TOOL_CALL_BLOCKS",
    "is_tool_call_blocks",
    "tool_call_blocks_grammar",
    "tool_call_blocks_schema",
]

#: The member of a ``json_schema`` document that asks for ``<tool_call>`` blocks.
TOOL_CALL_BLOCKS = "x-quicsrv-tool-call-blocks"
_SPEC_KEYS = frozenset({"call", "parallel", "text"})
# A GBNF string literal, a character class, or the rule name ``root`` (to be renamed).
_ROOT_NAME = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|(?<![\w-])root(?![\w-])')


def is_tool_call_blocks(document: object) -> bool:
    """Whether a parsed ``json_schema`` asks for tool-call blocks rather than JSON."""
    return isinstance(document, dict) and TOOL_CALL_BLOCKS in document


def tool_call_blocks_grammar(document: dict[str, Any]) -> Grammar:
    """The grammar of ``{TOOL_CALL_BLOCKS: {"call": <schema>, "parallel": bool, "text":
    bool}}``; raises SchemaRejected."""
    spec = document.get(TOOL_CALL_BLOCKS)
    if (
        len(document) != 1
        or not isinstance(spec, dict)
        or set(spec) != _SPEC_KEYS
        or not isinstance(spec["parallel"], bool)
        or not isinstance(spec["text"], bool)
    ):
        raise SchemaRejected(
            "takes only call (a schema), parallel and text (booleans)", TOOL_CALL_BLOCKS
        )
    try:
        call = grammar_for_schema(spec["call"])
    except SchemaRejected as exc:
        path = f"{TOOL_CALL_BLOCKS}.call" + (f".{exc.path}" if exc.path else "")
        raise SchemaRejected(exc.message, path) from None
    # The call's rules keep their names but its root (x- names: no schema's rule has one).
    renamed = _ROOT_NAME.sub(lambda m: "x-call" if m[0] == "root" else m[0], call.gbnf)
    blocks = 'x-block ("\\n" x-block)*' if spec["parallel"] else "x-block"
    rules = [
        "root ::= x-calls | x-text" if spec["text"] else "root ::= x-calls",
        f"x-calls ::= {blocks}",
        'x-block ::= "<tool_call>\\n" x-call "\\n</tool_call>"',
        renamed.strip(),
    ]
    if spec["text"]:
        rules.append("x-text ::= [^<] [^\\x00]*")
    return grammar_of_gbnf("\n".join(rules) + "\n", "tool_call_blocks")


def tool_call_blocks_schema(call: dict[str, Any], *, parallel: bool, text: bool) -> str:
    """The ``json_schema`` text that asks for blocks of calls under ``call``."""
    spec = {"call": call, "parallel": parallel, "text": text}
    return json.dumps({TOOL_CALL_BLOCKS: spec}, separators=(",", ":"))
