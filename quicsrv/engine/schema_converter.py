"""The converter a checked schema is written out by (:mod:`.grammar` checks it first).

It is llama-cpp-python's ``SchemaConverter`` (pinned: ``GRAMMAR_VERSION``) with every rule
rewritten that let the grammar write JSON the schema does not allow. The object, array and
``allOf`` rules follow the logic of llama.cpp's current ``examples/json_schema_to_grammar.py``
(MIT, ggml-org/llama.cpp: optional members each after a comma, additional keys that cannot spell
a declared name, ``true`` as any value), written here again with these differences:

- **One spelling per string.** A string's characters are written as ``json.dumps(...,
  ensure_ascii=False)`` writes them: raw, except ``"``, ``\\`` and the control characters, which
  take json.dumps' escape (``\\n``, ``\\u001f``). No other ``\\u`` escape is allowed, so each
  character of the grammar's ``char`` rule is one code point (``minLength`` counts what JSON
  Schema counts, never a surrogate pair as two) and no lone surrogate is ever written; and a
  key can be told apart from a declared name by its text (llama.cpp's version excludes the
  names' characters one by one, so ``"\\u0061"`` spells ``"a"`` past it, and a name with a quote
  or a backslash breaks its character classes). Constants and property names are written the
  same way.
- **Arrays as JSON Schema reads them.** ``prefixItems`` (or draft 4-7's list ``items``) constrain
  as many items as are there, ``items`` (any value when absent, nothing when ``false``) the
  rest, and ``minItems``/``maxItems`` the count; llama.cpp writes exactly one item per tuple
  schema whatever the bounds say.
- ``allOf`` merges object members only, with ``additionalProperties: true`` honoured; what
  else the members say is refused by the checker rather than dropped.
- ``date-time`` and ``time`` take 1-9 fraction digits (RFC 3339 allows any number; llama.cpp's
  rule takes exactly 3).
"""

from __future__ import annotations

import json
import re
from typing import Any

from llama_cpp.llama_grammar import (
    INVALID_RULE_CHARS_RE,
    PRIMITIVE_RULES,
    RESERVED_NAMES,
    STRING_FORMAT_RULES,
    BuiltinRule,
    SchemaConverter,
    _build_repetition,
)

__all__ = ["MAX_KEY_NAME_CHARS", "Converter", "json_text"]

MAX_KEY_NAME_CHARS = 200
"""Declared property names beside ``additionalProperties`` are at most this long: the rule that
keeps additional keys off them nests one group per character."""

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")

# A string's character, spelled as json.dumps(ensure_ascii=False) spells it: raw, or one of the
# escapes it writes for '"', '\' and the control characters (\b \t \n \f \r short, the others
# \u00xx in lowercase hex). Upstream's also lets raw control characters in (not JSON) and any
# four-hex-digit \u escape (lone surrogates, and a code point counted twice as a surrogate pair).
_RAW_CHARS = r'^"\\\x00-\x1F'  # inside a class: not a quote, a backslash or a control character
_ESCAPE = r'"\\" (["\\bfnrt] | "u00" ([0] [0-7bef] | [1] [0-9a-f]))'
_JSON_CHAR = BuiltinRule(f"[{_RAW_CHARS}] | {_ESCAPE}", [])
# Every escape that rule allows, for a key rule that must leave some of them out.
_ESCAPED = [chr(c) for c in range(0x20)] + ['"', "\\"]
# RFC 3339's time: any number of fraction digits (upstream: exactly 3); 9 (nanoseconds) at most,
# so that a model cannot run on in them.
_TIME = BuiltinRule(
    r'([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] ( "." [0-9]{1,9} )? '
    r'( "Z" | ( "+" | "-" ) ( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] )',
    [],
)
_ARRAY_KEYWORDS = frozenset({"items", "prefixItems", "minItems", "maxItems"})


def json_text(value: object) -> str:
    """The one spelling the grammar allows for a JSON value written whole (a constant, an enum
    value, a property name): json.dumps' with characters raw, a lone surrogate escaped."""
    text = json.dumps(value, ensure_ascii=False)
    return _LONE_SURROGATE.sub(lambda m: f"\\u{ord(m[0]):04x}", text)


def _repetition(item: str, low: int, high: int | None, separator_rule: str | None = None) -> str:
    """Upstream's: ``item`` low to high times (no bound: None), as nested optional groups."""
    text: str = _build_repetition(item, low, high, separator_rule)  # type: ignore[no-untyped-call]
    return text


def _spelling(char: str) -> str:
    return json_text(char)[1:-1]


def _class_char(char: str) -> str:
    """``char`` inside a GBNF character class, as a hex escape (always safe there)."""
    code = ord(char)
    return f"\\u{code:04X}" if code <= 0xFFFF else f"\\U{code:08X}"


class Converter(SchemaConverter):
    """llama-cpp-python's converter, fixed where it writes a grammar other than the schema's for
    input that passed the checks. ``refs`` maps each ``$ref`` to its (checked) definition."""

    def __init__(self, refs: dict[str, dict[str, Any]]) -> None:
        super().__init__(  # type: ignore[no-untyped-call]
            prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False
        )
        # Not upstream's resolve_refs: it rewrites "$ref" keys inside const and default values
        # too, and leaves the definitions under a root $ref unresolved (Pydantic's recursive
        # models fail with a KeyError).
        self._refs = refs
        self._ref_rules: dict[str, str] = {}

    def visit(self, schema: dict[str, Any], name: str) -> str:
        kind = schema.get("type")
        rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
        if kind in (None, "object") and (
            "properties" in schema or schema.get("additionalProperties", True) is not True
        ):
            rule = self._object_rule(
                list(schema.get("properties", {}).items()),
                set(schema.get("required", [])),
                name,
                schema.get("additionalProperties", False),
            )
            return self._add_rule(rule_name, rule)
        if kind in (None, "object") and "allOf" in schema:
            return self._add_rule(rule_name, self._all_of_rule(schema, name))
        if kind == "array" and _ARRAY_KEYWORDS & set(schema):
            return self._add_rule(rule_name, self._array_rule(schema, name))
        visited: str = super().visit(schema, name)  # type: ignore[no-untyped-call]
        return visited

    def _generate_constant_rule(self, value: object) -> str:
        return self._format_literal(json_text(value))

    def _format_literal(self, literal: str) -> str:
        # Upstream escapes quotes and line breaks only, so the backslash of a JSON escape (the
        # value 'a"b' is the text "a\"b") escapes the next character in GBNF instead of itself.
        # Every literal here is json_text output: control characters escaped.
        escaped = literal.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'

    def _add_primitive(self, name: str, rule: BuiltinRule) -> str:
        if rule is PRIMITIVE_RULES["char"]:
            rule = _JSON_CHAR
        elif rule is STRING_FORMAT_RULES["time"]:
            rule = _TIME
        added: str = super()._add_primitive(name, rule)
        return added

    def _add_rule(self, name: str, rule: str) -> str:
        # Upstream keeps names off its built-in rules' before it replaces the characters a name
        # cannot have, so a property "date_time" took the rule "date-time" for its own value and
        # every format: date-time string then used it.
        escaped = INVALID_RULE_CHARS_RE.sub("-", name)
        if escaped != name and escaped in RESERVED_NAMES:
            name = f"{escaped}-"
        added: str = super()._add_rule(name, rule)  # type: ignore[no-untyped-call]
        return added

    def _resolve_ref(self, ref: str) -> str:
        # Upstream names a definition's rule after the ref's last segment, unescaped, and takes
        # any rule already of that name for it: a property of the same name stands in for the
        # definition, and a recursive "My_Model" refers to a rule that does not exist.
        name = self._ref_rules.get(ref)
        if name is None:
            base = INVALID_RULE_CHARS_RE.sub("-", f"ref-{ref.rsplit('/', 1)[-1]}")
            taken = set(self._rules) | set(self._ref_rules.values())
            name, i = base, 0
            while name in taken:
                name, i = f"{base}{i}", i + 1
            self._ref_rules[ref] = name  # before visiting: a recursive reference finds it
            rule = self.visit(self._refs[ref], name)
            if rule != name:  # a primitive's rule ("integer"), shared
                self._rules[name] = rule
        return name

    def _object_rule(
        self,
        properties: list[tuple[str, dict[str, Any]]],
        required: set[str],
        name: str,
        additional: bool | dict[str, Any],
    ) -> str:
        """Declared members in the schema's order, the required ones first; then, when
        ``additional`` allows them, any number of members whose keys are no declared name."""
        prefix = f"{name}-" if name else ""
        members: dict[str, str] = {}  # property name -> its key-value rule
        for key, schema in properties:
            value = self.visit(schema, f"{prefix}{key}")
            members[key] = self._add_rule(
                f"{prefix}{key}-kv",
                f'{self._format_literal(json_text(key))} space ":" space {value}',
            )
        first = [members[key] for key, _ in properties if key in required]
        optional = [(key, members[key]) for key, _ in properties if key not in required]
        extra = None
        if additional is not False:
            value = (
                self.visit(additional, f"{prefix}additional-value")
                if isinstance(additional, dict)
                else self._add_primitive("value", PRIMITIVE_RULES["value"])
            )
            key_rule = self._key_rule([key for key, _ in properties], f"{prefix}additional-k")
            extra = self._add_rule(f"{prefix}additional-kv", f'{key_rule} ":" space {value}')
        # rests[i]: optional[i:] and then the extra members, each after a comma, each optional
        # (llama.cpp's fix: upstream left the comma out before the extra members).
        rests = [f'( "," space {extra} )*' if extra else ""]
        for key, member in reversed(optional):
            rest = f" {self._add_rule(f'{prefix}{key}-rest', rests[-1])}" if rests[-1] else ""
            rests.append(f'( "," space {member} )?{rest}')
        rests.reverse()
        if first:
            body = ' "," space '.join(first) + (f" {rests[0]}" if rests[0] else "")
        else:
            # The first member has no comma: one alternative for each member that can be first.
            starts = [
                f"{member} {self._add_rule(f'{prefix}{key}-rest', rests[i + 1])}"
                if rests[i + 1]
                else member
                for i, (key, member) in enumerate(optional)
            ]
            if extra:
                starts.append(f'{extra} ( "," space {extra} )*')
            body = f"( {' | '.join(starts)} )?" if starts else ""
        return f'"{{" space {body} "}}" space'

    def _key_rule(self, names: list[str], rule_name: str) -> str:
        """A key (a JSON string and its space) that spells none of ``names``: a trie of the
        names' characters, each step either one of them or any other character."""
        if not names:
            return self._add_primitive("string", PRIMITIVE_RULES["string"])
        char = self._add_primitive("char", PRIMITIVE_RULES["char"])
        trie: dict[str, Any] = {}
        for key in names:
            node = trie
            for c in key:
                node = node.setdefault(c, {})
            node[""] = {}  # a name ends here

        def rest(node: dict[str, Any]) -> str:
            steps = [
                f"{self._format_literal(_spelling(c))} {rest(child)}"
                for c, child in sorted(node.items())
                if c
            ]
            steps.append(f"{self._char_except({c for c in node if c}, char)} {char}*")
            group = f"( {' | '.join(steps)} )"
            return group if "" in node else f"{group}?"  # a declared name must go on

        return self._add_rule(rule_name, f'"\\"" {rest(trie)} "\\"" space')

    def _char_except(self, excluded: set[str], char: str) -> str:
        """One character of a string (as ``char`` spells it) that is none of ``excluded``."""
        if not excluded:
            return char
        raw = "".join(_class_char(c) for c in sorted(excluded) if c not in _ESCAPED)
        escaped = [c for c in _ESCAPED if c in excluded]
        if not escaped:
            return f"( [{_RAW_CHARS}{raw}] | {_ESCAPE} )"
        others = [self._format_literal(_spelling(c)) for c in _ESCAPED if c not in excluded]
        return f"( [{_RAW_CHARS}{raw}] | {' | '.join(others)} )"

    def _all_of_rule(self, schema: dict[str, Any], name: str) -> str:
        """The object every member (an object schema, checked) allows: their properties, the
        required ones of each, other members only if one of them says so."""
        properties: list[tuple[str, dict[str, Any]]] = []
        required: set[str] = set()
        additional = schema.get("additionalProperties", False)
        for member in schema["allOf"]:
            if "$ref" in member:
                member = self._refs[member["$ref"]]
            properties.extend(member.get("properties", {}).items())
            required.update(member.get("required", []))
            additional = additional or member.get("additionalProperties", False)
        return self._object_rule(properties, required, name, additional)

    def _array_rule(self, schema: dict[str, Any], name: str) -> str:
        """``"[" ... "]"``: item i under ``prefixItems[i]`` while there is one, then under
        ``items`` (any value when absent, none when false), between minItems and maxItems."""
        prefix = f"{name}-" if name else ""
        items = schema.get("items")
        tuple_schemas = schema.get("prefixItems", items if isinstance(items, list) else [])
        if isinstance(items, list) or items is None:
            items = {} if tuple_schemas else None
        heads = [self.visit(s, f"{prefix}tuple-{i}") for i, s in enumerate(tuple_schemas)]
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        if items is False:
            high = len(heads) if high is None else min(high, len(heads))
        n = len(heads) if high is None else min(len(heads), high)
        # What may follow the first n items (none of them a prefix item).
        if items is False or (high is not None and high <= n):
            body = ""
        else:
            tail = self.visit(items, f"{prefix}item") if items else self._any_value()
            if n == 0:
                body = _repetition(tail, low, high, separator_rule='"," space')
            else:
                more = None if high is None else high - n
                body = _repetition(f'( "," space {tail} )', max(low - n, 0), more)
        # The prefix items from the last back: each optional once minItems is met.
        for i in reversed(range(n)):
            item = heads[i] if i == 0 else f'"," space {heads[i]}'
            body = f"{item} {body}".strip()
            if i >= low:
                body = f"( {body} )?"
        return f'"[" space {body} "]" space'

    def _any_value(self) -> str:
        return self._add_primitive("value", PRIMITIVE_RULES["value"])
