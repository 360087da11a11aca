"""Every configuration key as a ``QUICSRV_<KEY>`` variable, parsed like the TOML file; walks the
config's fields, so a key added later is covered without a line here."""

from __future__ import annotations

import dataclasses
import re
import typing
from enum import Enum
from pathlib import Path
from typing import Any

import pytest

from quicsrv.cli import _parser
from quicsrv.config import ConfigError, ServerConfig, env_var, unknown_env_vars

FIELDS = dataclasses.fields(ServerConfig)
HINTS = typing.get_type_hints(ServerConfig)
README = Path(__file__).resolve().parents[1] / "README.md"


def _kind(name: str) -> Any:
    kind = HINTS[name]
    args = [k for k in typing.get_args(kind) if k is not type(None)]
    return args[0] if args else kind


def _another_value(name: str) -> tuple[str, Any]:
    """A variable's text for key ``name`` and the value it must give: never the default."""
    kind, default = _kind(name), getattr(ServerConfig(), name)
    if kind is bool:
        return ("no", False) if default else ("yes", True)
    if isinstance(kind, type) and issubclass(kind, Enum):
        other = next(member for member in kind if member != default)
        return str(other.value), other
    if kind is int:
        return str(default + 7), default + 7
    if kind is float:
        return str(default + 0.5), default + 0.5
    if kind is Path:
        return "/srv/quicsrv/elsewhere", Path("/srv/quicsrv/elsewhere")
    if kind is str:
        return "set-by-the-environment", "set-by-the-environment"
    raise AssertionError(f"{name}: a type this test does not know ({kind!r}): add it")


@pytest.mark.parametrize("field", FIELDS, ids=[f.name for f in FIELDS])
def test_every_key_is_set_by_its_variable(field: dataclasses.Field[Any]) -> None:
    text, expected = _another_value(field.name)
    config = ServerConfig.load(None, environ={env_var(field.name): text})
    assert getattr(config, field.name) == expected
    assert type(getattr(config, field.name)) is type(expected)
    others = {f.name for f in FIELDS} - {field.name}
    assert all(getattr(config, o) == getattr(ServerConfig(), o) for o in others)


BAD_TEXT = {int: "12x", float: "soon", bool: "maybe"}


@pytest.mark.parametrize(
    "field",
    [f for f in FIELDS if _kind(f.name) in BAD_TEXT or issubclass(_kind(f.name), Enum)],
    ids=lambda f: f.name,
)
def test_a_bad_variable_is_an_error_naming_key_and_variable(
    field: dataclasses.Field[Any],
) -> None:
    text = BAD_TEXT.get(_kind(field.name), "nonsense")
    with pytest.raises(ConfigError) as caught:
        ServerConfig.load(None, environ={env_var(field.name): text})
    assert str(caught.value).startswith(f"{field.name} ({env_var(field.name)}): {text!r}")


def test_the_environment_sits_between_the_file_and_the_flags(tmp_path: Path) -> None:
    toml = tmp_path / "quicsrv.toml"
    toml.write_text("port = 5000\nn_seq_max = 2\nshutdown_grace_s = 7.5\n")
    environ = {"QUICSRV_PORT": "6000", "QUICSRV_N_SEQ_MAX": "3"}
    config = ServerConfig.load(toml, environ=environ, n_seq_max=4)
    assert (config.port, config.n_seq_max, config.shutdown_grace_s) == (6000, 4, 7.5)


def test_an_empty_variable_for_an_optional_path_means_the_default() -> None:
    config = ServerConfig.load(None, environ={"QUICSRV_MODEL_PATH": ""})
    assert config.model_path is None


def test_variables_naming_no_key_are_reported_not_others() -> None:
    environ = {
        "QUICSRV_PROT": "1",  # a typo of QUICSRV_PORT
        "QUICSRV_PORT": "1",
        "QUICSRV_CONFIG": "/etc/quicsrv.toml",
        "QUICSRV_TEST_FAULT": "",
        "HOME": "/root",
    }
    assert unknown_env_vars(environ) == ["QUICSRV_PROT"]


def test_the_readme_flag_table_names_every_key_and_its_variable() -> None:
    rows = [
        line.split("|")
        for line in README.read_text().splitlines()
        if line.startswith("| ") or line.startswith("| |")
    ]
    # The table under "quicsrv serve": flag | config key | env var | default | meaning.
    table = [cells for cells in rows if len(cells) == 7 and "`QUICSRV_" in cells[3]]
    listed: dict[str, str] = {}
    for cells in table:
        keys = re.findall(r"`([a-z0-9_]+)`", cells[2])
        variables = re.findall(r"`(QUICSRV_[A-Z0-9_]+)`", cells[3])
        assert len(keys) == len(variables), cells
        listed.update(zip(keys, variables, strict=True))
    for f in FIELDS:
        assert listed.get(f.name) == env_var(f.name), f"README's flag table lacks {f.name}"


def test_serve_takes_its_toml_file_from_quicsrv_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    toml = tmp_path / "quicsrv.toml"
    monkeypatch.setenv("QUICSRV_CONFIG", str(toml))
    assert _parser().parse_args(["serve"]).config == toml
    assert _parser().parse_args(["serve", "--config", "other.toml"]).config == Path("other.toml")
