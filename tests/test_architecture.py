"""The layers of ``daemon/`` as docs/architecture.md draws them, read from the code with ``ast``.

Each rule is checked by a function that takes the parsed tree, so the tests below can
also show that a deliberately wrong import or a circle is caught.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

LAYERS: Mapping[str, int] = {
    "base": 0,
    "config": 1,
    "ledger": 2,
    "store": 3,
    "host": 4,
    "nodes": 5,
    "retention": 5,
    "ops": 5,
    "server": 6,
}
"""Each subpackage of ``daemon`` and its floor: a module imports only from its own
subpackage and from lower floors. Subpackages on one floor are peers and do not import
each other. The modules directly in ``daemon/`` (``__init__``, ``cli``, ``__main__``)
stand above every floor."""

TOP = 7

IO_MODULES = frozenset(
    {"os", "io", "socket", "shutil", "pathlib", "fcntl", "subprocess", "threading", "time"}
    | {"anyio", "tempfile", "select", "signal", "mmap", "ctypes", "asyncio"}
)
"""What the ledger may not import: it is pure rules, with no I/O and no clock."""

FS_CALLS = frozenset(
    {"rename", "replace", "unlink", "remove", "rmdir", "mkdir", "makedirs", "fsync"}
    | {"listdir", "scandir", "symlink", "link", "readlink", "truncate", "ftruncate"}
)
"""``os`` functions that touch a filesystem; outside ``store/`` they are refused."""

FS_OUTSIDE_STORE: Mapping[str, str] = {
    "daemon.config._config": "reads the configuration file",
    "daemon.config._root": "checks that configured roots exist and resolves their symlinks",
    "daemon.config._tiers": "checks that a root's fast tier exists and resolves its symlinks",
    "daemon.server._lifecycle": "the daemon's own socket file and state directory",
}
"""Modules outside ``store/`` that may touch a filesystem, and why: neither is a root."""

MAX_LINES = 450


@dataclass(frozen=True, slots=True)
class Module:
    name: str
    path: Path
    tree: ast.Module
    lines: int

    @property
    def package(self) -> str:
        """The module's subpackage of ``daemon`` (``""`` for ``daemon/`` itself)."""
        parts = self.name.split(".")
        inside = len(parts) > 2 or (len(parts) == 2 and self.path.name == "__init__.py")
        return parts[1] if inside else ""


def modules(top: str) -> dict[str, Module]:
    """Every module of package ``top`` (``daemon`` or ``orchestrator``), by dotted name."""
    found = {}
    for path in sorted((REPO / top).rglob("*.py")):
        rel = path.relative_to(REPO).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        text = path.read_text()
        found[name] = Module(name, path, ast.parse(text), len(text.splitlines()))
    return found


def imports(module: Module) -> Iterator[tuple[str, int]]:
    """Every module ``module`` imports (absolute dotted names), with the line."""
    is_pkg = module.path.name == "__init__.py"
    package = module.name.split(".") if is_pkg else module.name.split(".")[:-1]
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            yield target, node.lineno
            for alias in node.names:  # ``from . import _gc``: the submodule itself
                yield f"{target}.{alias.name}", node.lineno


def resolve(name: str, known: Mapping[str, Module]) -> str | None:
    """The known module ``name`` is, or lies in (a name imported from a module)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def floor(module: Module) -> int:
    return LAYERS[module.package] if module.package else TOP


def layer_violations(known: Mapping[str, Module]) -> list[str]:
    """Imports that climb a floor or cross to a peer subpackage."""
    bad = []
    for module in known.values():
        for name, line in imports(module):
            target = resolve(name, known)
            if target is None or target == module.name:
                continue
            other = known[target]
            if other.package == module.package or other.name == "daemon":
                continue
            if floor(other) >= floor(module):
                bad.append(
                    f"{module.path.relative_to(REPO)}:{line}: {module.name} "
                    f"(floor {floor(module)}) imports {other.name} (floor {floor(other)})"
                )
    return sorted(set(bad))


def circles(known: Mapping[str, Module]) -> list[list[str]]:
    """Import circles between modules (every import counts, ``TYPE_CHECKING`` too)."""
    edges: dict[str, set[str]] = {name: set() for name in known}
    for module in known.values():
        for name, _ in imports(module):
            target = resolve(name, known)
            # A package's __init__ is run by any import of a module inside it: it is no
            # part of the module's own dependencies.
            if target is not None and target != module.name and target != "daemon":
                if not module.name.startswith(f"{target}."):
                    edges[module.name].add(target)
    found: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        stack.append(name)
        for nxt in sorted(edges[name]):
            if state.get(nxt) == 1:
                found.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[name] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name)
    return found


def io_in_ledger(known: Mapping[str, Module]) -> list[str]:
    bad = []
    for module in known.values():
        if module.package != "ledger":
            continue
        for name, line in imports(module):
            if name.split(".")[0] in IO_MODULES:
                bad.append(f"{module.name}:{line} imports {name}")
            target = resolve(name, known)
            if target is not None and known[target].package in ("store", "server", "nodes"):
                bad.append(f"{module.name}:{line} imports {target}")
    return bad


def fs_outside_store(known: Mapping[str, Module]) -> list[str]:
    """Filesystem calls (``os.rename``, ``open()``...) in modules outside ``store/``."""
    bad = []
    for module in known.values():
        if module.package == "store" or module.name in FS_OUTSIDE_STORE:
            continue
        for node in ast.walk(module.tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Name) and func.id == "open":
                bad.append(f"{module.name}:{node.lineno} calls open()")
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                if func.value.id == "os" and func.attr in FS_CALLS or func.value.id == "shutil":
                    bad.append(f"{module.name}:{node.lineno} calls {func.value.id}.{func.attr}")
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Attribute):
                inner = func.value
                if isinstance(inner.value, ast.Name) and inner.value.id == "os":
                    if inner.attr == "path" and func.attr in ("exists", "lexists", "isdir"):
                        bad.append(f"{module.name}:{node.lineno} calls os.path.{func.attr}")
        # A filesystem call passed to a lane by name: ``lanes.run(root, os.path.isdir, ...)``.
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
                inner = node.value
                if (
                    isinstance(inner.value, ast.Name)
                    and inner.value.id == "os"
                    and inner.attr == "path"
                    and node.attr in ("exists", "lexists", "isdir", "isfile")
                ):
                    bad.append(f"{module.name}:{node.lineno} uses os.path.{node.attr}")
    return sorted(set(bad))


DAEMON = modules("daemon")


class TestLayers:
    """Imports run one way: down the floors of docs/architecture.md, with no circles."""

    def test_every_subpackage_has_a_floor(self) -> None:
        packages = {m.package for m in DAEMON.values()} - {""}
        assert packages == set(LAYERS), "a new subpackage of daemon/ needs a floor here"

    def test_no_import_climbs_a_floor(self) -> None:
        assert layer_violations(DAEMON) == []

    def test_no_circles(self) -> None:
        assert circles(DAEMON) == []
        assert circles(modules("orchestrator")) == []

    def test_the_ledger_does_no_io(self) -> None:
        assert io_in_ledger(DAEMON) == []

    def test_roots_are_touched_only_through_the_store(self) -> None:
        assert fs_outside_store(DAEMON) == []

    def test_orchestrator_never_imports_the_daemon(self) -> None:
        bad = [
            f"{m.name}:{line}"
            for m in modules("orchestrator").values()
            for name, line in imports(m)
            if name.split(".")[0] == "daemon"
        ]
        assert bad == []

    @pytest.mark.parametrize("top", ["daemon", "orchestrator"])
    def test_no_module_is_over_the_limit(self, top: str) -> None:
        big = {m.name: m.lines for m in modules(top).values() if m.lines > MAX_LINES}
        assert big == {}


class TestTheChecksCatch:
    """Each rule fails on a deliberately wrong tree, so a pass above means something."""

    @staticmethod
    def _with(name: str, source: str) -> dict[str, Module]:
        known = dict(DAEMON)
        path = REPO / Path(*name.split(".")).with_suffix(".py")
        known[name] = Module(name, path, ast.parse(source), len(source.splitlines()))
        return known

    def test_an_import_from_above(self) -> None:
        known = self._with("daemon.store._bad", "from ..server._server import Daemon\n")
        assert any("daemon.store._bad" in v for v in layer_violations(known))

    def test_an_import_from_a_peer(self) -> None:
        known = self._with("daemon.nodes._bad", "from ..retention.applier import Retention\n")
        assert any("daemon.nodes._bad" in v for v in layer_violations(known))

    def test_a_circle(self) -> None:
        known = self._with("daemon.ledger._bad", "from . import _ledger\n")
        known = {
            **known,
            "daemon.ledger._ledger": Module(
                "daemon.ledger._ledger",
                known["daemon.ledger._ledger"].path,
                ast.parse("from ._bad import x\n"),
                1,
            ),
        }
        assert any("daemon.ledger._bad" in c for c in circles(known))

    def test_io_in_the_ledger(self) -> None:
        known = self._with("daemon.ledger._bad", "import os\n")
        assert io_in_ledger(known) == ["daemon.ledger._bad:1 imports os"]

    def test_a_rename_outside_the_store(self) -> None:
        known = self._with("daemon.nodes._bad", "import os\nos.rename('a', 'b')\n")
        assert fs_outside_store(known) == ["daemon.nodes._bad:2 calls os.rename"]
