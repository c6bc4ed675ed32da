"""runtime/ does not import disagg/: the PD handoff is injected (runtime/handoff.py), never looked up."""

from __future__ import annotations

from tests.import_graph import PACKAGE_DIR, imports_of


def test_runtime_imports_no_handoff_implementation():
    bad = [f"runtime/{path.name} imports {target}" for path in sorted((PACKAGE_DIR / "runtime").glob("*.py"))
           for target, type_only in imports_of(path) if target.startswith("kvstrata.disagg") and not type_only]
    assert not bad, bad
