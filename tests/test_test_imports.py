"""Test modules share helpers through helper modules and conftest fixtures, never through each other: importing
a test module runs its module-level fixtures and setup a second time, and ties two tests' files together."""

from __future__ import annotations

from tests.import_graph import TESTS_DIR, imported_test_modules


def test_no_test_module_imports_another():
    bad = [f"{path.relative_to(TESTS_DIR)} imports {name}" for path in sorted(TESTS_DIR.rglob("*.py"))
           for name in imported_test_modules(path)]
    assert not bad, bad
