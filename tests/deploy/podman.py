"""What the container tests need from podman: a base image made from Debian's packages (this
machine reaches no image registry), the image built from deploy/container/Containerfile with
pip's cached llama-cpp-python wheel when there is one, and containers run with the limits this
machine's podman needs. Everything expensive is cached: the base tarball under
``~/.cache/quicsrv/container``, images in podman's store (a rebuild reuses unchanged layers).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from quicsrv.devcerts import DevCertPaths

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "deploy" / "container" / "Containerfile"
COMPOSE_FILE = ROOT / "deploy" / "compose" / "compose.yaml"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "quicsrv" / "container"
BASE_IMAGE = "localhost/quicsrv-test-base:bookworm"
REDIS_IMAGE = "localhost/quicsrv-test-redis:bookworm"
IMAGE = "localhost/quicsrv:test"
#: This machine's podman: runc (crun is absent) and limits below the host's (the default
#: nproc/nofile are refused inside this sandbox).
PODMAN = ("podman", "--runtime", "runc")
LIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")
#: Containers.conf for podman-compose, which calls podman itself: the same runtime and limits.
CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]
[engine]
runtime = "runc"
"""
DEBIAN_MIRROR = "http://deb.debian.org/debian"


def need(*tools: str) -> None:
    """Skip (fail in CI, which installs them: `make system-deps`) when a tool is missing."""
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        message = f"{', '.join(missing)} not installed (`make system-deps` installs them)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def podman(*args: str, timeout: float = 600, check: bool = True) -> str:
    done = subprocess.run(
        [*PODMAN, *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: {done.returncode}\n{done.stderr[-4000:]}")
    return done.stdout


def logs(name: str) -> str:
    """A container's log, both streams (the server logs to stderr, says "listening" on
    stdout)."""
    done = subprocess.run(
        [*PODMAN, "logs", name], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=60, check=True,
    )  # fmt: skip
    return done.stdout


def image_exists(name: str) -> bool:
    return subprocess.run([*PODMAN, "image", "exists", name], check=False).returncode == 0


def ensure_base_image() -> str:
    """Debian bookworm with python3 (minbase, from Debian's packages), as a podman image."""
    if image_exists(BASE_IMAGE):
        return BASE_IMAGE
    tarball = CACHE / "base.tar"
    if not tarball.is_file():
        need("mmdebstrap")
        CACHE.mkdir(parents=True, exist_ok=True)
        partial = CACHE / "base.tar.partial"
        subprocess.run(
            [
                "mmdebstrap",
                "--variant=minbase",
                "--format=tar",
                "--include=python3,python3-venv,ca-certificates",
                "bookworm",
                str(partial),
                DEBIAN_MIRROR,
            ],
            check=True,
            capture_output=True,
            timeout=900,
        )
        partial.rename(tarball)
    podman("import", str(tarball), BASE_IMAGE)
    return BASE_IMAGE


def ensure_redis_image() -> str:
    """Debian's redis-server on the base image (the compose file's Redis, without a registry)."""
    if not image_exists(REDIS_IMAGE):
        with tempfile.TemporaryDirectory() as context:
            (Path(context) / "Containerfile").write_text(
                f"FROM {ensure_base_image()}\n"
                "RUN apt-get update && apt-get install -y --no-install-recommends redis-server"
                " && rm -rf /var/lib/apt/lists/*\n"
            )
            podman("build", *LIMITS, "-t", REDIS_IMAGE, context)
    return REDIS_IMAGE


def cached_llama_wheel() -> Path | None:
    """pip's cached build of the pinned llama-cpp-python (``make venv`` made it), if any."""
    version = importlib.metadata.version("llama-cpp-python")
    cache = Path(os.environ.get("PIP_CACHE_DIR", Path.home() / ".cache" / "pip"))
    found = sorted(cache.glob(f"wheels/**/llama_cpp_python-{version}-*.whl"))
    return found[-1] if found else None


def _package_index_args() -> list[str]:
    """This machine's pip configuration, for the build stage: index URLs (not local file://
    ones, which the build cannot see) and the CA bundle (a TLS-intercepting proxy's CA)."""
    args: list[str] = []
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST"):
        value = " ".join(
            part for part in os.environ.get(name, "").split() if not part.startswith("file:")
        )
        if value:
            args += ["--build-arg", f"{name}={value}"]
    bundle = os.environ.get("PIP_CERT") or ssl.get_default_verify_paths().cafile
    if bundle and Path(bundle).is_file():
        args += ["-v", f"{bundle}:/run/pip-ca.pem:ro", "--build-arg", "PIP_CERT=/run/pip-ca.pem"]
    return args


def build_image() -> str:
    """deploy/container/Containerfile on the Debian base, with the cached wheel if there is one
    (else the build stage compiles llama.cpp: ~6 min on two cores)."""
    base = ensure_base_image()
    with tempfile.TemporaryDirectory() as wheels:
        if (wheel := cached_llama_wheel()) is not None:
            shutil.copy2(wheel, wheels)
        podman(
            "build",
            *LIMITS,
            "--format",
            "docker",  # keeps HEALTHCHECK (the OCI format has none)
            "--build-arg",
            f"BASE_IMAGE={base}",
            "--build-context",
            f"wheels={wheels}",
            *_package_index_args(),
            "-f",
            str(CONTAINERFILE),
            "-t",
            IMAGE,
            str(ROOT),
            timeout=1800,
        )
    return IMAGE


@contextlib.contextmanager
def readable_certs(certs: DevCertPaths) -> Iterator[Path]:
    """A copy of the dev certificates the image's user (uid 10001) can read."""
    with tempfile.TemporaryDirectory(prefix="quicsrv-certs-") as folder:
        for source in (certs.ca_cert, certs.server_cert, certs.server_key):
            target = Path(folder) / source.name
            shutil.copyfile(source, target)
            target.chmod(0o644)
        Path(folder).chmod(0o755)
        yield Path(folder)


def free_port() -> int:
    """A port number free for both UDP and TCP on the host."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind(("127.0.0.1", 0))
            port = int(udp.getsockname()[1])
            with socket.socket() as tcp:
                try:
                    tcp.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port


async def wait_listening(name: str, timeout_s: float = 300) -> str:
    """Follow the container's log until the server says it listens; its log so far. The log
    ends (a failure) when the container exits."""
    process = await asyncio.create_subprocess_exec(
        *PODMAN,
        "logs",
        "-f",
        name,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert process.stdout is not None
    lines: list[str] = []
    try:
        async with asyncio.timeout(timeout_s):
            async for raw in process.stdout:
                lines.append(raw.decode(errors="replace"))
                if "quicsrv listening on" in lines[-1]:
                    return "".join(lines)
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
    raise AssertionError(f"{name} stopped before it listened:\n{''.join(lines)[-4000:]}")


@contextlib.asynccontextmanager
async def volume(name: str) -> AsyncIterator[str]:
    podman("volume", "create", name)
    try:
        yield name
    finally:
        podman("volume", "rm", "-f", name, check=False)


def inspect(kind: str, name: str) -> dict[str, object]:
    [found] = json.loads(podman(kind, "inspect", name))
    assert isinstance(found, dict)
    return found
