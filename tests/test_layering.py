"""Which package may import which: proto imports neither side, the server never imports the
client library (it starts it as a process when it needs one), the client never the server."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
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


# aioquic's private state is read and changed in these two modules only, each tested against
# every aioquic release in the pinned range (tests/transport/test_aioquic_internals.py).
AIOQUIC_QUARANTINE = {"quicsrv/transport/aioquic_internals.py", "client/_aioquic_internals.py"}
# The connection a protocol subclass drives: aioquic's own examples use it, as we do.
AIOQUIC_SUBCLASS_HANDLE = "_quic"


def _aioquic_private_names(base: type) -> set[str]:
    """The underscore names aioquic's classes in ``base``'s MRO define or set on ``self``."""
    names: set[str] = set()
    for klass in base.__mro__:
        if klass.__module__.startswith("aioquic"):
            names.update(re.findall(r"self\.(_[a-z]\w*)", inspect.getsource(klass)))
            names.update(n for n in vars(klass) if n.startswith("_") and not n.startswith("__"))
    return names - {AIOQUIC_SUBCLASS_HANDLE}


def _aioquic_private_uses(source: str) -> list[str]:
    """Where ``source`` touches aioquic's private state: ``self._x`` or a ``_x`` method in a
    subclass of an aioquic class, when aioquic defines ``_x``; ``._quic._x`` anywhere."""
    tree = ast.parse(source)
    imported: dict[str, object] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("aioquic"):
            module = importlib.import_module(node.module or "")
            for alias in node.names:
                imported[alias.asname or alias.name] = getattr(module, alias.name, None)
    uses = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == AIOQUIC_SUBCLASS_HANDLE
        ):
            uses.append(f"{node.lineno}: {ast.unparse(node)}")
        if not isinstance(node, ast.ClassDef):
            continue
        bases = [imported.get(b.id) for b in node.bases if isinstance(b, ast.Name)]
        private = set().union(*(_aioquic_private_names(b) for b in bases if isinstance(b, type)))
        for inner in ast.walk(node):
            if (
                isinstance(inner, ast.Attribute)
                and isinstance(inner.value, ast.Name)
                and inner.value.id == "self"
                and inner.attr in private
            ):
                uses.append(f"{inner.lineno}: {ast.unparse(inner)}")
            elif isinstance(inner, ast.FunctionDef) and inner.name in private:
                uses.append(f"{inner.lineno}: def {inner.name} (overrides aioquic's)")
    return sorted(set(uses))


def test_aioquic_private_state_stays_in_the_quarantine_modules() -> None:
    offenders = {
        str(path.relative_to(ROOT)): uses
        for folder in ("quicsrv", "client")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if str(path.relative_to(ROOT)) not in AIOQUIC_QUARANTINE
        and (uses := _aioquic_private_uses(path.read_text()))
    }
    assert offenders == {}


def test_the_aioquic_check_sees_private_uses() -> None:
    """Not vacuous: an override, a read and a reach through the connection are all caught."""
    source = (
        "from aioquic.asyncio.protocol import QuicConnectionProtocol\n"
        "class P(QuicConnectionProtocol):\n"
        "    def _transmit_soon(self):\n"
        "        return self._connected_waiter, self._quic._streams, self._quic.send_ping\n"
    )
    assert _aioquic_private_uses(source) == [
        "3: def _transmit_soon (overrides aioquic's)",
        "4: self._connected_waiter",
        "4: self._quic._streams",
    ]


def _module_imports(package: str) -> dict[str, set[str]]:
    """Which of ``package``'s modules each of its modules imports, at any depth of the code
    (imports inside functions count: they still make the modules need each other) except
    under ``if TYPE_CHECKING:``."""
    modules = {}
    for path in (ROOT / package).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        here = name.split(".") if is_package else name.split(".")[:-1]
        tree = ast.parse(path.read_text())
        skipped = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped.update(id(n) for n in ast.walk(node))
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    prefix = here[: len(here) - node.level + 1]
                    base = ".".join(prefix + ([node.module] if node.module else []))
                # `from X import y`: the module X.y when y is one, else X itself.
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while (member := stack.pop()) != node:
                component.append(member)
            component.append(node)
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize("package", ["quicsrv", "proto", "client"])
def test_no_import_cycle(package: str) -> None:
    assert _cycles(_module_imports(package)) == []


def test_the_cycle_check_sees_a_cycle() -> None:
    """Not vacuous: two modules importing each other (even inside a function) are one."""
    graph = _module_imports("quicsrv")
    graph["quicsrv.config"].add("quicsrv.cli")  # cli imports config
    assert any({"quicsrv.cli", "quicsrv.config"} <= set(cycle) for cycle in _cycles(graph))


# The one front door: the router decides what a path is (operator.py holds the operator
# endpoints the router hands their paths to); the transport has one request stream class and its
# table.
PATH_DISPATCHERS = {"quicsrv/http/router.py", "quicsrv/http/operator.py"}


def _path_dispatches(source: str) -> list[str]:
    """Comparisons against a path: a ``*_PATH``/``*_PATHS``/``*_PREFIX`` constant, or a
    literal that starts with ``/``, in a comparison or a ``startswith``."""

    def is_path(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant) and isinstance(node.value, str | bytes):
            return node.value[:1] in ("/", b"/")
        name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")
        return name.endswith(("_PATH", "_PATHS", "_PREFIX"))

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(is_path(o) for o in operands):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", "") == "startswith"
            and any(is_path(a) for a in node.args)
        ):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_the_router_dispatches_on_a_path() -> None:
    offenders = {
        str(path.relative_to(ROOT)): found
        for path in sorted((ROOT / "quicsrv").rglob("*.py"))
        if str(path.relative_to(ROOT)) not in PATH_DISPATCHERS
        and (found := _path_dispatches(path.read_text()))
    }
    assert offenders == {}


def test_the_path_check_sees_a_dispatch() -> None:
    source = "if path in NATIVE_PATHS or path == b'/v1/x' or p.startswith('/v1/'):\n    pass\n"
    assert len(_path_dispatches(source)) == 3


def test_the_transport_has_one_request_stream_class() -> None:
    classes = {
        node.name
        for path in (ROOT / "quicsrv" / "transport").rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
        and re.search(r"Stream|Port|Exchange|Answering|Sink|Intake", node.name)
    }
    assert classes == {"RequestStream", "RequestStreams"}


# The inner doors: each room imports only the rooms below it (type-only imports count too).
# transport -> http -> sessions -> engine; metrics sits under the sessions, config under all;
# the composition root (app, settings) and the command line are above every room.
_ROOT_AND_CLI = {"quicsrv.app", "quicsrv.settings", "quicsrv.cli", "quicsrv.workers"}
ROOMS_ABOVE = {
    "quicsrv.transport": _ROOT_AND_CLI,
    "quicsrv.http": {"quicsrv.transport"} | _ROOT_AND_CLI,
    "quicsrv.sessions": {"quicsrv.http", "quicsrv.transport", "quicsrv.apikeys"} | _ROOT_AND_CLI,
    "quicsrv.metrics": {"quicsrv.sessions", "quicsrv.http", "quicsrv.transport"} | _ROOT_AND_CLI,
    "quicsrv.engine": {
        "quicsrv.sessions",
        "quicsrv.http",
        "quicsrv.transport",
        "quicsrv.metrics",
        "quicsrv.apikeys",
    }
    | _ROOT_AND_CLI,
    # A pure policy under the sessions and the API keys, like config.
    "quicsrv.rate_limits": {
        "quicsrv.engine",
        "quicsrv.sessions",
        "quicsrv.http",
        "quicsrv.transport",
        "quicsrv.metrics",
        "quicsrv.apikeys",
    }
    | _ROOT_AND_CLI,
    "quicsrv.config": {
        "quicsrv.engine",
        "quicsrv.sessions",
        "quicsrv.http",
        "quicsrv.transport",
        "quicsrv.metrics",
    }
    | _ROOT_AND_CLI,
}


def _upward_imports(module: str, source: str, is_package: bool) -> list[str]:
    """The imports in ``source`` (module ``module``) of a room above its own."""
    here = module.split(".") if is_package else module.split(".")[:-1]
    above = next(
        (
            banned
            for room, banned in ROOMS_ABOVE.items()
            if module == room or module.startswith(room + ".")
        ),
        set(),
    )
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                prefix = here[: len(here) - node.level + 1]
                base = ".".join(prefix + ([node.module] if node.module else []))
            targets = [base]
        found += [
            f"{node.lineno}: {target}"
            for target in targets
            if any(target == room or target.startswith(room + ".") for room in above)
        ]
    return found


def test_every_room_imports_only_the_rooms_below_it() -> None:
    offenders = {}
    for path in sorted((ROOT / "quicsrv").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        if found := _upward_imports(module, path.read_text(), is_package):
            offenders[module] = found
    assert offenders == {}


def test_the_room_check_sees_an_upward_import() -> None:
    """Not vacuous: the engine naming the sessions, even for types only, is caught; the
    sessions naming the engine is not."""
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..sessions import x\n"
    assert _upward_imports("quicsrv.engine.llama", source, False) == ["3: quicsrv.sessions"]
    assert _upward_imports("quicsrv.sessions.session", "from ..engine import y\n", False) == []
    assert _upward_imports("quicsrv.config", "from .metrics import z\n", False) == [
        "1: quicsrv.metrics"
    ]


#: The style guide splits a module by its decisions before it reaches this size.
MAX_MODULE_LINES = 700


def test_no_module_is_past_the_size_the_style_guide_splits_at() -> None:
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for folder in ("quicsrv", "proto", "client")
        for path in (ROOT / folder).rglob("*.py")
    }
    assert {path: n for path, n in sizes.items() if n > MAX_MODULE_LINES} == {}
