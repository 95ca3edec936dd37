"""The supervisor's own modules, for tests on the host: they import each other by bare name
(inside, their folder is the program's), and importing the supervisor trims ``sys.path`` to
what the sandbox cannot write (as root: nearly nothing), so ``sys.path`` is put back after."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

from stockade.sandbox import supervisor

SUPERVISOR = Path(supervisor.__file__).parent


def supervisor_module(name: str) -> Any:
    """The supervisor's module ``name``, imported as the supervisor imports it."""
    saved = list(sys.path)
    sys.path.insert(0, str(SUPERVISOR))
    try:
        return importlib.import_module(name)
    finally:
        sys.path[:] = saved
