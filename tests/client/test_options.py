"""The client's values (ClientConfig, SamplingOptions), its error mapping and module layout."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import quicsrv_proto
from quicsrv_client import (
    Client,
    ClientConfig,
    ConnectTimeout,
    NetworkError,
    ProtocolError,
    ReconnectPolicy,
    SamplingOptions,
)
from quicsrv_client._errors import map_exceptions

CLIENT_DIR = Path(__file__).resolve().parents[2] / "client"


def test_keywords_override_the_config_and_none_means_the_default(monkeypatch):
    monkeypatch.setenv("QUICSRV_API_KEY", "from-env")
    base = ClientConfig(connect_timeout_s=3.0, stall_timeout_s=None)
    c = Client("h", 1, config=base, idle_timeout_s=9.0, ca=None, api_key=None)
    assert c.config.connect_timeout_s == 3.0  # from the config
    assert c.config.idle_timeout_s == 9.0  # from the keyword
    assert c.config.ca == Path("certs/ca.pem")
    assert c.api_key == "from-env"
    assert c.stall_timeout_s is None
    assert base.idle_timeout_s == 30.0  # the shared value is untouched
    assert Client("h", 1, api_key="explicit").api_key == "explicit"


def test_config_values_are_checked():
    for bad in (
        {"connect_timeout_s": 0},
        {"read_window_bytes": 10},
        {"ack_delay_s": -1.0},
        {"stall_timeout_s": 0.0},
    ):
        with pytest.raises(ValueError):
            ClientConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Client("h", 1, no_such_setting=1)  # type: ignore[call-arg]
    with pytest.raises(ValueError):
        ReconnectPolicy(max_attempts=0)


def test_sampling_options_become_the_generate_frame():
    creative = SamplingOptions(temperature=0.8, seed=7, stop=["\n\n"])
    frame = creative.replace(max_tokens=5).to_frame(prompt="hi", messages=None, deadline_ms=1500)
    assert frame == quicsrv_proto.Generate(
        prompt="hi",
        max_tokens=5,
        temperature=0.8,
        seed=7,
        stop=("\n\n",),
        deadline_ms=1500,
    )
    assert creative.max_tokens == 128  # replace() made a copy


def test_stream_merges_sampling_and_keywords_without_connecting():
    c = Client("h", 1)
    generation = c.stream("hi", sampling=SamplingOptions(top_k=40), max_tokens=3)
    with pytest.raises(ValueError):
        c.stream("hi", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(TypeError):
        c.stream("hi", tempreature=1.0)  # type: ignore[call-arg]
    assert generation.session_id is None and generation.position is None


def test_map_exceptions_turns_foreign_errors_into_client_errors():
    with pytest.raises(ProtocolError) as caught:
        with map_exceptions():
            raise quicsrv_proto.FrameTooLarge("too big")
    assert caught.value.error_code is quicsrv_proto.ErrorCode.FRAME_TOO_LARGE
    mapping = {
        TimeoutError: lambda exc: ConnectTimeout("slow"),
        OSError: lambda exc: NetworkError(f"down: {exc}"),
    }
    with pytest.raises(ConnectTimeout):
        with map_exceptions(mapping):
            raise TimeoutError
    with pytest.raises(NetworkError, match="down: refused") as caught_network:
        with map_exceptions(mapping):
            raise ConnectionRefusedError("refused")  # an OSError subclass
    assert isinstance(caught_network.value.__cause__, ConnectionRefusedError)
    with pytest.raises(KeyError):  # unlisted types pass unchanged
        with map_exceptions(mapping):
            raise KeyError("x")


def _client_imports(module: Path) -> set[str]:
    tree = ast.parse(module.read_text())
    return {
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
    }


def test_the_client_modules_import_each_other_without_a_cycle():
    graph = {path.stem: _client_imports(path) for path in CLIENT_DIR.glob("_*.py")}
    graph.pop("__init__", None)
    visiting: set[str] = set()
    done: set[str] = set()

    def visit(name: str, trail: tuple[str, ...]) -> None:
        assert name not in visiting, f"import cycle: {' -> '.join((*trail, name))}"
        if name in done:
            return
        visiting.add(name)
        for imported in graph.get(name, ()):
            visit(imported, (*trail, name))
        visiting.discard(name)
        done.add(name)

    for name in graph:
        visit(name, ())
    assert "_client" not in graph["_generation"]
