"""The container image and the compose file, with podman: the image is built (on a base made
from Debian's packages: no registry here), run, streamed into from this host's client, stopped
mid-generation, and a new container on the same volume finishes the stream with exactly an
uninterrupted run's tokens; the compose file's two nodes share a stream through Redis.

Marked ``container``: `make test` leaves them out (a cold run builds the base and the image,
minutes); `.ci/run` runs them as a step of their own (`make test-container`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from quicsrv_client import (
    Client,
    GenerationEnded,
    Reconnected,
    ReconnectPolicy,
    SessionStarted,
    TokenReceived,
)
from quicsrv_proto import EndReason
from tests.deploy.podman import (
    COMPOSE_FILE,
    CONTAINERS_CONF,
    LIMITS,
    build_image,
    ensure_redis_image,
    free_port,
    inspect,
    logs,
    need,
    podman,
    readable_certs,
    volume,
    wait_listening,
)

pytestmark = [
    pytest.mark.container,
    pytest.mark.model,
    pytest.mark.slow,
    pytest.mark.timeout(2400),  # a cold run: the base image, then the image (~6 min compiling)
]

PROMPT = "The three most important inventions of the last century are"
GREEDY = dict(max_tokens=40, ignore_eos=True)
# The reader stays attached while the container is stopped, so the generation must outlast the
# stop: with 28 tokens left it raced `podman stop` (as the compose test did, once, in CI).
OUTLASTS_STOP = dict(max_tokens=240, ignore_eos=True)
CUT_AT = 12  # tokens received when the container is stopped


@pytest.fixture(scope="module")
def image() -> str:
    need("podman")
    return build_image()


@pytest.fixture
def tag() -> str:
    """Names of this test's containers and volumes (removed afterwards)."""
    return f"quicsrv-test-{os.getpid()}"


def test_the_image_hands_over_on_stop_as_a_non_root_user_with_a_volume(image: str) -> None:
    config = inspect("image", image)["Config"]
    assert isinstance(config, dict)
    assert config["StopSignal"] == "SIGTERM"
    assert config["User"] == "10001:10001"
    assert "/var/lib/quicsrv" in config["Volumes"]
    assert {"4433/udp", "4433/tcp"} <= set(config["ExposedPorts"])
    assert config["Entrypoint"] == ["quicsrv"] and config["Cmd"] == ["serve"]
    health = inspect("image", image)["Healthcheck"]
    assert isinstance(health, dict) and "/healthz" in " ".join(health["Test"])
    # The runtime stage has no compiler, and the default model is inside.
    probe = podman(
        "run", "--rm", *LIMITS, "--entrypoint", "sh", image, "-c",
        "command -v cc gcc cmake || true; id -u; "
        "python3 -c 'from quicsrv.engine import default_model_path as d; print(d().is_file())'",
    )  # fmt: skip
    assert probe.split() == ["10001", "True"]


@contextlib.asynccontextmanager
async def _container(
    image: str, name: str, port: int, certs: Path, data: str
) -> AsyncIterator[str]:
    podman(
        "run", "-d", "--name", name, *LIMITS,
        "-p", f"127.0.0.1:{port}:4433/udp", "-p", f"127.0.0.1:{port}:4433/tcp",
        "-v", f"{certs}:/etc/quicsrv/tls:ro", "-v", f"{data}:/var/lib/quicsrv",
        "-e", "QUICSRV_CPU_EXTRA_BUFFERS=off",  # no canary crash and retry: a faster start
        image,
    )  # fmt: skip
    try:
        await wait_listening(name)
        yield name
    finally:
        podman("rm", "-f", "-t", "0", name, check=False)


@pytest.mark.asyncio
async def test_a_stopped_container_hands_over_to_a_new_one_on_the_same_volume(
    image: str, certs, tag: str
) -> None:
    port = free_port()
    policy = ReconnectPolicy(initial_delay_s=0.2, max_delay_s=1.0, max_attempts=200)
    events: list[object] = []
    ids: list[int] = []
    with readable_certs(certs) as tls:
        async with volume(f"{tag}-data") as data, contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(_container(image, f"{tag}-1", port, tls, data))
            async with Client("127.0.0.1", port, ca=certs.ca_cert) as c:
                reference = await c.generate_text(PROMPT, **OUTLASTS_STOP)
            second: asyncio.Task[str] | None = None
            stopped = ""
            async with Client("127.0.0.1", port, ca=certs.ca_cert, reconnect=policy) as c:
                async for event in c.generate(PROMPT, **OUTLASTS_STOP):
                    events.append(event)
                    if isinstance(event, TokenReceived):
                        ids.append(event.token_id)
                        if len(ids) == CUT_AT:
                            # SIGTERM (the image's STOPSIGNAL), waiting for the hand-over.
                            await asyncio.to_thread(podman, "stop", "-t", "30", f"{tag}-1")
                            stopped = logs(f"{tag}-1")
                            second = asyncio.ensure_future(
                                stack.enter_async_context(
                                    _container(image, f"{tag}-2", port, tls, data)
                                )
                            )
            assert second is not None
            await second
    assert ids == list(reference.token_ids)  # every token once, none lost, as uninterrupted
    # The hand-over saved the paused generation's cells: nothing left to replay.
    assert re.search(r"shutdown: 1 generations paused, .* 0 left to replay", stopped), stopped[
        -2000:
    ]
    assert any(isinstance(e, Reconnected) for e in events)
    resumed = [e for e in events if isinstance(e, SessionStarted) and e.resume_path]
    assert resumed[-1].resume_path == "kv-restore"  # the cells were saved on the volume
    end = events[-1]
    assert isinstance(end, GenerationEnded) and end.reason is EndReason.LENGTH


@contextlib.contextmanager
def _compose(
    tag: str, tls: Path, ports: tuple[int, int], image: str, tmp_path: Path
) -> Iterator[list[str]]:
    conf = tmp_path / "containers.conf"
    conf.write_text(CONTAINERS_CONF)
    env = {
        **os.environ,
        "CONTAINERS_CONF": str(conf),
        "QUICSRV_IMAGE": image,
        "REDIS_IMAGE": ensure_redis_image(),
        "QUICSRV_CERTS": str(tls),
        "NODE_A_PORT": str(ports[0]),
        "NODE_B_PORT": str(ports[1]),
    }
    command = ["podman-compose", "-p", tag, "-f", str(COMPOSE_FILE)]

    def run(*args: str) -> None:
        done = subprocess.run(
            [*command, *args], env=env, capture_output=True, text=True, timeout=300, check=False
        )
        assert done.returncode == 0, f"podman-compose {' '.join(args)}:\n{done.stderr[-4000:]}"

    try:
        run("up", "-d", "--no-build")
        yield command
    finally:
        subprocess.run(
            [*command, "down", "-v", "-t", "0"], env=env, capture_output=True, timeout=300
        )
        podman("network", "rm", "-f", f"{tag}_default", check=False)  # podman-compose leaves it


def _compose_container(tag: str, service: str) -> str:
    """podman-compose's name for a service's container."""
    return f"{tag}_{service}_1"


@pytest.mark.asyncio
async def test_compose_a_stream_started_on_one_node_continues_on_the_other(
    image: str, certs, tag: str, tmp_path: Path
) -> None:
    need("podman-compose")
    a_port, b_port = free_port(), free_port()
    ids: list[int] = []
    with readable_certs(certs) as tls, _compose(tag, tls, (a_port, b_port), image, tmp_path):
        for service in ("quicsrv-a", "quicsrv-b"):
            await wait_listening(_compose_container(tag, service))
        async with Client("127.0.0.1", b_port, ca=certs.ca_cert) as c:
            reference = await c.generate_text(PROMPT, **GREEDY)
        on_a = Client("127.0.0.1", a_port, ca=certs.ca_cert)
        await on_a.connect()
        generation = on_a.generate(PROMPT, **GREEDY)
        async for event in generation:
            if isinstance(event, TokenReceived):
                ids.append(event.token_id)
                if len(ids) == CUT_AT:
                    break
        position = generation.position
        assert position is not None
        # The reader goes first, so node a pauses the generation (its 28 tokens left would
        # otherwise race the stop, and a generation finished before it needs no engine on b);
        # then node a stops (SIGTERM: its sessions are handed over to Redis); node b goes on.
        await on_a.close()
        await asyncio.to_thread(podman, "stop", "-t", "30", _compose_container(tag, "quicsrv-a"))
        async with Client("127.0.0.1", b_port, ca=certs.ca_cert) as on_b:
            resumed = on_b.resume_from(position)
            async for event in resumed:
                if isinstance(event, TokenReceived):
                    ids.append(event.token_id)
    assert ids == list(reference.token_ids)
    assert resumed.resume_path in ("kv-restore", "replay")
