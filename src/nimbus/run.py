"""``nimbus run``: run an unmodified program with nimbus as its ``multiprocessing``.

::

    nimbus run script.py ARGS...         # as `python script.py ARGS...`
    nimbus run -m package.module ARGS... # as `python -m package.module ARGS...`
    nimbus run -c "code" ARGS...         # as `python -c "code" ARGS...`
    nimbus run DIR ARGS...               # DIR/__main__.py, as `python DIR ARGS...`
    nimbus run --endpoint hpc script.py  # its processes on the endpoint `hpc`
    nimbus run --environment geo x.py    # its processes in that environment (NIMBUS_ENVIRONMENT):
                                         # a name built by `nimbus environments build`, or JSON
    nimbus run --progress script.py      # a bar on stderr for each of its Pool maps
    python -m nimbus run ...             # the same

The program runs in this interpreter, as ``python`` would run it: its
``__main__`` module, ``sys.argv``, ``sys.path[0]``, its exit code, its
uncaught exception (traceback, status 1) and the signals that end it are its
own. Before it starts, ``nimbus.multiprocessing.install()`` makes every
``import multiprocessing`` (the program's and its libraries') nimbus's, and
so ``concurrent.futures.ProcessPoolExecutor`` too. Ctrl-C is passed on to
the program's processes, which the terminal does not reach (they are forked
by warm workers), and by each to its own (``_install.pass_interrupts``):
they see ``KeyboardInterrupt`` as the stdlib's children and grandchildren do.

A program written for fork runs unmodified: a main module with no ``if __name__ ==
"__main__":`` block is not imported by its processes, its functions and classes go
to them by value, as a forked child has them (``_site.main_by_value``). A SyntaxError
or a Ctrl-C shows the program's frames only, as ``python`` shows them. nimbus's own
configuration error while the program starts its processes (``NIMBUS_WORKERS=abc``)
is one line and status 2; a state store it cannot reach, one line and status 1.

A script that does not exist exits with status 2 and names it, as ``python`` does
(a directory without ``__main__.py``: python's message, status 1).
So does an option without its value, and an ``--endpoint`` or ``--environment``
(or ``NIMBUS_ENDPOINT``, ``NIMBUS_ENVIRONMENT``) that is not one: one line
naming what was given, before the program starts.
"""

from __future__ import annotations

import builtins
import io
import os
import sys
import types
from collections.abc import Sequence

TYPE_CHECKING = False
if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec

__all__ = ["EXIT_USAGE", "main", "run", "setup"]

EXIT_USAGE = 2
USAGE = "usage: nimbus run [--endpoint NAME] [--environment NAME|JSON] [--progress] (SCRIPT | -m MODULE | -c CODE) [ARGS ...]"


def setup(parser: object) -> None:
    """Arguments for ``nimbus run`` in the ``nimbus`` command's parser."""
    import argparse

    assert isinstance(parser, argparse.ArgumentParser)
    parser.usage = USAGE[len("usage: ") :]
    parser.add_argument("--endpoint", metavar="NAME", help="run the processes on this endpoint")
    parser.add_argument(
        "--environment",
        metavar="NAME|JSON",
        help="run the processes in this environment: a name built by `nimbus environments "
        "build`, or an Environment's JSON (json.dumps(env.to_dict()))",
    )
    parser.add_argument(
        "--progress", action="store_true", help="a progress bar for each Pool map of the program"
    )
    parser.add_argument("-m", dest="module", metavar="MODULE", help="run a module, as python -m")
    parser.add_argument("-c", dest="command", metavar="CODE", help="run code, as python -c")
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="the script and its arguments")


def run(args: object) -> int:
    """``nimbus run`` from the ``nimbus`` command's parsed arguments."""
    endpoint = getattr(args, "endpoint", None)
    module = getattr(args, "module", None)
    argv = list(getattr(args, "argv", []))
    command = getattr(args, "command", None)
    environment = getattr(args, "environment", None)
    program = ["-c", command, *argv] if command is not None else argv
    return launch(
        endpoint,
        module,
        program,
        progress=bool(getattr(args, "progress", False)),
        environment=environment,
    )


def _parse(argv: Sequence[str]) -> tuple[str | None, str | None, str | None, list[str], bool]:
    """``[--endpoint NAME] [--environment NAME|JSON] [--progress] (SCRIPT | -m MODULE |
    -c CODE) ARGS``: endpoint, environment, module, the program's argv, progress. Options end at
    the program."""
    endpoint = environment = module = None
    progress = False
    rest = list(argv)
    while rest:
        head = rest[0]
        name, eq, value = head.partition("=")
        if head == "--progress":
            progress, rest = True, rest[1:]
        elif name in ("--endpoint", "--environment"):
            if not eq:
                value = rest[1] if len(rest) > 1 else ""
                rest = rest[1:]
            rest = rest[1:]
            if not value:
                _usage(f"option {name} needs a value")
            if name == "--endpoint":
                endpoint = value
            else:
                environment = value
        elif head == "-c":  # as python -c: argv[0] is "-c"
            if len(rest) < 2:
                _usage("option -c needs a value (the code to run)")
            break
        elif head.startswith("-c"):
            rest = ["-c", head[2:], *rest[1:]]
            break
        elif head == "-m":
            if len(rest) < 2:
                _usage("option -m needs a value (the module to run)")
            module, rest = rest[1], rest[2:]
            break
        elif head.startswith("-m"):
            module, rest = head[2:], rest[1:]
            break
        elif head in ("-h", "--help"):
            _help()
        elif head == "--":
            rest = rest[1:]
            break
        elif head.startswith("-") and head != "-":
            _usage(f"unknown option {head!r}")
        else:
            break
    return endpoint, environment, module, rest, progress


def _help() -> None:
    """The help, on stdout; status 0, quietly also when the reader went early (``| head``)."""
    about = (
        "Run a Python program with nimbus as its multiprocessing: its processes on warm workers."
    )
    text = f"{USAGE}\n\n{about}\n{__doc__.split('::')[1].split('The program')[0].rstrip()}\n"
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:  # no second error when Python flushes at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    raise SystemExit(0)


def _usage(message: str) -> None:
    print(f"{USAGE}\nnimbus run: {message} (see `nimbus run --help`)", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


def main(argv: Sequence[str] | None = None) -> int:
    """``nimbus run ARGS`` (``argv``: what follows ``run``) without the rest of the CLI."""
    endpoint, environment, module, rest, progress = _parse(sys.argv[2:] if argv is None else argv)
    return launch(endpoint, module, rest, progress=progress, environment=environment)


def launch(
    endpoint: str | None,
    module: str | None,
    argv: list[str],
    *,
    progress: bool = False,
    environment: str | None = None,
) -> int:
    """Install nimbus as ``multiprocessing`` and run the program; its exit status. With
    ``progress``, each map of its pools draws a bar on stderr (``nimbus._progress``).
    ``endpoint`` and ``environment`` (else ``NIMBUS_ENDPOINT``, ``NIMBUS_ENVIRONMENT``)
    are checked before the program starts: a wrong one is one line and status 2."""
    if module is None and not argv:
        _usage("no script, -m MODULE or -c CODE to run")
    command = module is None and argv[0] == "-c"
    folder = module is None and not command and _main_folder(argv[0])
    script = module is None and argv[0] != "-" and not command and not folder
    if script and os.path.isdir(argv[0]):  # as python: a directory without __main__.py
        found = os.path.abspath(argv[0])
        print(f"nimbus run: can't find '__main__' module in {found!r}", file=sys.stderr)
        return 1
    if script and not os.path.isfile(argv[0]):
        print(f"nimbus run: can't open file {argv[0]!r}: no such file", file=sys.stderr)
        return EXIT_USAGE
    problem = _check_options(endpoint, environment) if endpoint or environment or _set() else None
    if problem is not None:
        print(f"nimbus run: {problem[1]}", file=sys.stderr)
        return problem[0]
    from nimbus import _install

    _install.install()  # Ctrl-C is passed on to the program's processes from here
    if progress:  # (imports multiprocessing, nimbus's now, before the program does)
        import multiprocessing.pool

        from nimbus import _progress

        _progress.follow_pool_maps(multiprocessing.pool.Pool)
    try:
        if module is not None:
            code, main = _module(module, argv)
        elif command:
            code, main = _command(argv[1], argv[2:])
        elif folder:
            code, main = _folder(argv[0], argv[1:])
        else:
            code, main = _script(argv[0], argv[1:])
    except _NotFound as exc:
        print(f"nimbus run: {exc}", file=sys.stderr)
        return 1
    except SyntaxError as exc:  # as python shows it: the error in the program, no frames
        sys.excepthook(type(exc), exc.with_traceback(None), None)
        return 1
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    except SystemExit:
        raise
    except KeyboardInterrupt:  # python reports it and ends by SIGINT: its frames only
        hook = sys.excepthook

        def trimming(kind: type[BaseException], value: BaseException, tb: object) -> None:
            own = _trimmed(value.__traceback__)
            hook(kind, value.with_traceback(own), own)

        sys.excepthook = trimming
        raise
    except BaseException as exc:  # as python reports it: the program's frames, status 1
        failed = _own_failure(exc)
        if failed is not None:
            print(f"nimbus run: {exc}", file=sys.stderr)
            return failed
        tb = _trimmed(exc.__traceback__)
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        return 1
    return 0


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _trimmed(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The program's frames of ``tb``, as python shows them: without the launcher's (up
    to the ``exec`` in :func:`launch`) nor nimbus's Ctrl-C handler (``_install``) last."""
    frames = []
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    starts = [i for i, t in enumerate(frames) if t.tb_frame.f_code is launch.__code__]
    if starts:
        del frames[: starts[-1] + 1]
    install = os.path.join(_PACKAGE, "_install.py")
    while frames and os.path.abspath(frames[-1].tb_frame.f_code.co_filename) == install:
        frames.pop()
    out = None
    for t in reversed(frames):
        out = types.TracebackType(out, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return out


def _own_failure(exc: BaseException) -> int | None:
    """The status for nimbus's own failure to start the program's runtime (raised by
    nimbus, not the program), reported as one line: a configuration error 2, a store or
    service it cannot reach 1. None for anything else (the program's traceback)."""
    from nimbus.errors import ConfigError, ServiceUnavailable, StateStoreError

    if not isinstance(exc, ConfigError | StateStoreError | ServiceUnavailable):
        return None
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None or not os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_PACKAGE):
        return None
    return EXIT_USAGE if isinstance(exc, ConfigError) else 1


class _NotFound(Exception):
    pass


def _main_folder(path: str) -> bool:
    """Whether ``path`` is a directory with a ``__main__.py``, which python runs."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "__main__.py"))


def _set() -> bool:
    """Whether an endpoint or an environment may be set other than by the options: by
    their variables or a config file. Only then is the configuration read before the
    program (``Settings`` would cost a no-op program ~2x; ``nimbus.config`` imports it
    on first use, and where the file is without it)."""
    if any(k in os.environ for k in ("NIMBUS_ENDPOINT", "NIMBUS_ENVIRONMENT", "NIMBUS_CONFIG")):
        return True
    from nimbus.config import default_config_path

    return os.path.exists(default_config_path(os.environ))


def _check_options(endpoint: str | None, environment: str | None) -> tuple[int, str] | None:
    """Check the endpoint and environment the program's processes are to use, given as
    options (else from ``NIMBUS_ENDPOINT``/``NIMBUS_ENVIRONMENT``), and pass them on in
    those variables (an environment as its JSON spec, which every node understands).
    A problem is ``(exit status, one line naming what was given)``."""
    from nimbus.config import Settings
    from nimbus.errors import ConfigError, NimbusError, NotFound, ServiceUnavailable

    given = "--environment" if environment else "NIMBUS_ENVIRONMENT"
    try:
        environment = environment or Settings.lookup("environment")
    except ConfigError as exc:
        return EXIT_USAGE, str(exc)
    if environment and environment.strip().lower() != "none":
        import json

        from nimbus.environments import resolve

        try:
            spec = resolve(environment, given)
        except ConfigError as exc:
            return EXIT_USAGE, str(exc)
        os.environ["NIMBUS_ENVIRONMENT"] = json.dumps(spec.to_dict())
    given = "--endpoint" if endpoint else "NIMBUS_ENDPOINT"
    try:
        endpoint = endpoint or Settings.lookup("endpoint")
    except ConfigError as exc:
        return EXIT_USAGE, str(exc)
    if not endpoint or endpoint.strip().lower() == "none":
        return None
    from nimbus.client import Client

    try:
        with Client() as client:
            info = client.get_endpoint(endpoint)
    except ServiceUnavailable as exc:
        return 1, f"{given}={endpoint}: {exc}"
    except NimbusError as exc:
        listed = not isinstance(exc, NotFound) or "list" in str(exc)
        hint = "" if listed else "; `nimbus endpoints list` shows those you can use"
        return EXIT_USAGE, f"{given}={endpoint}: {exc}{hint}"
    if not info.get("online", True):  # as an unknown one: nothing done, 2 (the CLI's rule)
        return EXIT_USAGE, (
            f"{given}={endpoint}: the endpoint is offline: start it with `nimbus endpoint "
            f"start {endpoint}` on its machine, or run without {given} to run locally"
        )
    os.environ["NIMBUS_ENDPOINT"] = endpoint
    return None


def _fresh_main(spec: ModuleSpec | None = None, file: str | None = None) -> types.ModuleType:
    """An empty ``__main__`` to run a program in, filled as ``python`` fills it: from the
    module ``spec`` it was found by (``-m``, a directory), else with no spec or loader
    and, for a script, its ``file``."""
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    if spec is None:
        if file is not None:
            main.__file__ = file
        main.__spec__ = None
        main.__loader__ = None
    else:  # as runpy's _run_module_as_main
        main.__dict__.update(
            __file__=spec.origin,
            __cached__=spec.cached,
            __loader__=spec.loader,
            __package__=spec.parent,
            __spec__=spec,
        )
    return main


def _found(name: str | None) -> tuple[types.CodeType, types.ModuleType]:
    """Module ``name``'s code (None: the ``__main__`` of ``sys.path[0]``, a directory's),
    found as runpy finds it, and the ``__main__`` it runs in."""
    import runpy

    try:
        if name is None:
            _name, spec, code = runpy._get_main_module_details()  # type: ignore[attr-defined]
        else:
            _name, spec, code = runpy._get_module_details(name)  # type: ignore[attr-defined]
    except ImportError as exc:
        raise _NotFound(str(exc)) from None
    return code, _fresh_main(spec)


def _script(path: str, args: list[str]) -> tuple[types.CodeType, types.ModuleType]:
    """A script's code, and the ``__main__`` it runs in (as ``python path args``)."""
    if path == "-":  # the program on standard input
        source = sys.stdin.buffer.read()
        name = "<stdin>"
        sys.path[0] = ""
    else:
        name = os.path.abspath(path)  # as python 3.9+: __file__ and the frames' file
        with io.open_code(name) as f:
            source = f.read()
        sys.path[0] = os.path.dirname(os.path.abspath(path))
    sys.argv[:] = [path, *args]
    return compile(source, name, "exec"), _fresh_main(file=name)


def _folder(path: str, args: list[str]) -> tuple[types.CodeType, types.ModuleType]:
    """A directory's ``__main__.py`` and the ``__main__`` it runs in (as ``python path args``:
    the directory first on ``sys.path``, its ``__main__`` module run by name)."""
    sys.path[0] = os.path.abspath(path)
    code, main = _found(None)
    sys.argv[:] = [path, *args]
    return code, main


def _command(text: str, args: list[str]) -> tuple[types.CodeType, types.ModuleType]:
    """A command's code, and the ``__main__`` it runs in (as ``python -c text args``)."""
    sys.path[0] = ""
    sys.argv[:] = ["-c", *args]
    return compile(text, "<string>", "exec"), _fresh_main()


def _module(name: str, args: list[str]) -> tuple[types.CodeType, types.ModuleType]:
    """A module's code, and the ``__main__`` it runs in (as ``python -m name args``)."""
    sys.path[0] = os.getcwd()
    code, main = _found(name)
    sys.argv[:] = [str(main.__file__), *args]  # its origin: runpy finds none without
    return code, main
