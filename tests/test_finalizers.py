"""A rule of the whole source, pinned with ``ast``: a finalizer takes no lock.

A ``weakref.finalize`` callback, a ``multiprocessing.util.Finalize`` of an object and a
``__del__`` run when the object is collected; when it sits in a reference cycle the
cyclic collector runs them in whichever thread allocates, between any two of its
bytecodes, and that thread may hold the very lock the finalizer would take: it then
waits for itself for ever. Three hangs of this shape were found (``data/_ref.py``'s
``Session._release``, ``data/_carry.py``'s ``_forget`` and ``_forget_relay``: now
``_Registry.forget``), so every finalizer named in ``src/nimbus`` is read here: none has a
``with`` on a lock, nor calls ``acquire``. (``Finalize(None, ...)`` runs at exit only and is not a finalizer here.)
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).parent.parent / "src" / "nimbus"


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    if isinstance(node, ast.Call):
        return _name(node.func)
    return ""


def _finalizers(tree: ast.Module) -> Iterator[tuple[str, int]]:
    """The names of the functions ``tree`` registers as finalizers, and where."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "__del__":
            yield "__del__", node.lineno
        if not isinstance(node, ast.Call) or len(node.args) < 2:
            continue
        called = _name(node.func)
        owner = node.args[0]
        if called.endswith("Finalize") and isinstance(owner, ast.Constant):
            continue  # Finalize(None, ...): at exit, not on collection
        if called in ("weakref.finalize", "finalize") or called.endswith("Finalize"):
            yield _name(node.args[1]).rpartition(".")[2], node.lineno


def _locking(function: ast.FunctionDef) -> list[str]:
    """What ``function``'s own body does that takes a lock."""
    found = []
    for node in ast.walk(function):
        if isinstance(node, ast.With | ast.AsyncWith):
            for item in node.items:
                what = _name(item.context_expr)
                if "lock" in what.lower() or "cond" in what.lower():
                    found.append(f"with {what} (line {node.lineno})")
        if isinstance(node, ast.Call) and _name(node.func).endswith(".acquire"):
            found.append(f"{_name(node.func)}() (line {node.lineno})")
    return found


def _offences(source: str) -> Iterator[str]:
    tree = ast.parse(source)
    defined: dict[str, list[ast.FunctionDef]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            defined.setdefault(node.name, []).append(node)
    for name, line in _finalizers(tree):
        for function in defined.get(name, []):
            for what in _locking(function):
                yield f"finalizer {name} (registered line {line}) takes a lock: {what}"


def test_no_finalizer_takes_a_lock() -> None:
    found = [
        f"{path.relative_to(SRC.parent)}: {offence}"
        for path in sorted(SRC.rglob("*.py"))
        for offence in _offences(path.read_text())
    ]
    assert not found, "\n".join(found)


def test_the_rule_can_fail() -> None:
    bad = """
import threading, weakref
_lock = threading.Lock()
def _forget(key):
    with _lock:
        pass
def keep(entry):
    weakref.finalize(entry, _forget, 1)
class C:
    def __del__(self):
        self._lock.acquire()
"""
    assert len(list(_offences(bad))) == 2
    fine = bad.replace("with _lock:", "if True:").replace("self._lock.acquire()", "pass")
    assert not list(_offences(fine))
