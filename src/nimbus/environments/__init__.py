"""Environments: the software a worker runs in.

``_spec`` says what an environment is; ``_build`` makes one ready on a node
(:func:`prepare`) and says how a worker starts in it.
"""

from __future__ import annotations

from nimbus.environments._build import Prepared, prepare
from nimbus.environments._spec import PLAIN, Environment

__all__ = ["PLAIN", "Environment", "Prepared", "prepare"]
