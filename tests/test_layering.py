"""Which package may import which: proto imports neither side, the server never imports the
client library (it starts it as a process when it needs one), the client never the server."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Repository folder -> the installed packages its modules must not import.
FORBIDDEN = {
    "proto": {"quicsrv", "quicsrv_client", "loadtest", "tests"},
    "quicsrv": {"quicsrv_client", "loadtest", "tests"},
    "client": {"quicsrv", "loadtest", "tests"},
}


def _imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_package_imports_what_it_must_not(package: str) -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(_imported_packages(path) & FORBIDDEN[package])
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    assert {path: bad for path, bad in offenders.items() if bad} == {}


def test_the_check_sees_an_import() -> None:
    """Not vacuous: a module that imports the client is caught."""
    assert "quicsrv_client" in _imported_packages(
        Path(__file__).parent / "client" / "test_options.py"
    )
