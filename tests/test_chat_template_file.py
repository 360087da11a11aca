"""``chat_template_file``: a template that cannot be read or parsed is refused at start, in one
line that names the key; a good one replaces the GGUF's."""

from __future__ import annotations

from pathlib import Path

import pytest

from quicsrv import app
from quicsrv.config import ServerConfig

HERMES_TEMPLATE = Path(__file__).parent / "http" / "hermes_template.jinja"

pytestmark = pytest.mark.model  # preflight finds the default model


def test_a_missing_template_is_refused_naming_the_key(model_path: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nope.jinja"
    config = ServerConfig(model_path=model_path, chat_template_file=missing)
    problem = app.preflight(config)
    assert problem is not None and problem.startswith("chat_template_file: cannot read")


def test_a_template_that_is_not_jinja_is_refused_saying_where(
    model_path: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{{ m.content }\n")
    problem = app.preflight(ServerConfig(model_path=model_path, chat_template_file=bad))
    assert problem is not None
    assert problem.startswith(f"chat_template_file: {bad} is not a Jinja template")
    assert "line 2" in problem


def test_a_good_template_passes(model_path: Path) -> None:
    config = ServerConfig(model_path=model_path, chat_template_file=HERMES_TEMPLATE)
    assert app.preflight(config) is None
