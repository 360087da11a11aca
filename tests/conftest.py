from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from quicsrv.devcerts import DevCertPaths, ensure_dev_certs


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--container",
        action="store_true",
        help="also run the tests marked `container` (podman builds and runs the image: "
        "minutes; `make test-container`)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`make test` leaves the container tests out (deselected, not skipped: nothing is wrong
    with them); `--container` keeps them."""
    if config.getoption("--container"):
        return
    left_out = [item for item in items if item.get_closest_marker("container") is not None]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item.get_closest_marker("container") is None]


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> DevCertPaths:
    return ensure_dev_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="session")
def model_path() -> Path:
    pytest.importorskip("llama_cpp")
    from quicsrv.engine import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def engine(model_path: Path) -> Iterator[object]:
    """The engine as ``quicsrv serve`` runs it: llama.cpp in a supervised worker process,
    started once for the whole session."""
    from quicsrv.engine.supervisor import WorkerEngine
    from quicsrv.settings import engine_settings_for, supervisor_settings_for

    engine = WorkerEngine(
        engine_settings_for(model_path, n_seq_max=8, max_queued=8), supervisor_settings_for()
    )
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def cpu_extra_buffers(engine: object) -> bool:
    """What the worker's canary decided for this machine; in-process engines follow it, so
    the suite never runs llama.cpp's extra buffers (AMX) in the pytest process where they crash.
    """
    from quicsrv.engine.supervisor import WorkerEngine

    assert isinstance(engine, WorkerEngine)
    return engine.cpu_extra_buffers


@pytest.fixture(scope="session")
def redis_instance() -> Iterator[object]:
    """One real ``redis-server`` (Unix socket) for the whole test session."""
    from tests.redis_server import redis_server

    with redis_server() as server:
        yield server


@pytest.fixture
def redis_url(redis_instance: object) -> str:
    """The shared store's URL, emptied for this test."""
    from tests.redis_server import RedisServer

    assert isinstance(redis_instance, RedisServer)
    redis_instance.flush()
    return redis_instance.url
