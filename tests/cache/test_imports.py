"""cache/ is closed: it imports neither the runtime nor the settings, and its modules form no import cycle.

Read from the source (every import statement, at module level or inside a function), so that a lazy
import cannot hide an upward dependency; imports under `if TYPE_CHECKING:` count for the first rule
(they name what the code depends on) but not for cycles (they never run).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kvstrata.cache
from tests.import_graph import imports_of

CACHE_DIR = Path(kvstrata.cache.__file__).parent
FORBIDDEN = ("kvstrata.runtime", "kvstrata.args", "kvstrata.server", "kvstrata.disagg")


def _cache_modules() -> dict[str, Path]:
    return {f"kvstrata.cache.{p.stem}": p for p in sorted(CACHE_DIR.glob("*.py")) if p.stem != "__init__"}


def test_cache_imports_neither_runtime_nor_args():
    bad = [f"{mod} imports {target}" for mod, path in _cache_modules().items()
           for target, _ in imports_of(path) if target.startswith(FORBIDDEN)]
    assert not bad, bad


def test_cache_modules_form_no_import_cycle():
    modules = _cache_modules()
    graph = {mod: {t for t, type_only in imports_of(path) if not type_only and t in modules}
             for mod, path in modules.items()}
    state: dict[str, int] = {}      # 1: on the current path, 2: done

    def visit(mod: str, path: list[str]) -> None:
        state[mod] = 1
        for nxt in sorted(graph[mod]):
            assert state.get(nxt) != 1, f"import cycle: {' -> '.join(path + [mod, nxt])}"
            if nxt not in state:
                visit(nxt, path + [mod])
        state[mod] = 2

    for mod in modules:
        if mod not in state:
            visit(mod, [])


def test_every_cache_module_imports_with_runtime_and_args_blocked():
    """Importing them (in a fresh interpreter) does not need the runtime or the settings at all.

    The package's own __init__ exports ServerArgs, so it is imported first; then every kvstrata module it
    pulled in is forgotten and the forbidden ones are blocked before the cache modules are imported anew."""
    names = sorted(_cache_modules())
    code = ("import importlib, sys\nimport kvstrata\n"
            "for name in [m for m in sys.modules if m.startswith('kvstrata.')]:\n    del sys.modules[name]\n"
            f"for blocked in {FORBIDDEN!r}:\n    sys.modules[blocked] = None\n"
            f"for name in {names!r}:\n    importlib.import_module(name)\n")
    root = str(CACHE_DIR.parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
