"""ServerConfig: the only place defaults live, strict parsing, and settings derived from it."""

from __future__ import annotations

import dataclasses
import typing
from enum import Enum
from pathlib import Path
from typing import Any

import pytest

from quicsrv.cli import main
from quicsrv.config import (
    ConfigError,
    CongestionControl,
    CpuExtraBuffers,
    LogFormat,
    OtelExporter,
    ResumeConflict,
    ServerConfig,
)
from quicsrv.engine.llama import EngineSettings
from quicsrv.engine.supervisor import SupervisorSettings
from quicsrv.sessions.settings import FlowSettings, SessionSettings
from quicsrv.settings import (
    engine_settings,
    flow_settings,
    session_settings,
    socket_options,
    supervisor_settings,
)
from quicsrv.transport.sockets import SocketOptions

#: Settings fields ServerConfig does not configure, so they may keep a default of their own.
NOT_CONFIGURED = {
    EngineSettings: {"cpu_extra_buffers"},  # the supervisor decides it per worker start
    SupervisorSettings: {"spool_dir"},
    SessionSettings: {"previous_key_ttl_s"},  # `quicsrv keys rotate --previous-key-ttl`
    FlowSettings: set(),
    SocketOptions: {"dual_stack"},
}


def _derived(config: ServerConfig) -> dict[type, Any]:
    return {
        EngineSettings: engine_settings(config, Path("model.gguf")),
        SupervisorSettings: supervisor_settings(config),
        SessionSettings: session_settings(config),
        FlowSettings: flow_settings(config),
        SocketOptions: socket_options(config),
    }


def _another_value(name: str, kind: Any, default: Any) -> Any:
    """A valid value of field ``name`` unlike its default."""
    if isinstance(kind, type) and issubclass(kind, Enum):
        return next(member for member in kind if member != default)
    if kind is bool:
        return not default
    if kind in (int, float):
        return default * 2 + 1
    if name == "mac_key_hex":
        return "ab" * 32
    if kind is str:
        return f"{default}-changed"
    return Path(f"/elsewhere/{name}")  # Path, and Path | None


def _every_field_changed() -> ServerConfig:
    hints = typing.get_type_hints(ServerConfig)
    changed = {}
    for f in dataclasses.fields(ServerConfig):
        kind = hints[f.name]
        if isinstance(kind, type(Path | None)):
            kind = Path
        changed[f.name] = _another_value(f.name, kind, f.default)
    return ServerConfig(**changed)


@pytest.mark.parametrize("settings_class", list(NOT_CONFIGURED))
def test_derived_settings_have_no_defaults_of_their_own(settings_class: type) -> None:
    defaulted = {
        f.name
        for f in dataclasses.fields(settings_class)
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    }
    assert defaulted <= NOT_CONFIGURED[settings_class]


def test_every_configured_setting_follows_the_config() -> None:
    """Each settings field (but the few ServerConfig does not own) changes when the config
    does: none is a constant or a default of its own in disguise."""
    default, changed = _derived(ServerConfig()), _derived(_every_field_changed())
    for settings_class, unowned in NOT_CONFIGURED.items():
        for f in dataclasses.fields(settings_class):
            # model_path: the caller resolves it (the configured file, else the default model).
            if f.name in unowned or f.name in ("flow", "model_path"):
                continue
            before = getattr(default[settings_class], f.name)
            after = getattr(changed[settings_class], f.name)
            assert before != after, f"{settings_class.__name__}.{f.name} ignores ServerConfig"


@pytest.mark.parametrize(
    ("text", "value"),
    [("true", True), ("Yes", True), ("ON", True), ("1", True)]
    + [("false", False), ("no", False), ("off", False), ("0", False)],
)
def test_booleans_accept_the_usual_words(text: str, value: bool) -> None:
    assert ServerConfig.load(None, udp_pmtu_probe=text).udp_pmtu_probe is value


@pytest.mark.parametrize("text", ["maybe", "", "2", "tru", "enabled"])
def test_any_other_boolean_is_an_error_naming_the_key(text: str) -> None:
    with pytest.raises(ConfigError, match="udp_pmtu_probe"):
        ServerConfig.load(None, udp_pmtu_probe=text)


@pytest.mark.parametrize(
    ("key", "enum"),
    [
        ("cpu_extra_buffers", CpuExtraBuffers),
        ("resume_conflict", ResumeConflict),
        ("log_format", LogFormat),
        ("otel_exporter", OtelExporter),
        ("congestion_control", CongestionControl),
    ],
)
def test_choices_are_enums_and_a_bad_one_lists_them(key: str, enum: type[Enum]) -> None:
    last = list(enum)[-1]
    parsed = getattr(ServerConfig.load(None, **{key: last.value}), key)
    assert parsed is last
    with pytest.raises(ConfigError) as caught:
        ServerConfig.load(None, **{key: "nonsense"})
    message = str(caught.value)
    assert key in message and all(str(m.value) in message for m in enum)


@pytest.mark.parametrize(
    ("key", "value"),
    [("port", "4433x"), ("port", True), ("port", 1.5), ("session_ttl_s", "soon")],
)
def test_numbers_are_checked(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=key):
        ServerConfig.load(None, **{key: value})


@pytest.mark.parametrize("chunk", [0, 505])
def test_a_prefill_chunk_that_cannot_fit_beside_every_slot_is_refused_at_start(chunk: int) -> None:
    config = ServerConfig.load(None, prefill_chunk_tokens=chunk, n_batch=512, n_seq_max=8)
    with pytest.raises(ConfigError, match=r"prefill_chunk_tokens must be in 1\.\.n_batch"):
        config.check()
    ServerConfig.load(None, prefill_chunk_tokens=504, n_batch=512, n_seq_max=8).check()


def test_defaults_then_toml_then_environment_then_overrides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    toml = tmp_path / "quicsrv.toml"
    toml.write_text('port = 5000\nn_threads = 1\nlog_format = "json"\nudp_pmtu_probe = false\n')
    monkeypatch.setenv("QUICSRV_PORT", "6000")
    monkeypatch.setenv("QUICSRV_N_SEQ_MAX", "3")
    config = ServerConfig.load(toml, n_seq_max=4)
    assert config.port == 6000  # the environment beats the file
    assert config.n_threads == 1  # the file beats the default
    assert config.n_seq_max == 4  # an explicit override beats the environment
    assert config.log_format is LogFormat.JSON and config.udp_pmtu_probe is False
    assert config.context_per_sequence == ServerConfig().context_per_sequence


def test_unknown_keys_are_refused(tmp_path: Path) -> None:
    toml = tmp_path / "quicsrv.toml"
    toml.write_text("prot = 5000\n")
    with pytest.raises(ConfigError, match="prot"):
        ServerConfig.load(toml)


def test_serve_turns_a_bad_value_into_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("QUICSRV_UDP_PMTU_PROBE", "maybe")
    assert main(["serve", "--port", "0"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert "cannot serve: udp_pmtu_probe (QUICSRV_UDP_PMTU_PROBE): 'maybe'" in lines[0]
