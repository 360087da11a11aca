"""deploy/systemd/quicsrv.service: verified by systemd itself, and the settings the SIGTERM
hand-over depends on (stop signal, who gets it, how long systemd waits)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from quicsrv.config import ServerConfig

UNIT = Path(__file__).resolve().parents[2] / "deploy" / "systemd" / "quicsrv.service"


def _service() -> dict[str, list[str]]:
    """The [Service] section, every value of a repeated key kept."""
    values: dict[str, list[str]] = {}
    section = ""
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line
        elif section == "[Service]":
            key, _, value = line.partition("=")
            values.setdefault(key, []).append(value)
    return values


def _verify(unit: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["systemd-analyze", "verify", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def installed_unit(tmp_path: Path) -> Path:
    """The unit with ExecStart pointing at this venv's quicsrv (verify checks that the
    command exists; /opt/quicsrv is where the README installs it)."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    quicsrv = Path(sys.executable).with_name("quicsrv")
    assert quicsrv.is_file()
    text = UNIT.read_text().replace("/opt/quicsrv/venv/bin/quicsrv", str(quicsrv))
    unit = tmp_path / "quicsrv.service"
    unit.write_text(text)
    return unit


def test_systemd_verifies_the_unit_without_a_warning(installed_unit: Path) -> None:
    done = _verify(installed_unit)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    # The check can fail: a misspelt key is one warning line.
    broken = installed_unit.with_name("broken.service")
    broken.write_text(installed_unit.read_text().replace("KillMode=", "KilMode="))
    assert "Unknown key" in _verify(broken).stderr


def test_the_sandbox_is_rated_ok_by_systemd(installed_unit: Path) -> None:
    done = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", str(installed_unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+) (\w+)", done.stdout)
    assert match is not None, done.stdout[-2000:] + done.stderr
    assert match.group(2) == "OK", match.group(0)  # systemd's best rating (exposure < 2)


def test_stop_sends_sigterm_to_the_server_alone_and_waits_past_the_hand_over() -> None:
    service = _service()
    assert service["KillSignal"] == ["SIGTERM"]
    # The engine worker must outlive the server's capture of its KV cells: not the group.
    assert service["KillMode"] == ["mixed"]
    # The hand-over waits up to shutdown_grace_s twice (pauses, then END acknowledgements).
    assert float(service["TimeoutStopSec"][0]) > 2 * ServerConfig().shutdown_grace_s + 5
    assert service["Restart"] == ["on-failure"]
    assert service["StateDirectory"] == ["quicsrv"]
    environment = " ".join(service["Environment"])
    assert "QUICSRV_DATA_DIR=%S/quicsrv" in environment.split()
