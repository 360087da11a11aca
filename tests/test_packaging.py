"""What ``pip install quicsrv`` puts into site-packages: only names quicsrv owns, and every module
of the repository's three packages under its installed name."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Repository folder -> installed package (pyproject.toml's [tool.setuptools.package-dir]).
INSTALLED_AS = {"quicsrv": "quicsrv", "proto": "quicsrv_proto", "client": "quicsrv_client"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """The wheel built from a copy of the sources (the build writes beside them)."""
    scratch = tmp_path_factory.mktemp("wheel")
    source = scratch / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for folder in INSTALLED_AS:
        shutil.copytree(
            ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
        + ["--wheel-dir", str(scratch), str(source)],
        check=True,
        capture_output=True,
    )
    (built,) = scratch.glob("quicsrv-*.whl")
    return zipfile.ZipFile(built)


def test_every_top_level_name_in_the_wheel_is_quicsrv_s(wheel: zipfile.ZipFile) -> None:
    top_level = {name.split("/")[0] for name in wheel.namelist()}
    foreign = {name for name in top_level if not name.startswith("quicsrv")}
    assert foreign == set()
    assert {"quicsrv", "quicsrv_proto", "quicsrv_client"} <= top_level


def test_every_module_is_in_the_wheel_under_its_installed_name(wheel: zipfile.ZipFile) -> None:
    expected = {
        "/".join((INSTALLED_AS[folder], *path.relative_to(ROOT / folder).parts))
        for folder in INSTALLED_AS
        for path in (ROOT / folder).rglob("*")
        if path.suffix == ".py" or path.name == "py.typed"
    }
    assert expected - set(wheel.namelist()) == set()


def test_the_commands_point_at_the_installed_names(wheel: zipfile.ZipFile) -> None:
    (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    text = wheel.read(entry_points).decode()
    assert "quicsrv = quicsrv.cli:main" in text
    assert "quicsrv-client = quicsrv_client.cli:main" in text
