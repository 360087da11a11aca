"""Structured output: a JSON schema made a llama.cpp grammar (GBNF), or refused with a reason.

A schema comes from a client (OpenAI's ``response_format`` json_schema, a Pydantic model's
``model_json_schema()``, a tool's ``parameters``) and becomes the grammar that masks every token
the engine samples, by llama-cpp-python's own converter. That converter was written for trusted
schemas: it ignores keywords it does not know, fails with bare AssertionErrors and KeyErrors, and
writes ``maxLength: n`` out as n nested groups, which llama.cpp's parser refuses past 1000 and
recurses on until it overflows its stack (a segfault) somewhere past 10,000. So nothing reaches
it unchecked:

- Keywords are an allowlist. :data:`ENFORCED_KEYWORDS` the grammar enforces; :data:`ANNOTATIONS`
  are ignored, as JSON Schema lets a validator ignore them; :data:`ACCEPTED_NOT_ENFORCED` are
  accepted and *not* enforced: a grammar cannot compare numbers or count distinct items, and
  refusing ``minimum`` would refuse every Pydantic ``Field(ge=0)``. ``format`` is the exception
  the converter makes for ``date``, ``time``, ``date-time`` and ``uuid`` (their shape, not the
  calendar), and then only alone: beside another keyword it is not enforced. Everything else is
  refused, ``pattern`` too: the converter translates a regex into rules over the JSON *text*, not
  the string's value (``.`` admits a raw quote, so the output is not even JSON), llama.cpp does
  not parse its ``\\d``, and it asserts on what it cannot read.
- ``oneOf`` is enforced as ``anyOf`` (Pydantic's discriminated unions are disjoint anyway).
- A keyword the converter would drop where it matters (``type`` beside ``anyOf``, an ``allOf``
  member's ``additionalProperties: false``, a ``required`` name without a property) is refused,
  not silently lost.
- Where the grammar is stricter than JSON Schema it is so by choice, and the README lists each
  choice: an object with ``properties`` and no ``additionalProperties`` takes only those (as
  OpenAI's strict mode requires anyway), a schema without ``type`` is read as the type its
  keywords apply to, and a value has one spelling (see :mod:`.schema_converter`).
- Bounds keep the grammar small enough to build and parse in milliseconds: the schema's size and
  depth, each repetition (``maxLength`` and the like, up to llama.cpp's parser limit), the number
  of optional properties (the converter's time is quadratic in them), an estimate of the grammar's
  size before converting and the real size and rule count after.
- ``$ref`` is local only (``#/$defs/...``, ``#/definitions/...``); recursion through an object or
  array works, a definition that is its own first element does not parse (left recursion).

The server compiles each new grammar once against the model's vocabulary (:func:`check_compiles`),
so a schema llama.cpp cannot parse is the client's 400 and never reaches the engine worker.

The converter gets a cleaned copy: only the keywords it is meant to act on, with a schema that
enforces nothing (``{}``, Pydantic's ``Any``) made any JSON value (the converter would make it an
object), a ``type`` list made an ``anyOf`` of its types each with its own keywords, and ``type``
beside ``enum`` or ``const`` applied to the values, a single-member ``allOf`` made its member, and
a ``type`` added where the keywords imply one. :class:`.schema_converter.Converter` rewrites what
the pinned converter gets wrong in what it is given.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import blake3
import llama_cpp

from .schema_converter import MAX_KEY_NAME_CHARS, Converter

__all__ = [
    "ACCEPTED_NOT_ENFORCED",
    "ANNOTATIONS",
    "ENFORCED_KEYWORDS",
    "GRAMMAR_VERSION",
    "JSON_OBJECT",
    "MAX_DEPTH",
    "MAX_GRAMMAR_BYTES",
    "MAX_GRAMMAR_NESTING",
    "MAX_GRAMMAR_RULES",
    "MAX_ITEMS_BOUND",
    "MAX_OPTIONAL_PROPERTIES",
    "MAX_SCHEMA_BYTES",
    "MAX_STRING_LENGTH_BOUND",
    "Grammar",
    "SchemaRejected",
    "check_compiles",
    "grammar_for_schema",
    "grammar_of_gbnf",
]

GRAMMAR_VERSION = f"quicsrv-grammar/1 llama-cpp-python {llama_cpp.__version__}"
"""Part of every digest: another converter (or llama.cpp, which parses the text) may make other
grammars of the same schema, or read the same text differently."""

MAX_SCHEMA_BYTES = 64 * 1024
MAX_DEPTH = 32
"""Nested JSON arrays and objects in the whole schema document."""
MAX_STRING_LENGTH_BOUND = 1000
"""``minLength``/``maxLength`` at most: ``maxLength - minLength`` nested groups is what
llama.cpp's parser refuses past 1000 ("number of rules that are going to be repeated ...
exceeds sane defaults"). At 1000 the grammar builds in 0.1 ms and compiles in 0.4 ms, and
masking the vocabulary costs the same 9-10 ms at the 990th character as at the first."""
MAX_ITEMS_BOUND = 1000
"""``minItems``/``maxItems`` at most: the same parser limit as strings."""
MAX_OPTIONAL_PROPERTIES = 128
"""Upstream's converter took time quadratic in an object's optional properties (900: 0.9 s);
ours is linear (900: 47 ms), and the bound stays for llama.cpp's sake: at an object's first
member every optional property is an alternative its grammar keeps open, so each costs every
token check there. This bounds the sum of their squares over the whole schema, as for one object
of 128 of them."""
MAX_GRAMMAR_BYTES = 256 * 1024
"""GBNF text at most, estimated before converting and checked after; llama.cpp compiles the
largest grammars within it (30 strings of ``maxLength`` 1000) in about 40 ms."""
MAX_GRAMMAR_RULES = 4096
MAX_GRAMMAR_NESTING = 2048
"""Nested parentheses in one rule: llama.cpp's parser recurses on them and overflows an 8 MiB
stack at about 20,000 (a segfault, not an error). The converter nests about 1000 at most."""

ENFORCED_KEYWORDS = frozenset(
    {
        "type",
        "enum",
        "const",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "prefixItems",
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "anyOf",
        "oneOf",
        "allOf",
        "$ref",
        "$defs",
        "definitions",
    }
)
ACCEPTED_NOT_ENFORCED = frozenset(
    {
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "format",
        "uniqueItems",
    }
)
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$comment",
        "$schema",
        "$id",
        "contentEncoding",
        "contentMediaType",
        # OpenAPI's hint for a oneOf; each member's own const on the property enforces it.
        "discriminator",
    }
)

_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
_ANY_VALUE: dict[str, Any] = {"type": ["object", "array", "string", "number", "boolean", "null"]}
_ENFORCED_FORMATS = frozenset(
    {"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"}
)
# The keywords that constrain only values of one type: anywhere else they hold vacuously.
_APPLIES_TO = {
    "minLength": "string",
    "maxLength": "string",
    "format": "string",
    "items": "array",
    "prefixItems": "array",
    "minItems": "array",
    "maxItems": "array",
    "properties": "object",
    "required": "object",
    "additionalProperties": "object",
}
_LOCAL_REF = re.compile(r"#/(\$defs|definitions)/([^/]+)")
_GBNF_PARENS = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*|[()]')


class SchemaRejected(ValueError):
    """A schema this server will not constrain sampling with; ``path`` names the part
    (``properties.name.maxLength``; empty for the whole schema), for the API's 400 ``param``."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.message = message
        self.path = path


@dataclass(frozen=True, slots=True)
class Grammar:
    """GBNF (root rule ``root``) and its digest: BLAKE3 of :data:`GRAMMAR_VERSION` and the text,
    so that equal digests mean the same constraint on sampling."""

    gbnf: str
    digest: bytes
    kind: str = "json_schema"
    """What the client asked for: ``json_schema``, or ``json_object`` (:data:`JSON_OBJECT`)."""


def grammar_for_schema(schema: object) -> Grammar:
    """The grammar of a JSON schema (as parsed JSON); raises SchemaRejected."""
    if not isinstance(schema, dict):
        raise SchemaRejected("a schema must be a JSON object")
    try:
        # Key order kept: the grammar writes properties in the schema's order (a "reasoning"
        # before an "answer" is the point of some schemas), so it is part of the cache key.
        text = json.dumps(schema, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except RecursionError:
        raise SchemaRejected(f"the schema nests deeper than {MAX_DEPTH}") from None
    except (TypeError, ValueError) as exc:
        raise SchemaRejected(f"the schema is not JSON: {exc}") from None
    if len(text.encode(errors="surrogatepass")) > MAX_SCHEMA_BYTES:
        raise SchemaRejected(f"the schema is over {MAX_SCHEMA_BYTES} bytes as JSON")
    return _grammar_for_text(text)


def check_compiles(grammar: Grammar, vocab: llama_cpp.llama_vocab_p) -> None:
    """Raise SchemaRejected unless llama.cpp builds a sampler from the grammar (it parses and
    has no left recursion). llama.cpp writes why it refused to stderr itself."""
    _check_gbnf(grammar.gbnf)
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, grammar.gbnf.encode(), b"root")
    if not sampler:
        raise SchemaRejected(
            "llama.cpp cannot use the schema's grammar (a $ref that is its own first element?)"
        )
    llama_cpp.llama_sampler_free(sampler)


@functools.lru_cache(maxsize=256)
def _grammar_for_text(text: str, kind: str = "json_schema") -> Grammar:
    document = json.loads(text)
    _check_depth(document)
    checked = _Checker(document)
    root = checked.root()
    converter = Converter(checked.refs)
    try:
        # The converter's failures are assertions, KeyErrors and the like, not an API: whatever
        # the checks above missed is the client's 400, never the server's 500.
        root_rule = converter.visit(root, "")
        gbnf = converter.format_grammar()  # type: ignore[no-untyped-call]
    except RecursionError:  # a long chain of definitions, each first met inside the last
        raise SchemaRejected("the schema's $refs nest too deeply") from None
    except Exception as exc:
        raise SchemaRejected(f"the converter failed: {type(exc).__name__}: {exc}"[:300]) from None
    if root_rule != "root" or not isinstance(gbnf, str):
        raise SchemaRejected("the converter made no root rule")
    _check_gbnf(gbnf)
    return _grammar(gbnf, kind)


def grammar_of_gbnf(gbnf: str, kind: str) -> Grammar:
    """A grammar written by hand (by another module), checked for what llama.cpp's parser
    survives and digested like every other; raises SchemaRejected."""
    _check_gbnf(gbnf)
    return _grammar(gbnf, kind)


def _grammar(gbnf: str, kind: str) -> Grammar:
    digest = blake3.blake3(GRAMMAR_VERSION.encode() + b"\n" + gbnf.encode()).digest()
    return Grammar(gbnf, digest, kind)


def _check_gbnf(gbnf: str) -> None:
    # What llama.cpp's parser survives: this is all a hand-made Grammar is checked for, too.
    if len(gbnf.encode()) > MAX_GRAMMAR_BYTES:
        raise SchemaRejected(f"the grammar would be over {MAX_GRAMMAR_BYTES} bytes")
    if gbnf.count("::=") > MAX_GRAMMAR_RULES:
        raise SchemaRejected(f"the grammar would have over {MAX_GRAMMAR_RULES} rules")
    if "\0" in gbnf:  # C would read a prefix of it
        raise SchemaRejected("the grammar has a NUL character")
    parens = (1 if m[0] == "(" else -1 for m in _GBNF_PARENS.finditer(gbnf) if m[0] in "()")
    if max(itertools.accumulate(parens, initial=0)) > MAX_GRAMMAR_NESTING:
        raise SchemaRejected(f"the grammar would nest over {MAX_GRAMMAR_NESTING} groups")


def _check_depth(document: object) -> None:
    pending: list[tuple[object, str, int]] = [(document, "", 1)]
    while pending:
        value, path, depth = pending.pop()
        if isinstance(value, dict):
            items: Any = value.items()
        elif isinstance(value, list):
            items = enumerate(value)
        else:
            continue
        if depth > MAX_DEPTH:
            raise SchemaRejected(f"the schema nests deeper than {MAX_DEPTH}", path)
        pending.extend((child, _at(path, key), depth + 1) for key, child in items)


def _at(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


class _Checker:
    """One walk over a schema: refuses what the converter cannot do right, and returns the
    cleaned copy it gets, with the definitions its ``$ref`` names."""

    def __init__(self, document: dict[str, Any]) -> None:
        self._document = document
        self.refs: dict[str, dict[str, Any]] = {}
        self._definitions: dict[tuple[str, str], dict[str, Any]] = {}
        self._definition_costs: dict[tuple[str, str], int] = {}
        self._uses: list[tuple[str, str]] = []  # ($ref, its path)
        self._later: list[Callable[[], None]] = []  # checks that need every definition
        self._cost = 0  # estimated grammar bytes
        self._optional_squares = 0

    def root(self) -> dict[str, Any]:
        for container in ("$defs", "definitions"):
            definitions = self._document.get(container, {})
            if not isinstance(definitions, dict):
                raise SchemaRejected("must be an object of schemas", container)
            for name, definition in definitions.items():
                before = self._cost
                cleaned = self._schema(definition, _at(container, name))
                self._definitions[container, name] = cleaned
                self._definition_costs[container, name] = self._cost - before
        root = self._schema(self._document, "")
        for ref, path in self._uses:
            self.refs[ref] = self._definitions[self._target(ref, path)]
        for check in self._later:
            check()
        return root

    def _target(self, ref: str, path: str) -> tuple[str, str]:
        match = _LOCAL_REF.fullmatch(ref)
        if match is None:
            raise SchemaRejected(
                "only local references to #/$defs/<name> or #/definitions/<name> are supported",
                path,
            )
        target = match[1], match[2].replace("~1", "/").replace("~0", "~")
        if target not in self._definitions:
            raise SchemaRejected(f"{ref} names no definition", path)
        return target

    def _add_cost(self, cost: int, path: str) -> None:
        self._cost += cost
        if self._cost > MAX_GRAMMAR_BYTES:
            raise SchemaRejected(f"the grammar would be over {MAX_GRAMMAR_BYTES} bytes", path)

    def _schema(self, node: object, path: str) -> dict[str, Any]:
        if not isinstance(node, dict):
            # true/false schemas too: the converter takes every schema for an object.
            raise SchemaRejected("must be a schema object", path)
        kept: dict[str, Any] = {}
        for key, value in node.items():
            where = _at(path, key)
            if key in ANNOTATIONS:
                if key == "$id" and path:  # it would change what "#/..." means below it
                    raise SchemaRejected("$id is supported only at the root", where)
            elif key == "format":
                if not isinstance(value, str):
                    raise SchemaRejected("must be a string", where)
                if value in _ENFORCED_FORMATS:
                    kept[key] = value
            elif key in ACCEPTED_NOT_ENFORCED:
                pass
            elif key == "pattern":
                raise SchemaRejected(
                    "pattern is not supported (the grammar cannot enforce a regex on a JSON "
                    "string's value); describe the format in the description instead",
                    where,
                )
            elif key in ("$defs", "definitions"):
                if path:
                    raise SchemaRejected(f"{key} is supported only at the root", where)
            elif key in ENFORCED_KEYWORDS:
                kept[key] = self._keyword(key, value, where)
            else:
                raise SchemaRejected(f"the keyword {key!r} is not supported", where)
        return self._cleaned(kept, path)

    def _keyword(self, key: str, value: Any, where: str) -> Any:
        if key == "type":
            types = value if isinstance(value, list) else [value]
            if not types or len(set(map(str, types))) < len(types):
                raise SchemaRejected("must be a type or a list of distinct types", where)
            for kind in types:
                if kind not in _TYPES:
                    raise SchemaRejected(f"{kind!r} is not a JSON Schema type", where)
            return value
        if key in ("minLength", "maxLength", "minItems", "maxItems"):
            bound = MAX_STRING_LENGTH_BOUND if key.endswith("Length") else MAX_ITEMS_BOUND
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise SchemaRejected("must be a non-negative integer", where)
            if value > bound:
                raise SchemaRejected(f"is {value}, over the {bound} this server supports", where)
            return value
        if key == "properties":
            if not isinstance(value, dict):
                raise SchemaRejected("must be an object of schemas", where)
            if "" in value:  # its rule would be named "root" and take the root's place
                raise SchemaRejected("an empty property name is not supported", where)
            return {name: self._schema(s, _at(where, name)) for name, s in value.items()}
        if key == "required":
            if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
                raise SchemaRejected("must be a list of property names", where)
            return value
        if key == "additionalProperties":
            return value if isinstance(value, bool) else self._schema(value, where)
        if key == "items":
            if value is False:
                return value
            if value is True:
                return dict(_ANY_VALUE)
            if isinstance(value, list):  # draft 4-7 tuples
                return self._schemas(value, where)
            return self._schema(value, where)
        if key in ("prefixItems", "anyOf", "oneOf", "allOf"):
            return self._schemas(value, where)
        if key == "enum":
            if not isinstance(value, list) or not value:
                raise SchemaRejected("must be a non-empty list", where)
            return value
        if key == "$ref":
            if not isinstance(value, str):
                raise SchemaRejected("must be a string", where)
            self._uses.append((value, where))
            return value
        assert key == "const", key
        return value

    def _schemas(self, value: Any, where: str) -> list[dict[str, Any]]:
        if not isinstance(value, list) or not value:
            raise SchemaRejected("must be a non-empty list of schemas", where)
        return [self._schema(s, _at(where, i)) for i, s in enumerate(value)]

    def _cleaned(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        """``node`` (enforced keywords only) as the converter should get it, or refused."""
        if "format" in node and set(node) - {"format", "type"}:
            # Enforced alone only: beside anything else the converter drops it or what is
            # beside it, and a format is never refused for not being enforced.
            node = {k: v for k, v in node.items() if k != "format"}
        if not node:
            return dict(_ANY_VALUE)
        if set(node) == {"allOf"} and len(node["allOf"]) == 1:
            member: dict[str, Any] = node["allOf"][0]  # already cleaned: the same schema
            return member
        if "enum" in node or "const" in node:
            return self._values(node, path)
        for combinator in ("$ref", "anyOf", "oneOf"):
            if combinator in node:
                others = sorted(set(node) - {combinator})
                if others:
                    hint = "" if combinator == "$ref" else " (move it into each alternative)"
                    raise SchemaRejected(
                        f"is not enforced beside {combinator}{hint}", _at(path, others[0])
                    )
                return node
        kind = node.get("type")
        if kind is None:
            # Read as the type its keywords apply to (JSON Schema would let any other type
            # through unchecked: a model could skip the object it was asked for).
            implied = sorted({_APPLIES_TO[key] for key in node if key in _APPLIES_TO})
            if len(implied) > 1:
                raise SchemaRejected(
                    f"has keywords of several types ({', '.join(implied)}) and no type",
                    _at(path, next(iter(node))),
                )
            if implied:
                kind = implied[0]
                node = {"type": kind} | node
        if isinstance(kind, list):
            if "allOf" in node:
                raise SchemaRejected("is not enforced beside a list of types", _at(path, "allOf"))
            return {
                "anyOf": [
                    self._cleaned(
                        {"type": t} | {k: v for k, v in node.items() if _APPLIES_TO.get(k) == t},
                        path,
                    )
                    for t in kind
                ]
            }
        self._check_object(node, path)
        self._check_array(node, path)
        honoured, makes, beside = self._honoured(node, path)
        for key in node:
            if key not in honoured and _APPLIES_TO.get(key, makes) == makes:
                raise SchemaRejected(f"is not enforced beside {beside}", _at(path, key))
        if "minLength" in node or "maxLength" in node:
            self._add_cost(8 * max(node.get("minLength", 0), node.get("maxLength", 0)), path)
        return node

    def _values(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        # The converter writes the values out and looks at nothing else: a type can filter them.
        extra = sorted(set(node) - {"enum", "const", "type"})
        if extra:
            raise SchemaRejected("is not enforced beside enum or const", _at(path, extra[0]))
        kind = node.get("type")
        types = set(kind if isinstance(kind, list) else [kind] if kind else _TYPES)
        if "const" in node:
            if not types & _types_of(node["const"]):
                raise SchemaRejected("const is not of the schema's type", _at(path, "const"))
            return {"const": node["const"]}
        values = [v for v in node["enum"] if types & _types_of(v)]
        if not values:
            raise SchemaRejected("no value is of the schema's type", _at(path, "enum"))
        return {"enum": values}

    def _check_object(self, node: dict[str, Any], path: str) -> None:
        properties = node.get("properties", {})
        for name in node.get("required", []):
            if name not in properties:
                raise SchemaRejected(f"{name!r} is not in properties", _at(path, "required"))
        if node.get("additionalProperties", False) is not False:
            _check_key_names(properties, _at(path, "properties"))
        optional = len(set(properties) - set(node.get("required", [])))
        self._optional_squares += optional * optional
        if self._optional_squares > MAX_OPTIONAL_PROPERTIES**2:
            raise SchemaRejected(
                f"too many optional properties (at most {MAX_OPTIONAL_PROPERTIES} in one object, "
                "fewer in several)",
                _at(path, "properties"),
            )
        if "allOf" in node:
            self._later.append(lambda: self._check_all_of(node["allOf"], _at(path, "allOf")))

    def _check_all_of(self, members: list[dict[str, Any]], path: str) -> None:
        # The converter merges the members into one object: their properties (no name in two),
        # the required ones of each, other members only where one says additionalProperties:
        # true. Anything else a member says would be dropped, so it is refused.
        seen: dict[str, None] = {}
        for i, member in enumerate(members):
            if set(member) == {"$ref"}:
                target = self._target(member["$ref"], _at(_at(path, i), "$ref"))
                member = self._definitions[target]
                self._add_cost(self._definition_costs[target], path)  # inlined once more
            if member.get("type") != "object" or set(member) - {
                "type",
                "properties",
                "required",
                "additionalProperties",
            }:
                raise SchemaRejected(
                    "allOf is supported only over object schemas (properties, required, "
                    "additionalProperties: true) or $refs to them",
                    _at(path, i),
                )
            if member.get("additionalProperties", True) is not True:
                raise SchemaRejected(
                    "is supported in an allOf member only as true (JSON Schema would apply it "
                    "to the other members' properties too)",
                    _at(_at(path, i), "additionalProperties"),
                )
            properties = member.get("properties", {})
            if seen.keys() & properties.keys():
                raise SchemaRejected("allOf members share a property", _at(path, i))
            seen |= dict.fromkeys(properties)
        if any(member.get("additionalProperties") is True for member in members):
            _check_key_names(seen, path)

    def _check_array(self, node: dict[str, Any], path: str) -> None:
        items = node.get("items")
        if "prefixItems" in node and isinstance(items, list):
            raise SchemaRejected(
                "a list (draft 4-7's tuple) is not supported beside prefixItems", _at(path, "items")
            )
        tuple_items = node.get("prefixItems", items if isinstance(items, list) else [])
        if items is False and node.get("minItems", 0) > len(tuple_items):
            raise SchemaRejected(
                f"is over the {len(tuple_items)} items that items: false leaves",
                _at(path, "minItems"),
            )
        if "minItems" in node or "maxItems" in node:
            bound = max(node.get("minItems", 0), node.get("maxItems", 0))
            self._add_cost((16 + len(path)) * bound, path)  # '("," space <item rule>' each
        for low, high in (("minItems", "maxItems"), ("minLength", "maxLength")):
            if node.get(low, 0) > node.get(high, node.get(low, 0)):
                raise SchemaRejected(f"is over {high}", _at(path, low))

    def _honoured(self, node: Mapping[str, Any], path: str) -> tuple[set[str], str, str]:
        """The keywords the converter acts on in ``node`` (typed by now, unless it is an
        ``allOf``), the type of what it writes, and what it goes by; mirrors
        ``Converter.visit``."""
        kind = node.get("type")
        if kind in (None, "object") and (
            "properties" in node or node.get("additionalProperties", True) is not True
        ):
            beside = "properties" if "properties" in node else "additionalProperties"
            return {"type", "properties", "required", "additionalProperties"}, "object", beside
        if kind in (None, "object") and "allOf" in node:
            # additionalProperties here can only be true: anything else went by properties.
            return {"type", "allOf", "additionalProperties"}, "object", "allOf"
        if kind == "array":
            return {"type", "items", "prefixItems", "minItems", "maxItems"}, "array", "items"
        if kind == "string" and "format" in node:
            return {"type", "format"}, "string", "format"
        if kind == "string":
            return {"type", "minLength", "maxLength"}, "string", "minLength"
        if not isinstance(kind, str):  # only an allOf is left untyped, and it went above
            raise SchemaRejected("has no type the server can tell", path)
        return {"type", "additionalProperties"}, kind, f'"type": "{kind}"'


def _check_key_names(names: Mapping[str, object], path: str) -> None:
    # Additional keys are kept off the declared names by a rule one group deep per character.
    for name in names:
        if len(name) > MAX_KEY_NAME_CHARS:
            raise SchemaRejected(
                f"a property name beside additionalProperties is at most {MAX_KEY_NAME_CHARS} "
                "characters",
                path,
            )


def _types_of(value: object) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"array"} if isinstance(value, list) else {"object"}


JSON_OBJECT = _grammar_for_text('{"type":"object"}', "json_object")
"""OpenAI's ``json_object`` mode: any JSON object (the grammar of ``{"type": "object"}``)."""
