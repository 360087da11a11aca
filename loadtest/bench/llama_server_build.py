"""llama.cpp's own C++ ``llama-server``, built from the llama.cpp source that the installed
llama-cpp-python vendors, and cached outside the repository.

Benchmarks compare quicsrv with it (prompt caching, slots), so it must run the very llama.cpp
quicsrv runs: the sdist of the installed llama-cpp-python version carries it in
``vendor/llama.cpp``. The build takes minutes on two cores, so it is never run by CI or tests;
:func:`find_llama_server` only looks for a finished build, and a benchmark without one skips its
rows::

    .venv/bin/python -m loadtest.bench.llama_server_build     # prints the binary's path

The cache is ``$QUICSRV_LLAMA_SERVER_CACHE`` or ``~/.cache/quicsrv/llama-server``, one folder
per llama-cpp-python version: ``sdist/`` (the download), ``src/`` (its ``vendor/llama.cpp``),
``build/`` (CMake's) and ``bin/llama-server``, which appears only once a build has succeeded.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "build_llama_server",
    "cache_dir",
    "chosen_llama_server",
    "cmake_options",
    "find_llama_server",
    "main",
]

DISTRIBUTION = "llama_cpp_python"

#: Release build, llama.cpp's defaults otherwise (as llama-cpp-python's build leaves them:
#: GGML_NATIVE on, OpenMP on), so that the kernels are the ones the Python binding runs.
_CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    # One self-contained binary: nothing to find through an rpath once it is copied to bin/.
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    # The benchmark talks plain HTTP on loopback; no HTTPS, no downloads (LLAMA_CURL, which
    # llama-cpp-python turns off, is deprecated in this llama.cpp and left alone).
    "-DLLAMA_OPENSSL=OFF",
    # The web UI would be built with npm or fetched from Hugging Face: neither is reachable
    # here, and a benchmark needs no UI (the server then embeds none).
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)


def installed_version() -> str:
    """The installed llama-cpp-python's version: the build must vendor the same llama.cpp."""
    return importlib.metadata.version(DISTRIBUTION)


def cache_dir(version: str | None = None) -> Path:
    """Where the build for ``version`` (default: the installed one) lives."""
    root = os.environ.get("QUICSRV_LLAMA_SERVER_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "quicsrv" / "llama-server"
    return base / (version or installed_version())


def find_llama_server(version: str | None = None) -> Path | None:
    """The cached ``llama-server`` for ``version`` (default: the installed llama-cpp-python's),
    or None. Never builds."""
    binary = cache_dir(version) / "bin" / "llama-server"
    return binary if binary.is_file() and os.access(binary, os.X_OK) else None


def chosen_llama_server(choice: str) -> Path | None:
    """A benchmark's ``--llama-server`` choice: ``auto`` the cached build (None without one),
    ``none`` None, anything else that binary's path."""
    if choice == "none":
        return None
    if choice == "auto":
        return find_llama_server()
    return Path(choice)


def cmake_options() -> list[str]:
    """The configure options (also written into the JSON of a benchmark that uses the build)."""
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    return [*generator, *_CMAKE_OPTIONS]


def _run(argv: Sequence[str], log: Path) -> None:
    print("+", " ".join(argv), flush=True)
    with log.open("a") as out:
        out.write("+ " + " ".join(argv) + "\n")
        out.flush()
        status = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False)
    if status.returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise RuntimeError(f"{argv[0]} failed with {status.returncode}; see {log}:\n{tail}")


def _download_sdist(version: str, into: Path, log: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    found = sorted(into.glob(f"{DISTRIBUTION}-{version}.tar.gz"))
    if not found:
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                f"llama-cpp-python=={version}",
                "--no-binary",
                ":all:",
                "--no-deps",
                "-d",
                str(into),
            ],
            log,
        )
        found = sorted(into.glob(f"{DISTRIBUTION}-{version}.tar.gz"))
    if not found:
        raise RuntimeError(f"pip download left no {DISTRIBUTION}-{version}.tar.gz in {into}")
    return found[0]


def _extract_vendored_source(sdist: Path, into: Path) -> Path:
    """``vendor/llama.cpp`` of the sdist, extracted once into ``into``."""
    source = into / "llama.cpp"
    if (source / "CMakeLists.txt").is_file():
        return source
    staging = into.with_name(into.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if "/vendor/llama.cpp/" in m.name + "/"]
        archive.extractall(staging, members=members, filter="data")
    (top,) = {Path(m.name).parts[0] for m in members}
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    (staging / top / "vendor" / "llama.cpp").rename(source)
    shutil.rmtree(staging)
    return source


def build_llama_server(version: str | None = None, *, jobs: int = 2) -> Path:
    """Download, configure and build; returns the cached binary (at once if already built)."""
    version = version or installed_version()
    if (found := find_llama_server(version)) is not None:
        return found
    root = cache_dir(version)
    root.mkdir(parents=True, exist_ok=True)
    log = root / "build.log"
    sdist = _download_sdist(version, root / "sdist", log)
    source = _extract_vendored_source(sdist, root / "src")
    build = root / "build"
    _run(["cmake", "-S", str(source), "-B", str(build), *cmake_options()], log)
    _run(["cmake", "--build", str(build), "--target", "llama-server", f"-j{jobs}"], log)
    built = build / "bin" / "llama-server"
    binary = root / "bin" / "llama-server"
    binary.parent.mkdir(exist_ok=True)
    # Copy, then rename: find_llama_server must never see half a binary.
    partial = binary.with_name("llama-server.partial")
    shutil.copy2(built, partial)
    partial.rename(binary)
    return binary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench.llama_server_build",
        description="build (once) llama.cpp's llama-server from the source llama-cpp-python "
        "vendors, into a cache outside the repository; prints the binary's path",
    )
    parser.add_argument("--version", help="llama-cpp-python version (default: the installed)")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs (default 2)")
    parser.add_argument(
        "--find", action="store_true", help="only print the cached binary (exit 1 if none)"
    )
    args = parser.parse_args(argv)
    if args.find:
        found = find_llama_server(args.version)
        if found is None:
            print(f"no build in {cache_dir(args.version)}", file=sys.stderr)
            return 1
        print(found)
        return 0
    print(build_llama_server(args.version, jobs=args.jobs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
