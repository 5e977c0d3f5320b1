"""Which part of hbmd may import which: the layering ARCHITECTURE.md draws, checked on every file's imports.

Read from the source (every ``import`` statement, relative ones resolved, those inside functions and under
``if TYPE_CHECKING:`` included), so a layer crossed by a lazy import inside a function fails here as surely as one at
the top of a module. The client's and the daemon's modules import one another without a cycle: each part gets what
it uses, it does not reach back into what composes it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CONTRACTS = [
    # (the files, the modules none of them may import, why)
    ("client", ("hbmd.daemon",), "the client library talks to the daemon only over its sockets"),
    ("proto", ("hbmd.daemon", "hbmd.client", "hbmd.integrations", "zmq", "torch"),
     "the wire format is shared by both sides and needs neither"),
    ("daemon/state", ("zmq", "socket", "hbmd.daemon.server", "hbmd.client", "hbmd.driver", "torch"),
     "the state machine is pure: no sockets, no driver (a backend object is handed to it)"),
    ("daemon/server", ("hbmd.driver", "torch", "hbmd.client"),
     "the server routes requests; only a backend calls the driver"),
    ("daemon", ("torch", "hbmd.client", "hbmd.integrations", "zmq"),
     "the daemon makes no CUDA context, serves no engine, and speaks ZMTP itself: pyzmq is its clients' library"),
    ("integrations", ("hbmd.daemon",),
     "an engine's process runs its integrations (the kept index's records included) without the daemon's code"),
]


def module_name(path: Path) -> str:
    parts = ["hbmd", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, relative imports made absolute."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def cycles(folder: str) -> list[str]:
    """Each cycle of imports among the modules of ``folder``, as ``a -> b -> a`` (the first module of each is the
    lowest named; one cycle per set of modules that import one another round)."""
    modules = {module_name(path): path for path in (ROOT / folder).rglob("*.py")}

    def module_of(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges = {m: sorted({t for n in imports_of(p) if (t := module_of(n)) and t != m}) for m, p in modules.items()}
    found: list[str] = []
    seen: set[str] = set()
    for start in sorted(modules):
        if start in seen:
            continue
        # A path back to start through modules not yet reported, found depth first.
        path, stack = [start], [iter(edges[start])]
        while stack:
            step = next(stack[-1], None)
            if step is None:
                stack.pop()
                path.pop()
            elif step == start:
                found.append(" -> ".join([*path, start]))
                seen.update(path)
                break
            elif step not in path and step not in seen and step > start:
                path.append(step)
                stack.append(iter(edges[step]))
    return found


def crossings(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{path.relative_to(ROOT)} imports {name}"
            for path in sorted((ROOT / folder).rglob("*.py"))
            for name in sorted(imports_of(path))
            if any(name == f or name.startswith(f + ".") for f in forbidden)]


@pytest.mark.unit
@pytest.mark.parametrize(("folder", "forbidden", "why"), CONTRACTS, ids=[c[0] for c in CONTRACTS])
def test_no_layer_imports_what_it_must_not(folder, forbidden, why):
    assert crossings(folder, forbidden) == [], why


WITHOUT_ZMQ = """
import runpy
import sys


class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "zmq":
            raise ImportError("blocked " + name)


sys.meta_path.insert(0, Block())
runpy.run_module("hbmd.daemon", run_name="__main__", alter_sys=True)
"""


@pytest.mark.ipc
def test_the_daemon_serves_where_pyzmq_cannot_be_imported(start_daemon):
    """The daemon polls its descriptors with ``select`` and speaks ZMTP to its clients' DEALERs itself: started where
    ``import zmq`` fails, it serves a client of this process, which has pyzmq."""
    daemon = start_daemon("--budget", "64MiB", command=[sys.executable, "-c", WITHOUT_ZMQ])
    with daemon.connect() as client:
        assert client.status().budget_bytes == 64 << 20


@pytest.mark.unit
def test_the_check_sees_relative_and_nested_imports(tmp_path, monkeypatch):
    """A contract that could not fail would prove nothing: a relative import inside a function is found."""
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "client").mkdir()
    (tmp_path / "client" / "late.py").write_text("def f():\n    from ..daemon.state import State\n")
    assert crossings("client", ("hbmd.daemon",)) == [
        "client/late.py imports hbmd.daemon.state", "client/late.py imports hbmd.daemon.state.State"]


WITHOUT_CYCLES = [
    # (a package directory, why none of its modules imports one that imports it back)
    ("client", "a client part gets the core and the parts it uses; it never imports its composer"),
    ("daemon", "a part of the daemon is given what it needs by what builds it (the state its modules, the server "
               "the state), and never imports its composer back"),
    ("integrations", "the plugin composes the kept cache's worker half, its scheduler half and the standby, which "
                     "never import it or each other back"),
]


@pytest.mark.unit
@pytest.mark.parametrize(("folder", "why"), WITHOUT_CYCLES, ids=[c[0] for c in WITHOUT_CYCLES])
def test_no_module_imports_one_that_imports_it_back(folder, why):
    assert cycles(folder) == [], why


@pytest.mark.unit
def test_the_cycle_check_sees_a_cycle_through_a_type_checking_import(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "client").mkdir()
    (tmp_path / "client" / "__init__.py").write_text("")
    (tmp_path / "client" / "part.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .whole import Whole\n")
    (tmp_path / "client" / "whole.py").write_text("from hbmd.client.part import Part\n")
    (tmp_path / "client" / "leaf.py").write_text("from . import part\n")
    assert cycles("client") == ["hbmd.client.part -> hbmd.client.whole -> hbmd.client.part"]


@pytest.mark.unit
def test_the_cycle_check_sees_a_cycle_closed_by_an_import_inside_a_function(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "integrations").mkdir()
    (tmp_path / "integrations" / "plugin.py").write_text("from .keeper import keep\n")
    (tmp_path / "integrations" / "keeper.py").write_text("def keep():\n    from . import plugin\n")
    keeper, plugin = "hbmd.integrations.keeper", "hbmd.integrations.plugin"
    assert cycles("integrations") == [f"{keeper} -> {plugin} -> {keeper}"]
