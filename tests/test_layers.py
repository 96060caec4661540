"""The house as its imports draw it: no circle among p2pdiloco's modules, no import from a layer
up to a higher one, and a core that imports nothing but the protocol and the standard library.

Imports are read, nothing is imported. Every import counts: at the top of a module, inside a
function, and under ``TYPE_CHECKING`` (a type is a dependency too). To stay well under a second
on a busy machine, only the import statements are parsed (with ``ast``): a scan over the source
passes strings and comments by and hands on each statement that starts with ``import`` or
``from``; ``test_the_reader_sees_what_the_checks_rely_on`` holds it to ``ast`` on whole modules.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "p2pdiloco"

# Bottom to top. A unit (a subpackage, or a module at the top of the package; "p2pdiloco" is its
# __init__) imports units of its own layer or of lower ones only; the circle check keeps imports
# within a layer one-way.
LAYERS: tuple[tuple[str, ...], ...] = (
    # the package root (its version) and standard-library helpers any layer may use
    ("p2pdiloco", "errors", "aio", "signals", "failpoints", "choices"),
    # tensor maths (robust rules, codecs) and rendering: pure functions, no wire types
    ("aggregate", "compress", "dashboard"),
    # the wire: signed records, identities, certificates, reason codes (no torch)
    ("protocol",),
    # the node's decisions: sans-IO machines over protocol types
    ("core",),
    # the training engine (no network)
    ("train",),
    # the network plane: DHT, gossip, streams, the transport and the plane interface
    ("net",),
    # the real plane over it; a command's settings; the checks before a run
    ("node", "config", "preflight"),
    # the merge, the syncer service, certified state and the chain's downloads
    ("sync",),
    # one learner over several processes (FSDP2)
    ("island",),
    # the asyncio interpreter: a node's loop, its trainer thread, its views and metrics; a
    # certified version read back from a state directory (export, sample)
    ("runtime", "export"),
    # the discrete-event interpreter: the same machines on simulated time
    ("sim",),
    # whole runs offered to users (simulate, demo, the Sybil flood); networks for the tests
    ("harness", "testing"),
    # the commands, and python -m p2pdiloco
    ("cli",),
    ("__main__",),
)
LAYER = {unit: k for k, units in enumerate(LAYERS) for unit in units}

# Imports that the rest of issue 42 item 1 removes (the delivery and syncer-node machines in
# core/, the simulator as their interpreter): the syncer service takes the order in which it
# fetches an input from the runtime's delivery, which imports the service back; the simulator's
# learner, relay and syncer import the world that imports them. Until then the checks below
# skip exactly these edges, and fail once one is gone, so that its line goes too.
PENDING: frozenset[tuple[str, str]] = frozenset()

# Imports the sans-IO core may make beyond its own modules and the protocol: no clock, no I/O.
CORE_BANNED_STDLIB = frozenset({"asyncio", "time", "socket", "threading", "subprocess", "random"})


# A string or a comment, taken whole so that nothing inside it is read as code; or an import
# statement at the start of a line, with its parenthesised names.
_STRING = (
    r"[rRbBfFuU]{0,2}"
    r'(?:"""[\s\S]*?"""'
    r"|'''[\s\S]*?'''"
    r'|"(?:\\.|[^"\\\n])*"'
    r"|'(?:\\.|[^'\\\n])*')"
)
_STATEMENT = (
    r"^[ \t]*(?:from[ \t]+[.\w]+[ \t]+import[ \t]+(?:\([^)]*\)|[^\n#]+)"
    r"|import[ \t]+[^\n#]+)"
)
_SOURCE = re.compile(
    rf"(?P<string>{_STRING})|(?P<comment>#[^\n]*)|(?P<statement>{_STATEMENT})", re.M
)


def import_statements(source: str) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements of ``source``, wherever they stand."""
    for match in _SOURCE.finditer(source):
        if match.lastgroup == "statement":
            for node in ast.parse(match.group().strip()).body:
                assert isinstance(node, ast.Import | ast.ImportFrom)
                yield node


@cache
def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imported_names(module: str) -> Iterator[str]:
    """Dotted names that ``module`` imports (see ``read_imports``)."""
    path = modules()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    return read_imports(path.read_text(), package)


def read_imports(source: str, package: str) -> Iterator[str]:
    """Dotted names that ``source``, a module of ``package``, imports anywhere in it, relative
    imports resolved, each as written: ``from a.b import c`` gives ``a.b`` and ``a.b.c`` (a
    module, or a name of module ``a.b``)."""
    for node in import_statements(source):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


@cache
def graph() -> dict[str, frozenset[str]]:
    """Module → the package's modules it imports (the longest known prefix of each name)."""
    known = modules()
    edges = {}
    for module in known:
        targets = set()
        for name in imported_names(module):
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        edges[module] = frozenset(t for t in targets if (module, t) not in PENDING)
    return edges


def unit(module: str) -> str:
    """The subpackage or top-level module that ``module`` belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def circles(edges: dict[str, frozenset[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_pending_edge_is_still_there() -> None:
    gone = sorted(
        f"{a} → {b}"
        for a, b in PENDING
        if not any(n == b or n.startswith(b + ".") for n in imported_names(a))
    )
    assert gone == [], "no longer imported; take it out of PENDING: " + ", ".join(gone)


def test_every_unit_has_a_layer() -> None:
    units = {unit(m) for m in modules()}
    assert units - LAYER.keys() == set(), "give each new subpackage or module a layer"
    assert LAYER.keys() - units == set(), "a layer names a unit that no longer exists"


def test_no_circle_of_imports() -> None:
    found = circles(graph())
    said = "; ".join(" ↔ ".join(c) for c in found)
    assert found == [], f"modules that import each other: {said}"


def test_no_import_runs_up_a_layer() -> None:
    up = sorted(
        f"{a} (layer {LAYER[unit(a)]}) → {b} (layer {LAYER[unit(b)]})"
        for a, targets in graph().items()
        for b in targets
        if LAYER[unit(a)] < LAYER[unit(b)]
    )
    assert up == [], "imports up a layer:\n" + "\n".join(up)


def test_the_core_imports_only_the_protocol_and_the_standard_library() -> None:
    wrong = []
    for module in modules():
        if unit(module) != "core":
            continue
        for name in imported_names(module):
            top = name.split(".")[0]
            if top == "p2pdiloco":
                if unit(name) not in ("core", "protocol", "p2pdiloco"):
                    wrong.append(f"{module} → {name}")
            elif top not in sys.stdlib_module_names or top in CORE_BANNED_STDLIB:
                wrong.append(f"{module} → {name}")
    assert wrong == []


def test_the_protocol_imports_neither_torch_nor_asyncio() -> None:
    """The core sits on the protocol: what the protocol imports, the core does."""
    wrong = [
        f"{m} → {name}"
        for m in modules()
        if unit(m) == "protocol"
        for name in imported_names(m)
        if name.split(".")[0] in ("torch", "numpy", "asyncio")
    ]
    assert wrong == []


def test_the_reader_sees_what_the_checks_rely_on() -> None:
    """An import inside a function, one under TYPE_CHECKING and a relative one each count (had
    they been missed, the checks above would pass on a house that has circles)."""
    source = """
from typing import TYPE_CHECKING
from . import rows
from ..net.gossip import GossipProcess
if TYPE_CHECKING:
    from p2pdiloco.core.views import ViewState
def f():
    import p2pdiloco.sim.world
"""
    names = set(read_imports(source, "p2pdiloco.aggregate"))
    assert not any(
        "sim.relay" in n for n in read_imports('"""\nimport p2pdiloco.sim.relay\n"""', "")
    )
    assert {
        "p2pdiloco.aggregate.rows",
        "p2pdiloco.net.gossip",
        "p2pdiloco.core.views.ViewState",
        "p2pdiloco.sim.world",
    } <= names
    assert "p2pdiloco.net.gossip_host" in graph()["p2pdiloco.net.gossip_spawn"]  # in a function
    # Where a string or a comment holds a line that reads like an import (and in a module that
    # imports in a function), the scan finds what ast finds in the whole module, no more.
    prose = re.compile(r"^\W*(import\s+[\w.]+(\s+as\s+\w+)?\s*$|from\s+[\w.]+\s+import\s)", re.M)
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        if path.name != "gossip_spawn.py" and not any(
            m.lastgroup != "statement" and prose.search(m.group()) for m in _SOURCE.finditer(source)
        ):
            continue
        whole = [
            n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Import | ast.ImportFrom)
        ]
        assert [ast.dump(n, include_attributes=False) for n in import_statements(source)] == [
            ast.dump(n, include_attributes=False) for n in sorted(whole, key=lambda n: n.lineno)
        ], path
    three = {"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"}), "d": frozenset()}
    assert circles(three) == [["a", "b", "c"]]
