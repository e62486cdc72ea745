"""The program's main module in its processes: ``__main__``, as a forked child sees it.

A warm worker imports the program's main module once (as ``__mp_main__``,
as spawn does, so its ``if __name__ == "__main__":`` block does not run) and
``sys.modules["__main__"]`` is that module in every child it forks. Modules
that bound ``__main__`` earlier, while the worker started, hold the worker's
own bootstrap module instead: ``dill`` does (``import __main__``), and looks
up the globals of the main script's functions it sends by value there
(pandarallel's ``row_func`` using ``math``). In a child, ``become_main()``
gives that module the main module's names, so both are the program's main,
as under the stdlib's fork.

A main module with no file to import (``python - < script.py``, ``python
-c``, an interactive session, an embedded interpreter) is not imported in
the workers: its functions and classes travel by value with the globals
they use (``nimbus.multiprocessing._site.main_by_value``).
"""

from __future__ import annotations

import sys
import weakref

__all__ = ["become_main"]

# this process's own main module when nimbus was imported (a worker's bootstrap); weakly,
# so that a root's main module is cleared first at exit, as always
_original = weakref.ref(sys.modules["__main__"]) if "__main__" in sys.modules else None


def become_main() -> None:
    """In a child: modules holding the worker's ``__main__`` see the program's main module."""
    main = sys.modules.get("__main__")
    original = _original() if _original is not None else None
    if main is None or original is None or main is original:
        return
    names = dict(vars(main))
    vars(original).clear()
    vars(original).update(names)
