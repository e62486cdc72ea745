"""``python -m nimbus``: the same as the ``nimbus`` command."""

from __future__ import annotations

import sys

from nimbus.cli import main

if __name__ == "__main__":
    sys.exit(main())
