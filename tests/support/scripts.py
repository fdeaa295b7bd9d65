"""Loading a script that is not in a package (a benchmark, a report) as a module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path) -> ModuleType:
    """Import a script that is not in a package (``benchmarks/``, ``scripts/``) by its path.

    Its folder goes on ``sys.path`` first (benchmarks import their ``_common`` helpers), and the
    module is registered before it runs, since dataclasses look their module up while built.
    """
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
