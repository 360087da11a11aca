"""Two nodes: quicsrv in two network namespaces, on two addresses, sharing one Redis (on the
host that also runs the client). A generation started on node A, A killed with -9, the client
resumes on node B: identical output.

Topology (made here, removed afterwards; the addresses exist on these veth pairs only)::

    host (client, redis-server)  10.201.1.1/30 <-> 10.201.1.2/30  namespace qs-a-<pid>: quicsrv
                                 10.201.2.1/30 <-> 10.201.2.2/30  namespace qs-b-<pid>: quicsrv
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator

import pytest

from loadtest.netns.certs import issue_certs
from quicsrv_client import Client, GenerationEnded, TokenReceived
from tests.helpers import server_process
from tests.redis_server import redis_server

pytestmark = [pytest.mark.model, pytest.mark.asyncio, pytest.mark.slow]

PROMPT = "The three most important inventions of the last century are"
PARAMS = dict(max_tokens=48, temperature=0.8, top_k=40, seed=21, ignore_eos=True)
NODES = {"a": ("10.201.1.1", "10.201.1.2"), "b": ("10.201.2.1", "10.201.2.2")}
PORT = 4433


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def _namespaces() -> Iterator[dict[str, str]]:
    """One namespace per node, each joined to the host by a veth pair; always torn down."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        if os.environ.get("CI"):
            pytest.fail("iproute2 is not installed (`make system-deps` installs it)")
        pytest.skip("iproute2 (`ip`) is not installed")
    tag = str(os.getpid())
    made: list[str] = []
    try:
        for node, (host_address, node_address) in NODES.items():
            ns, host_if, node_if = f"qs-{node}-{tag}", f"qh{node}{tag}"[:15], f"qn{node}{tag}"[:15]
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "add", host_if, "type", "veth", "peer", "name", node_if, "netns", ns)
            _ip("addr", "add", f"{host_address}/30", "dev", host_if)
            _ip("link", "set", host_if, "up")
            _ip("-n", ns, "addr", "add", f"{node_address}/30", "dev", node_if)
            _ip("-n", ns, "link", "set", node_if, "up")
        yield {node: f"qs-{node}-{tag}" for node in NODES}
    finally:
        for ns in made:  # deleting a namespace deletes its end of the pair, so both ends
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


def _free_tcp_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


async def test_started_on_node_a_killed_resumed_on_node_b(tmp_path):
    with _namespaces() as namespaces:
        certs = issue_certs(tmp_path / "pki", NODES["a"][1], NODES["b"][1])
        host_addresses = " ".join(host for host, _ in NODES.values())
        port = _free_tcp_port(NODES["a"][0])
        with redis_server(bind=host_addresses, port=port) as redis:
            async with contextlib.AsyncExitStack() as stack:
                nodes = {}
                for node, (host_address, node_address) in NODES.items():
                    nodes[node] = await stack.enter_async_context(
                        server_process(
                            certs,  # type: ignore[arg-type]
                            tmp_path / f"node-{node}",
                            PORT,
                            host=node_address,
                            prefix=["ip", "netns", "exec", namespaces[node]],
                            extra=[
                                "--store",
                                f"redis://{host_address}:{redis.port}/0",
                                "--threads",
                                "1",
                            ],
                        )
                    )
                a_process, _ = nodes["a"]
                a, b = NODES["a"][1], NODES["b"][1]
                async with Client(b, PORT, ca=certs.ca_cert) as c:
                    reference = await c.generate_text(PROMPT, **PARAMS)

                ids: list[int] = []
                text: list[str] = []
                on_a = Client(a, PORT, ca=certs.ca_cert)
                await on_a.connect()
                generation = on_a.generate(PROMPT, **PARAMS)
                async for event in generation:
                    if isinstance(event, TokenReceived):
                        ids.append(event.token_id)
                        text.append(event.text)
                        if len(ids) == 20:
                            break
                a_process.send_signal(signal.SIGKILL)
                await asyncio.to_thread(a_process.wait, 30)
                position = generation.position
                await on_a.close()

                async with Client(b, PORT, ca=certs.ca_cert) as on_b:
                    resumed = on_b.resume_from(position)
                    async for event in resumed:
                        if isinstance(event, TokenReceived):
                            ids.append(event.token_id)
                            text.append(event.text)
                        elif isinstance(event, GenerationEnded):
                            text.append(event.text)
    assert resumed.resume_path == "replay"
    assert ids == list(reference.token_ids)
    assert "".join(text) == reference.text
