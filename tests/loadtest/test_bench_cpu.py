"""``python -m loadtest.bench.cpu``'s server specs (the measuring itself is a benchmark)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from loadtest.bench.cpu import ServerSpec, parse_spec


def test_a_spec_names_a_tree_an_ack_delay_and_settings():
    spec = parse_spec("before:tree=/tmp/base,ack_ms=1,QUICSRV_TOKEN_COALESCE_MS=0")
    assert spec == ServerSpec(
        "before", Path("/tmp/base").resolve(), 0.001, {"QUICSRV_TOKEN_COALESCE_MS": "0"}
    )
    assert parse_spec("now") == ServerSpec("now")


@pytest.mark.parametrize("bad", [":tree=/x", "a:tree", "a:colour=red"])
def test_a_bad_spec_is_a_usage_error(bad: str):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_spec(bad)
