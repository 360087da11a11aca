"""JSON schemas made grammars: what is refused and where, what is accepted, and (with the model's
vocabulary) that each accepted grammar compiles and matches the JSON its schema allows."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llama_cpp.llama_grammar import json_schema_to_gbnf

from quicsrv.engine import grammar
from quicsrv.engine.grammar import (
    ACCEPTED_NOT_ENFORCED,
    ANNOTATIONS,
    ENFORCED_KEYWORDS,
    GRAMMAR_VERSION,
    JSON_OBJECT,
    MAX_DEPTH,
    MAX_GRAMMAR_NESTING,
    MAX_ITEMS_BOUND,
    MAX_OPTIONAL_PROPERTIES,
    MAX_SCHEMA_BYTES,
    MAX_STRING_LENGTH_BOUND,
    Grammar,
    SchemaRejected,
    check_compiles,
    grammar_for_schema,
)
from tests.engine.grammar_matcher import matches


@pytest.fixture(autouse=True)
def _uncached():
    grammar._grammar_for_text.cache_clear()


def _object(**properties: object) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties)}


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = _object(a=schema)
    return schema


def _deep_list(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def _chain(n: int) -> dict[str, Any]:
    """n definitions, each an object whose one property is the next."""
    defs: dict[str, object] = {f"d{i}": _object(n={"$ref": f"#/$defs/d{i + 1}"}) for i in range(n)}
    return {"$ref": "#/$defs/d0", "$defs": defs | {f"d{n}": {"type": "integer"}}}


A_DEF = {"$defs": {"A": _object(x={"type": "integer"})}}
# A property of a definition's name: upstream's converter would take its rule for the $ref.
ITEM = _object(Item=_object(z={}), x={"$ref": "#/$defs/Item"}) | {
    "$defs": {"Item": {"type": "integer"}}
}
HIJACK = _object(date_time={"enum": ["x"]}, t={"type": "string", "format": "date-time"})

REFUSED = [
    # (schema, path, words of the message)
    ([], "", "JSON object"),
    ({"type": "number", "default": float("nan")}, "", "not JSON"),
    ({"description": "x" * MAX_SCHEMA_BYTES}, "", "over 65536 bytes"),
    ({"default": _deep_list(5000)}, "", "deeper than"),  # too deep for json.dumps itself
    (_nested(MAX_DEPTH // 2), ".".join(["properties", "a"] * 16), f"deeper than {MAX_DEPTH}"),
    (_object(a={"type": "string", "not": {"const": ""}}), "properties.a.not", "'not'"),
    (_object(a={"type": "string", "pattern": "^a$"}), "properties.a.pattern", "pattern"),
    ({"type": "object", "patternProperties": {}}, "patternProperties", "not supported"),
    ({"type": "object", "minProperties": 1}, "minProperties", "not supported"),
    (_object(name={"type": "string", "maxLength": 1001}), "properties.name.maxLength", "1000"),
    ({"type": "string", "minLength": 100_000}, "minLength", "over the 1000"),
    (
        _object(tags={"type": "array", "items": {}, "maxItems": 1001}),
        "properties.tags.maxItems",
        "",
    ),
    ({"type": "array", "items": {}, "minItems": 10**9}, "minItems", "over the 1000"),
    ({"type": "string", "maxLength": True}, "maxLength", "non-negative integer"),
    ({"type": "string", "maxLength": 5.0}, "maxLength", "non-negative integer"),
    ({"type": "string", "minLength": -1}, "minLength", "non-negative integer"),
    ({"type": "string", "minLength": 5, "maxLength": 4}, "minLength", "over maxLength"),
    ({"type": "array", "items": {}, "minItems": 3, "maxItems": 2}, "minItems", "over maxItems"),
    ({"type": "frob"}, "type", "not a JSON Schema type"),
    ({"type": ["string", "string"]}, "type", "distinct"),
    ({"type": []}, "type", "distinct"),
    ({"enum": []}, "enum", "non-empty"),
    ({"type": "integer", "enum": ["a", 1.5]}, "enum", "no value is of the schema's type"),
    ({"type": "string", "const": 3}, "const", "not of the schema's type"),
    ({"enum": ["a"], "maxLength": 3}, "maxLength", "beside enum"),
    (_object(a=True), "properties.a", "schema object"),
    ({"type": "object", "additionalProperties": {"type": "frob"}}, "additionalProperties.type", ""),
    ({"type": "array", "items": {"type": "frob"}}, "items.type", ""),
    ({"type": "object", "properties": {"": {}}}, "properties", "empty property name"),
    ({"type": "object", "properties": {}, "required": ["a"]}, "required", "'a' is not in"),
    ({"type": "object", "required": ["a"]}, "required", "'a' is not in"),
    ({"$ref": "https://example.com/schema.json"}, "$ref", "only local references"),
    ({"$ref": "#"}, "$ref", "only local references"),
    ({"$ref": "#/$defs/Missing", **A_DEF}, "$ref", "names no definition"),
    ({"$ref": 3}, "$ref", "must be a string"),
    (_object(a={"$ref": "#/$defs/A", "type": "object"}) | A_DEF, "properties.a.type", "$ref"),
    ({"anyOf": [{"type": "string"}], "type": "string"}, "type", "beside anyOf"),
    ({"anyOf": [{"type": "string"}], "oneOf": [{"type": "null"}]}, "oneOf", "beside anyOf"),
    ({"anyOf": []}, "anyOf", "non-empty list"),
    ({"oneOf": {"type": "string"}}, "oneOf", "non-empty list"),
    (_object(a={"type": "object", "$defs": {}}), "properties.a.$defs", "only at the root"),
    (_object(a={"type": "object", "$id": "x"}), "properties.a.$id", "only at the root"),
    ({"$defs": []}, "$defs", "object of schemas"),
    ({"maxLength": 3, "minItems": 1}, "maxLength", "several types (array, string)"),
    ({"type": "string", "format": 3}, "format", "must be a string"),
    ({"allOf": [{"type": "string"}, _object(a={})]}, "allOf.0", "only over object schemas"),
    ({"allOf": [{"anyOf": [_object(a={})]}, _object(b={})]}, "allOf.0", "only over object"),
    ({"allOf": [_object(a={}), _object(a={})]}, "allOf.1", "share a property"),
    (_object(a={}) | {"allOf": [_object(b={})]}, "allOf", "beside properties"),
    (
        {"allOf": [_object(a={}), _object(b={}) | {"additionalProperties": False}]},
        "allOf.1.additionalProperties",
        "only as true",
    ),
    (
        {"allOf": [_object(a={}), _object(b={})], "additionalProperties": False},
        "allOf",
        "beside additionalProperties",
    ),
    ({"type": ["object", "null"], "allOf": [_object(b={})]}, "allOf", "list of types"),
    ({"type": "array", "prefixItems": [{}], "items": [{}]}, "items", "beside prefixItems"),
    ({"type": "array", "items": False, "minItems": 1}, "minItems", "the 0 items"),
    (
        {"type": "array", "prefixItems": [{}], "items": False, "minItems": 2},
        "minItems",
        "the 1 items that items: false leaves",
    ),
    ({"type": "array", "prefixItems": []}, "prefixItems", "non-empty"),
    (
        {"type": "object", "properties": {"a" * 201: {}}, "additionalProperties": True},
        "properties",
        "at most 200 characters",
    ),
    (
        {"type": "object", "properties": {f"p{i}": {} for i in range(MAX_OPTIONAL_PROPERTIES + 1)}},
        "properties",
        "optional properties",
    ),
    (
        _object(
            a={"type": "object", "properties": {f"p{i}": {} for i in range(91)}},
            b={"type": "object", "properties": {f"p{i}": {} for i in range(91)}},
        ),
        "properties.b.properties",
        "fewer in several",
    ),
    (
        _object(
            **{f"s{i}": {"type": "string", "maxLength": MAX_STRING_LENGTH_BOUND} for i in range(40)}
        ),
        "properties.s32",
        "over 262144 bytes",
    ),
    (
        {"$defs": {"B": _object(s={"type": "string", "maxLength": MAX_STRING_LENGTH_BOUND})}}
        | _object(
            **{f"p{i}": {"allOf": [{"$ref": "#/$defs/B"}, _object(t={})]} for i in range(40)}
        ),
        "properties.p31.allOf",
        "over 262144 bytes",
    ),
    (_chain(600), "", "$refs nest too deeply"),
]


@pytest.mark.parametrize(("schema", "path", "words"), REFUSED)
def test_a_refused_schema_names_the_part_refused(schema, path, words):
    with pytest.raises(SchemaRejected) as refused:
        grammar_for_schema(schema)
    assert refused.value.path == path
    assert words in refused.value.message
    assert str(refused.value) == (f"{path}: " if path else "") + refused.value.message


def test_a_schema_just_within_the_size_and_depth_bounds_is_accepted():
    at_size = {"description": "x" * (MAX_SCHEMA_BYTES - len('{"description":""}'))}
    grammar_for_schema(at_size)
    with pytest.raises(SchemaRejected):
        grammar_for_schema({"description": at_size["description"] + "x"})
    grammar_for_schema(_nested(MAX_DEPTH // 2 - 1))  # 31 levels of JSON (33 above)
    grammar_for_schema(_chain(100))


PERSON = {
    "$defs": {
        "Address": {
            "properties": {
                "street": {"maxLength": 40, "title": "Street", "type": "string"},
                "zip": {"description": "5 digits", "title": "Zip", "type": "string"},
            },
            "required": ["street", "zip"],
            "title": "Address",
            "type": "object",
        },
        "Color": {"enum": ["red", "blue"], "title": "Color", "type": "string"},
        "Tree_Node": {
            "properties": {
                "value": {"title": "Value", "type": "integer"},
                "children": {
                    "default": [],
                    "items": {"$ref": "#/$defs/Tree_Node"},
                    "title": "Children",
                    "type": "array",
                },
            },
            "required": ["value"],
            "title": "Tree_Node",
            "type": "object",
        },
    },
    "properties": {
        "name": {"title": "Name", "type": "string"},
        "age": {"maximum": 150, "minimum": 0, "title": "Age", "type": "integer"},
        "email": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
        "address": {"$ref": "#/$defs/Address"},
        "previous": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}], "default": None},
        "tags": {"items": {"type": "string"}, "maxItems": 3, "type": "array", "uniqueItems": True},
        "color": {"$ref": "#/$defs/Color", "default": "red"},
        "kind": {"enum": ["a", "b"], "title": "Kind", "type": "string"},
        "score": {"type": "number", "exclusiveMinimum": 0, "multipleOf": 0.5},
        "anything": {"default": None, "title": "Anything"},
        "tree": {"anyOf": [{"$ref": "#/$defs/Tree_Node"}, {"type": "null"}], "default": None},
        "born": {"type": "string", "format": "date"},
        "pair": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]},
        "extra": {"type": "object", "additionalProperties": {"type": "boolean"}},
        "strict": {"type": "object", "properties": {"a": {}}, "additionalProperties": False},
        "nullable": {"type": ["string", "null"], "maxLength": 5},
        "maybe_kind": {"type": ["string", "null"], "enum": ["x", None, 3]},
        "merged": {"allOf": [{"$ref": "#/$defs/Address"}, _object(note={"type": "string"})]},
        "one": {"oneOf": [_object(t={"const": "a"}), _object(t={"const": "b"})]},
        "mail": {"type": "string", "format": "email"},
        "uuid": {"type": "string", "format": "uuid"},
        "dated": {"type": "string", "format": "date-time", "maxLength": 40},
    },
    "required": ["name", "age", "address", "kind"],
    "title": "Person",
    "type": "object",
    "$schema": "https://json-schema.org/draft/2020-12/schema",
}

ACCEPTED = [
    {},
    {"type": "object"},
    {"type": "string", "maxLength": MAX_STRING_LENGTH_BOUND},
    {"type": "string", "minLength": MAX_STRING_LENGTH_BOUND},
    {"type": "array", "items": {"type": "integer"}, "maxItems": MAX_ITEMS_BOUND},
    {"type": "array", "items": {"type": "integer"}, "minItems": MAX_ITEMS_BOUND},
    {"enum": ['a"b', "c\\d", "e\nf", "é", 1, None, [1], {"k": "v"}]},
    {"const": {"$ref": "#/not/a/ref"}},
    HIJACK,
    ITEM,
    {"type": "array", "items": [{"type": "string"}, {"type": "boolean"}]},
    {"type": "array", "prefixItems": [{"type": "string"}], "items": False, "minItems": 1},
    {"$ref": "#/definitions/A", "definitions": {"A": {"type": "integer"}}},
    _object(**{"a b": _object(x={}), "a_b": _object(y={}), "root": _object(z={}), 'q"': {}}),
    PERSON,
]


@pytest.mark.parametrize("schema", ACCEPTED)
def test_an_accepted_schema_has_a_grammar(schema):
    made = grammar_for_schema(schema)
    assert made.kind == "json_schema"
    assert "\nroot ::= " in f"\n{made.gbnf}"
    assert len(made.digest) == 32


def test_pydantic_models_are_accepted():
    pydantic = pytest.importorskip("pydantic")

    class Node(pydantic.BaseModel):  # recursive at the root: the schema is a bare $ref
        value: int
        children: list[Node] = []

    class Order(pydantic.BaseModel):
        id: int = pydantic.Field(ge=1)
        note: str | None = pydantic.Field(default=None, max_length=200)
        lines: list[Node] = pydantic.Field(max_length=10)

    assert Node.model_json_schema()["$ref"] == "#/$defs/Node"
    assert "ref-Node" in grammar_for_schema(Node.model_json_schema()).gbnf
    assert "ref-Node" in grammar_for_schema(Order.model_json_schema()).gbnf


def test_what_is_accepted_but_not_enforced_leaves_the_grammar_as_it_was():
    plain = _object(n={"type": "integer"}, s={"type": "string"}, xs={"type": "array", "items": {}})
    loose = _object(
        n={"type": "integer", "minimum": 0, "maximum": 9, "exclusiveMinimum": -1, "multipleOf": 3},
        s={"type": "string", "format": "email", "exclusiveMaximum": 4},
        xs={"type": "array", "items": {}, "uniqueItems": True},
    )
    assert {"minimum", "format", "uniqueItems"} <= ACCEPTED_NOT_ENFORCED
    assert grammar_for_schema(loose) == grammar_for_schema(plain)
    # A format beside a bound is dropped, not refused; alone, date and the like are enforced.
    both = {"type": "string", "format": "date", "maxLength": 9}
    assert grammar_for_schema(both) == grammar_for_schema({"type": "string", "maxLength": 9})
    assert "date ::=" in grammar_for_schema({"type": "string", "format": "date"}).gbnf


def test_annotations_are_ignored():
    bare = _object(a={"type": "integer"})
    annotated = _object(
        a={"type": "integer", "title": "A", "description": "an a", "default": 1, "examples": [2]}
    ) | {"title": "T", "$comment": "c", "$id": "https://example.com/t", "deprecated": False}
    assert {"title", "description", "default", "examples"} <= ANNOTATIONS
    assert grammar_for_schema(annotated) == grammar_for_schema(bare)
    # Annotations alone enforce nothing: any JSON value (the converter itself would crash).
    assert grammar_for_schema({"title": "Anything"}) == grammar_for_schema({})


def test_the_keyword_lists_do_not_overlap():
    assert not ENFORCED_KEYWORDS & ACCEPTED_NOT_ENFORCED
    assert not (ENFORCED_KEYWORDS | ACCEPTED_NOT_ENFORCED) & ANNOTATIONS
    assert "pattern" not in ENFORCED_KEYWORDS | ACCEPTED_NOT_ENFORCED | ANNOTATIONS


def test_the_digest_names_the_grammar_not_the_spelling_of_the_schema():
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {"a": {"type": "string", "maxLength": 5}, "b": {"type": "integer"}},
        "required": ["a"],
    }
    reordered = {
        "required": ["a"],
        "properties": {"a": {"maxLength": 5, "type": "string"}, "b": {"type": "integer"}},
        "type": "object",
    }
    made = grammar_for_schema(schema)
    assert grammar_for_schema(reordered).digest == made.digest
    assert grammar_for_schema(schema | {"title": "renamed"}).digest == made.digest
    changed = json.loads(json.dumps(schema))
    changed["properties"]["a"]["maxLength"] = 6
    assert grammar_for_schema(changed).digest != made.digest
    # The grammar writes properties in the schema's order, so that order is part of it.
    both = schema | {"required": ["a", "b"]}
    swapped = both | {"properties": dict(reversed(schema["properties"].items()))}
    assert grammar_for_schema(swapped).digest != grammar_for_schema(both).digest
    assert made.digest == grammar._grammar(made.gbnf, "json_schema").digest
    assert made.digest != grammar._grammar(made.gbnf + "\n", "json_schema").digest
    assert GRAMMAR_VERSION.startswith("quicsrv-grammar/1 llama-cpp-python ")


def test_a_schema_is_converted_once_and_kept_whatever_the_caller_does_with_it():
    schema = _object(a={"type": "integer"})
    first = grammar_for_schema(schema)
    schema["properties"]["a"]["type"] = "string"
    assert grammar_for_schema(_object(a={"type": "integer"})) is first
    assert grammar_for_schema(schema) != first


def test_json_object_mode_is_any_object():
    assert JSON_OBJECT.kind == "json_object"
    assert "root ::= object" in JSON_OBJECT.gbnf
    assert JSON_OBJECT.digest == grammar_for_schema({"type": "object"}).digest


def test_huge_bounds_are_refused_before_the_converter_runs(monkeypatch):
    def never(*args):
        raise AssertionError("the converter ran")

    monkeypatch.setattr(grammar.Converter, "visit", never)
    for schema in (
        {"type": "string", "maxLength": 100_000},
        {"type": "array", "items": {}, "maxItems": 100_000},
        _object(**{f"s{i}": {"type": "string", "maxLength": 1000} for i in range(40)}),
    ):
        with pytest.raises(SchemaRejected, match="over") as refused:
            grammar_for_schema(schema)
        assert "converter" not in refused.value.message


@pytest.mark.parametrize(
    "failure",
    [AssertionError("Unrecognized schema"), KeyError("#/$defs/X"), RecursionError(), TypeError()],
)
def test_a_converter_failure_is_a_refusal(monkeypatch, failure):
    def fail(*args):
        raise failure

    monkeypatch.setattr(grammar.Converter, "visit", fail)
    with pytest.raises(SchemaRejected) as refused:
        grammar_for_schema({"type": "string"})
    assert refused.value.path == ""
    assert type(failure).__name__ in refused.value.message or "nest" in refused.value.message


def test_the_grammar_itself_is_bounded_after_converting(monkeypatch):
    wide = _object(**{f"p{i}": {"type": "integer"} for i in range(300)})  # linear, 300 rules
    assert len(grammar_for_schema(wide).gbnf) > 16_000
    grammar._grammar_for_text.cache_clear()
    monkeypatch.setattr(grammar, "MAX_GRAMMAR_BYTES", 16_000)
    with pytest.raises(SchemaRejected, match="over 16000 bytes"):
        grammar_for_schema(wide)
    monkeypatch.setattr(grammar, "MAX_GRAMMAR_RULES", 200)
    monkeypatch.setattr(grammar, "MAX_GRAMMAR_BYTES", 1 << 20)
    with pytest.raises(SchemaRejected, match="over 200 rules"):
        grammar_for_schema(wide)


def test_a_hand_made_grammar_is_checked_before_llama_cpp_sees_it():
    # llama.cpp's parser recurses on nested groups and segfaults at about 20,000.
    deep = Grammar("root ::= " + "(" * 30_000 + '"a"' + ")" * 30_000, bytes(32))
    with pytest.raises(SchemaRejected, match=f"over {MAX_GRAMMAR_NESTING} groups"):
        check_compiles(deep, None)  # type: ignore[arg-type]  # refused before llama.cpp
    with pytest.raises(SchemaRejected, match="NUL"):
        check_compiles(Grammar('root ::= "a"\0 | "b"', bytes(32)), None)  # type: ignore[arg-type]
    with pytest.raises(SchemaRejected, match="bytes"):
        too_long = Grammar('root ::= "' + "a" * (1 << 18) + '"', bytes(32))
        check_compiles(too_long, None)  # type: ignore[arg-type]
    # Parentheses in literals, classes and comments are not groups.
    grammar._check_gbnf('root ::= "' + "(" * 5000 + '" [(((] # ' + "(" * 5000 + '\nx ::= "\\"("')


def test_the_converter_is_fixed_where_it_writes_other_json_than_the_schemas():
    strings = grammar_for_schema({"type": "string"}).gbnf
    # No raw control characters, and no escape but the ones json.dumps writes.
    assert r'char ::= [^"\\\x00-\x1F] | "\\" (["\\bfnrt] | "u00" (' in strings
    quoted = grammar_for_schema({"enum": ['a"b', "c\\d"]}).gbnf
    assert r'"\"a\\\"b\""' in quoted and r'"\"c\\\\d\""' in quoted
    assert 'date-time ::= date "T" time' in grammar_for_schema(HIJACK).gbnf
    assert "ref-Item ::= integer" in grammar_for_schema(ITEM).gbnf  # not the property's rule
    assert "Tree_Node" not in grammar_for_schema(PERSON).gbnf  # a reference to no rule


# Schemas with one JSON text each that they allow, written as json.dumps writes it.
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(10**15), 10**15)
    | st.text(st.characters(max_codepoint=0xFFFF, exclude_categories=["Cs"]), max_size=4)
)
_TEXT = st.text(st.characters(max_codepoint=0xFFFF, exclude_categories=["Cs"]), max_size=6)


def _leaves() -> st.SearchStrategy[tuple[dict[str, object], object]]:
    bounded = st.tuples(st.integers(0, 4), st.integers(0, 4)).flatmap(
        lambda b: st.text(
            st.characters(max_codepoint=0xFFFF, exclude_categories=["Cs"]),
            min_size=b[0],
            max_size=b[0] + b[1],
        ).map(lambda s: ({"type": "string", "minLength": b[0], "maxLength": sum(b)}, s))
    )
    enums = st.lists(_SCALARS, min_size=1, max_size=4, unique_by=json.dumps).flatmap(
        lambda values: st.sampled_from(values).map(lambda v: ({"enum": values}, v))
    )
    return st.one_of(
        _TEXT.map(lambda s: ({"type": "string"}, s)),
        st.integers(-(10**15), 10**15).map(lambda n: ({"type": "integer"}, n)),
        st.integers(-400, 400).map(lambda n: ({"type": "number"}, n / 8)),
        st.booleans().map(lambda b: ({"type": "boolean"}, b)),
        st.just(({"type": "null"}, None)),
        st.sampled_from([None, 0, "x", [1, "y"], {"k": [True]}]).map(lambda v: ({}, v)),
        _SCALARS.map(lambda v: ({"const": v}, v)),
        bounded,
        enums,
        (st.none() | _TEXT.filter(lambda text: len(text) <= 3)).map(
            lambda v: ({"type": ["string", "null"], "maxLength": 3, "title": "t"}, v)
        ),
    )


@st.composite
def _objects(draw, inner):
    fields = draw(
        st.dictionaries(_TEXT.filter(lambda name: name not in ("", "*")), inner, max_size=4)
    )
    required = [name for name in fields if draw(st.booleans())]
    present = [name for name in fields if name in required or draw(st.booleans())]
    schema = {"type": "object", "properties": {n: s for n, (s, _) in fields.items()}}
    if required:
        schema["required"] = required
    # The converter writes the required properties first, then the others, each in order.
    order = [n for n in fields if n in required] + [n for n in present if n not in required]
    return schema, {n: fields[n][1] for n in order}


@st.composite
def _arrays(draw, inner):
    item, value = draw(inner)
    low = draw(st.integers(0, 2))
    high = low + draw(st.integers(0, 2))
    n = draw(st.integers(low, high))
    return {"type": "array", "items": item, "minItems": low, "maxItems": high}, [value] * n


@st.composite
def _unions(draw, inner):
    alternatives = draw(st.lists(inner, min_size=1, max_size=3))
    _, value = draw(st.sampled_from(alternatives))
    keyword = draw(st.sampled_from(["anyOf", "oneOf"]))
    return {keyword: [s for s, _ in alternatives]}, value


@st.composite
def _maps_and_tuples(draw, inner):
    if draw(st.booleans()):
        item, value = draw(inner)
        keys = draw(st.lists(_TEXT, max_size=2, unique=True))
        return {"type": "object", "additionalProperties": item}, dict.fromkeys(keys, value)
    members = draw(st.lists(inner, min_size=1, max_size=3))
    schema = {"type": "array", "prefixItems": [s for s, _ in members], "items": False}
    return schema, [v for _, v in members]


@st.composite
def _defined(draw, schemas):
    """The schema as a definition, the root a $ref to it (Pydantic's shape for a recursive
    model): a name with '/' and '~' escaped in the ref."""
    schema, value = draw(schemas)
    name = draw(_TEXT.filter(bool))
    ref = "#/$defs/" + name.replace("~", "~0").replace("/", "~1")
    return {"$defs": {name: schema}, "$ref": ref}, value


_SCHEMAS_AND_VALUES = st.recursive(
    _leaves(),
    lambda inner: st.one_of(
        _objects(inner), _arrays(inner), _unions(inner), _maps_and_tuples(inner)
    ),
    max_leaves=8,
)
SCHEMAS_AND_VALUES = _SCHEMAS_AND_VALUES | _defined(_SCHEMAS_AND_VALUES)


@given(SCHEMAS_AND_VALUES)
def test_generated_schemas_are_accepted(schema_and_value):
    schema, _ = schema_and_value
    assert grammar_for_schema(schema).gbnf


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=3),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(sorted(ENFORCED_KEYWORDS | ACCEPTED_NOT_ENFORCED | ANNOTATIONS))
            | st.sampled_from(["pattern", "not", "string", "object", "$ref", "#/$defs/a", "a"]),
            inner,
            max_size=4,
        )
    ),
    max_leaves=16,
)


@given(_JSON)
def test_anything_is_a_grammar_or_a_refusal(value):
    try:
        grammar_for_schema(value)
    except SchemaRejected:
        pass


# With the model's vocabulary (llama.cpp's grammar sampler): compiling, and matching text.


def _matches(vocab, made: Grammar, text: str) -> bool:
    return matches(vocab, made.gbnf, text)


def _text(value: object) -> str:
    """The JSON text of ``value`` as the grammar spells it (characters raw, not \\u escapes)."""
    return json.dumps(value, ensure_ascii=False)


@pytest.mark.model
@pytest.mark.parametrize("schema", ACCEPTED)
def test_an_accepted_schemas_grammar_compiles(vocab, schema):
    check_compiles(grammar_for_schema(schema), vocab.handle)


@pytest.mark.model
@pytest.mark.parametrize(
    "gbnf",
    [
        "root ::= (",
        'root ::= "a" undefined',
        'start ::= "a"',  # no root
        'root ::= a\na ::= a "x" | "y"',  # left recursion
        "root ::= [a-",
    ],
)
def test_a_broken_grammar_does_not_compile(vocab, gbnf):
    with pytest.raises(SchemaRejected, match="llama.cpp cannot use"):
        check_compiles(Grammar(gbnf, bytes(32)), vocab.handle)


@pytest.mark.model
def test_a_definition_that_is_its_own_first_element_is_refused_by_the_compile(vocab):
    schema = {"$ref": "#/$defs/A", "$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}, {}]}}}
    with pytest.raises(SchemaRejected):
        check_compiles(grammar_for_schema(schema), vocab.handle)


@pytest.mark.model
def test_the_bounds_are_llama_cpps_parser_limit(vocab):
    handle = vocab.handle
    strings = {"type": "string", "maxLength": MAX_STRING_LENGTH_BOUND}
    cases: tuple[tuple[dict[str, Any], str], ...] = (
        (strings, "maxLength"),
        ({"type": "array", "items": strings, "maxItems": MAX_ITEMS_BOUND}, "maxItems"),
    )
    for schema, key in cases:
        check_compiles(grammar_for_schema(schema), handle)
        # One past the bound, written by the unchecked converter: llama.cpp refuses it.
        past = json.dumps(schema | {key: schema[key] + 1})
        with pytest.raises(SchemaRejected):
            check_compiles(Grammar(json_schema_to_gbnf(past), bytes(32)), handle)


@pytest.mark.model
def test_a_grammar_near_the_size_bound_builds_and_compiles_quickly(vocab):
    n = 32  # 32 strings of maxLength 1000: 259 KB of GBNF, just under MAX_GRAMMAR_BYTES
    schema = _object(**{f"s{i}": {"type": "string", "maxLength": 1000} for i in range(n)})
    start = time.perf_counter()
    made = grammar_for_schema(schema)
    check_compiles(made, vocab.handle)
    assert len(made.gbnf) > 250_000
    assert time.perf_counter() - start < 1.0  # about 40 ms here; generous for slow machines


@pytest.mark.model
def test_the_grammar_matches_what_the_schema_allows(vocab):
    made = grammar_for_schema(PERSON)
    person = {  # required properties first, then the others, as the grammar writes them
        "name": 'Ada "the first" \\ Lovelace\n',
        "age": 36,
        "address": {"street": "1 Main St", "zip": "12345"},
        "kind": "a",
        "email": None,
        "tree": {"value": 1, "children": [{"value": 2}]},
        "born": "2024-02-29",
        "nullable": "abcde",
        "maybe_kind": None,
        "merged": {"street": "x", "zip": "y", "note": "z"},
        "dated": "not a date (its maxLength holds)",
    }
    assert _matches(vocab, made, _text(person))
    assert not _matches(vocab, made, _text({k: v for k, v in person.items() if k != "age"}))
    assert not _matches(vocab, made, _text(person | {"kind": "c"}))
    assert not _matches(vocab, made, _text(person | {"nullable": "abcdef"}))
    assert not _matches(vocab, made, _text(person | {"maybe_kind": 3}))  # not a string
    assert not _matches(vocab, made, _text(person | {"born": "yesterday"}))
    # A raw newline in a string is not JSON: the converter's own char rule allowed it.
    assert not _matches(vocab, made, _text(person).replace("\\n", "\n"))
    assert _matches(vocab, JSON_OBJECT, _text(person))
    assert not _matches(vocab, JSON_OBJECT, "[1]")


@pytest.mark.model
def test_the_converters_fixes_hold_in_what_the_grammar_matches(vocab):
    item = grammar_for_schema(ITEM)
    assert _matches(vocab, item, _text({"Item": {"z": 1}, "x": 5}))
    assert not _matches(vocab, item, _text({"Item": {"z": 1}, "x": {"z": 1}}))
    hijack = grammar_for_schema(HIJACK)
    assert _matches(vocab, hijack, _text({"date_time": "x", "t": "2024-01-01T00:00:00Z"}))
    quoted = grammar_for_schema({"enum": ['a"b', "c\\d", "e\nf", "é"]})
    for value in ['a"b', "c\\d", "e\nf", "é"]:
        assert _matches(vocab, quoted, _text(value))
    assert not _matches(vocab, quoted, '"c\\d"')  # the JSON text of c, then a backspace


@pytest.mark.model
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(SCHEMAS_AND_VALUES)
def test_a_generated_schemas_grammar_compiles_and_matches_its_value(vocab, schema_and_value):
    schema, value = schema_and_value
    made = grammar_for_schema(schema)
    check_compiles(made, vocab.handle)
    assert _matches(vocab, made, _text(value)), (made.gbnf, json.dumps(value))
