"""The layers of DESIGN.md, pinned: every import in src/nimbus, read with ``ast``.

A module belongs to its top-level package (``nimbus.service.app`` to ``service``;
``nimbus.errors`` to ``errors``; ``nimbus/__init__.py`` to ``nimbus``). Four rules:

* an import runs down the layers of :data:`LAYERS`, or stays on its own floor;
* the graph of imports between top-level packages has no cycle;
* no import of another package's private module or name (``nimbus.x._y`` or
  ``from nimbus.x import _y`` from outside ``nimbus.x``); ``nimbus._loop`` and
  ``nimbus._chunks`` are the whole library's own;
* a part split out of one module (:data:`PARTS`, ``nimbus._mapping`` out of
  ``nimbus.executor``, ``nimbus.multiprocessing._child`` out of ``_forking``) is
  imported by that module (and its other parts) alone and imports only what its
  entry names.

Every import counts: at the top of a module, inside a function (imported on first
use) and under ``TYPE_CHECKING``. There are no exceptions.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

SRC = Path(__file__).parent.parent / "src"

# Each top-level package or module of nimbus, and its floor of DESIGN.md's drawing
# ("Parts and the direction of imports"): higher imports lower, never the reverse.
LAYERS: dict[str, int] = {
    # the command line, on top of everything
    "cli": 6,
    "__main__": 6,
    "run": 6,  # nimbus run: a command, kept out of the cli package to start fast
    # the SDK (nimbus.Executor; nimbus.Client re-exported) and multiprocessing, what users import
    "nimbus": 5,
    "executor": 5,
    "multiprocessing": 5,
    "_install": 5,  # nimbus as the stdlib's multiprocessing (install(), nimbus run)
    "joblib": 5,
    "demo": 5,
    # where an Executor's tasks run, and the service's REST client (nimbus.Client) that
    # the service backend and the CLI build on
    "backends": 4,
    "client": 4,
    # the engines and the control plane; endpoint: the agent that serves one endpoint
    "runtime": 3,
    "service": 3,
    "endpoint": 3,
    "messaging": 3,
    "providers": 3,
    "environments": 3,
    "network": 3,  # per-worker namespaces, counters and limits (issue 19)
    # the state store (and shared files)
    "statestore": 2,
    "data": 2,  # references and the node stores they name (nimbus.data)
    "storage": 2,
    "local_history": 2,  # a local Executor's records handed to this machine's service
    "_future": 2,  # nimbus.Future (the executor's, and the data path's KeptFuture)
    # parts of the executor in modules of their own (PARTS: imported by it alone)
    "_arguments": 5,  # its arguments' checks
    "_options": 5,  # the views options() returns
    "_mapping": 1,  # map on submit: its ordered results, what is cancelled when they are left
    "_tasks_program": 5,  # the program its tasks are instances of: messaging(), store()
    # contracts and plumbing every floor uses
    "protocol": 1,
    "serialization": 1,
    "telemetry": 1,
    "wire": 1,
    "config": 1,
    "records": 1,
    "_loop": 1,
    "_chunks": 1,
    "_progress": 1,
    "_lockfile": 1,  # a lock file with a deadline, not inherited by forks
    "_service_state": 1,  # which service runs here: its service.json, one reader
    "_mainspace": 1,  # one namespace per program's __main__ for its functions sent by value
    "_mainpickle": 1,  # a __main__'s functions sent by value, each pickled once
    "_joined": 1,  # the program a warm worker's task joined (its executor's: statestore reads it)
    "_lazy": 1,  # a module imported on first use (redis-py: at the first connection)
    "owners": 1,  # whom a task runs as on an endpoint (set by the agent, read by nimbus.data)
    # the exception tree, at the bottom
    "errors": 0,
}


# A part split out of one module to keep that module small: the module it belongs to
# (its only importer, with that module's other parts), and every nimbus module or
# package the part may import. Named below ``nimbus``: ``_mapping`` is nimbus._mapping,
# ``multiprocessing._child`` is nimbus.multiprocessing._child, ``runtime`` all of it.
PARTS: dict[str, tuple[str, frozenset[str]]] = {
    "_arguments": ("executor", frozenset({"config", "environments", "errors", "runtime"})),
    "_options": ("executor", frozenset({"_mapping", "environments"})),
    "_mapping": ("executor", frozenset({"_chunks", "_progress"})),
    "_tasks_program": (
        "executor",
        frozenset({"data", "errors", "messaging", "runtime", "statestore"}),
    ),
    "_mainspace": ("serialization", frozenset()),
    "_mainpickle": ("serialization", frozenset({"_mainspace"})),
    # a warm worker's forks: the child from fork to exit, the standbys, the reaper
    "multiprocessing._child": (
        "multiprocessing._forking",
        frozenset(
            {
                "_install",
                "local_history",
                "multiprocessing._local",
                "multiprocessing._main",
                "multiprocessing._remote",
                "multiprocessing.context",
                "records",
                "runtime",
                "serialization",
                "statestore",
            }
        ),
    ),
    "multiprocessing._standby": (
        "multiprocessing._forking",
        frozenset({"multiprocessing._child", "multiprocessing._reaper", "runtime", "statestore"}),
    ),
    "multiprocessing._reaper": (
        "multiprocessing._forking",
        frozenset({"multiprocessing._remote", "runtime", "statestore"}),
    ),
    # the settings: a field's declaration, where the values come from
    "config._fields": ("config._settings", frozenset({"config._coerce", "errors"})),
    "config._loading": (
        "config._settings",
        frozenset({"_lazy", "config._fields", "config._places", "errors"}),
    ),
    # the endpoint daemon: task rows made Tasks, the data store's transfers, the beats
    "endpoint._intake": (
        "endpoint.daemon",
        frozenset({"environments", "errors", "owners", "protocol", "records", "runtime"}),
    ),
    "endpoint._transfers": ("endpoint.daemon", frozenset({"errors", "protocol"})),
    "endpoint._reports": (
        "endpoint.daemon",
        frozenset(
            {
                "endpoint._orders",
                "endpoint._summary",
                "environments",
                "errors",
                "protocol",
                "runtime",
            }
        ),
    ),
}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "nimbus"


@functools.cache
def _is_module(name: str) -> bool:
    path = SRC.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _modules() -> Iterator[tuple[str, Path]]:
    for path in sorted((SRC / "nimbus").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path


def _imports(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """Every nimbus module or name that ``module`` imports, with its line."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("nimbus."):
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            if source != "nimbus" and not source.startswith("nimbus."):
                continue
            for alias in node.names:
                name = f"{source}.{alias.name}"
                if _is_module(name) or alias.name.startswith("_"):
                    yield name, node.lineno  # a module, or a private name
                elif source != "nimbus":
                    yield source, node.lineno
                else:  # from nimbus import X: X's home module
                    yield f"nimbus.{alias.name}", node.lineno


def _private(importer: str, target: str) -> bool:
    """``target`` is a private module or name of a package other than the importer's."""
    parts = target.split(".")
    inside = parts[2:] if len(parts) > 2 else []
    if not any(p.startswith("_") and not p.startswith("__") for p in inside):
        return False
    return _package(target) != _package(importer)


def _edges() -> dict[str, list[str]]:
    """'importer -> target' for every import between two top-level packages."""
    edges: dict[str, list[str]] = defaultdict(list)
    for module, path in _modules():
        for target, line in _imports(module, path):
            if _package(target) != _package(module):
                edges[f"{module} -> {target}"].append(f"{path.relative_to(SRC.parent)}:{line}")
    return edges


def _violations() -> dict[str, str]:
    """Edge -> what is wrong with it (upward, private)."""
    found: dict[str, str] = {}
    for edge in _edges():
        importer, target = edge.split(" -> ")
        low, high = _package(target), _package(importer)
        if LAYERS[low] > LAYERS[high]:
            found[edge] = (
                f"runs up from {high} (floor {LAYERS[high]}) to {low} (floor {LAYERS[low]})"
            )
        elif _private(importer, target):
            found[edge] = f"imports a private module or name of {low}"
    return found


def _module_of(name: str) -> str:
    """The module ``name`` is, or is in (a private name: ``nimbus.x._name``)."""
    while name.count(".") > 1 and not _is_module(name):
        name = name.rpartition(".")[0]
    return name


def _module_edges() -> set[str]:
    """'importer -> target' for every import of one nimbus module by another, within a
    package too."""
    edges = set()
    for module, path in _modules():
        for target, _ in _imports(module, path):
            if (imported := _module_of(target)) != module:
                edges.add(f"{module} -> {imported}")
    return edges


def _below(module: str) -> str:
    return module.partition(".")[2]  # nimbus.x.y -> x.y


def _within(name: str, names: Iterable[str]) -> bool:
    return any(name == n or name.startswith(n + ".") for n in names)


def _misplaced_parts(edges: Iterable[str]) -> list[str]:
    """Edges that import a part from outside its module, or from a part beyond its list."""
    found = []
    for edge in edges:
        importer, target = (_below(module) for module in edge.split(" -> "))
        owner = PARTS[target][0] if target in PARTS else ""
        if owner and not _within(importer, (owner,)) and PARTS.get(importer, ("",))[0] != owner:
            found.append(f"{edge}: {target} is {owner}'s part, for it alone")
        elif importer in PARTS and not _within(target, PARTS[importer][1]):
            found.append(f"{edge}: {importer} may import only {sorted(PARTS[importer][1])}")
    return found


def test_every_package_has_a_floor() -> None:
    packages = {_package(module) for module, _ in _modules()}
    missing = sorted(packages - set(LAYERS))
    assert not missing, f"add {missing} to LAYERS in tests/test_layers.py, at their floor"


def test_imports_run_down_the_layers_into_public_names() -> None:
    edges = _edges()
    new = _violations()
    assert not new, "\n".join(
        f"{edge}: {why} ({', '.join(edges[edge])})" for edge, why in sorted(new.items())
    )


def test_a_part_is_imported_by_its_module_alone_and_imports_only_its_list() -> None:
    edges = _module_edges()
    found = _misplaced_parts(edges)
    assert not found, "\n".join(sorted(found))
    imported = {_below(edge.split(" -> ")[1]) for edge in edges}
    assert not set(PARTS) - imported, "a part no module imports: remove it from PARTS"


def test_no_cycle_between_packages() -> None:
    graph: dict[str, set[str]] = defaultdict(set)
    for edge in _edges():
        importer, target = edge.split(" -> ")
        graph[_package(importer)].add(_package(target))
    cycles = _cycles(graph)
    assert not cycles, f"import cycles between packages: {cycles}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_checks_can_fail() -> None:
    """An upward edge, a private import and a cycle are each seen."""
    assert LAYERS["runtime"] < LAYERS["cli"]
    assert _private("nimbus.multiprocessing.queues", "nimbus.messaging._api")
    assert not _private("nimbus.messaging._sending", "nimbus.messaging._api")
    assert not _private("nimbus.backends.service", "nimbus._loop")
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert _misplaced_parts(["nimbus.multiprocessing.pool -> nimbus._mapping"])
    assert _misplaced_parts(["nimbus._mapping -> nimbus.runtime.task"])
    assert not _misplaced_parts(["nimbus.executor -> nimbus._mapping"])
    assert not _misplaced_parts(["nimbus._options -> nimbus._mapping"])
    assert _misplaced_parts(["nimbus.multiprocessing.pool -> nimbus.multiprocessing._child"])
    assert _misplaced_parts(["nimbus.multiprocessing._reaper -> nimbus.messaging"])
    assert not _misplaced_parts(
        ["nimbus.multiprocessing._standby -> nimbus.multiprocessing._child"]
    )
    assert not _misplaced_parts(
        ["nimbus.multiprocessing._forking -> nimbus.multiprocessing._child"]
    )
    assert not _misplaced_parts(["nimbus.multiprocessing._child -> nimbus.runtime.worker"])
    assert _module_of("nimbus.multiprocessing._main.MAIN_KEYS") == "nimbus.multiprocessing._main"
