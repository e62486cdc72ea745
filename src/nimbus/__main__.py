"""``python -m nimbus``: the same as the ``nimbus`` command."""

from __future__ import annotations

import sys


def main() -> int:
    if sys.argv[1:2] == ["run"]:  # the program starts sooner without the rest of the CLI
        from nimbus.run import main as run

        return run(sys.argv[2:])
    from nimbus.cli import main as cli

    return cli()


if __name__ == "__main__":
    sys.exit(main())
