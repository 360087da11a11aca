"""A real ``redis-server`` for the tests: started on a Unix socket in a temporary directory.

No TCP port (so nothing collides with another test run), no persistence (``--save ''``; an
append-only file where a test asks for one), gone with the test session. ``make test`` (and so
CI) installs Debian's ``redis-server`` first; only where it is absent and cannot be installed
do the Redis tests skip, and under CI they fail instead, so a broken install step cannot hide
behind a skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["RedisServer", "redis_server"]


class RedisServer:
    """A running ``redis-server``; ``url`` names it for ``--store``."""

    def __init__(
        self, directory: Path, *, bind: str = "", port: int = 0, append_only: bool = False
    ) -> None:
        self.socket_path = directory / "redis.sock"
        self.bind = bind
        self.port = port if bind else 0
        self._command = [
            _binary(),
            "--port", str(self.port),
            "--unixsocket", str(self.socket_path),
            "--unixsocketperm", "700",
            "--save", "",
            "--dir", str(directory),
            "--daemonize", "no",
        ]  # fmt: skip
        if append_only:
            # Every write on disk before Redis answers it: what it confirmed survives a kill.
            self._command += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            self._command += ["--appendonly", "no"]
        if bind:
            self._command += ["--bind", *bind.split(), "--protected-mode", "no"]
        self.process = self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(
            self._command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.process = process
        self._wait_ready()
        return process

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    def client(self):  # -> redis.Redis
        import redis

        return redis.Redis(unix_socket_path=str(self.socket_path))

    def flush(self) -> None:
        """Empty it between tests."""
        with contextlib.closing(self.client()) as client:
            client.flushall()

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(10)

    def restart(self) -> None:
        """Start it again after :meth:`stop` (same socket, same directory: with
        ``append_only``, the data it confirmed is back)."""
        self._start()

    def _wait_ready(self) -> None:
        import redis

        # Polls the server's own readiness (PING), bounded; not a fixed sleep.
        deadline = time.monotonic() + 20
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}")
            try:
                with contextlib.closing(self.client()) as client:
                    client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)


def _binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed (`make system-deps` installs it)")
        pytest.skip("redis-server is not installed and `make system-deps` could not install it")
    return found


@contextlib.contextmanager
def redis_server(
    *, bind: str = "", port: int = 0, append_only: bool = False
) -> Iterator[RedisServer]:
    """A fresh ``redis-server`` (``bind``: also listen on TCP ``port`` at these addresses;
    ``append_only``: with an AOF fsynced at every write)."""
    pytest.importorskip("redis")
    with tempfile.TemporaryDirectory(prefix="quicsrv-redis-") as scratch:
        server = RedisServer(Path(scratch), bind=bind, port=port, append_only=append_only)
        try:
            yield server
        finally:
            server.stop()
