"""Imports read from the source: every import statement of a module, at module level or inside a function (so
that a lazy import cannot hide a dependency), each marked type-only when it sits under `if TYPE_CHECKING:`."""

from __future__ import annotations

import ast
from pathlib import Path

import kvstrata

PACKAGE_DIR = Path(kvstrata.__file__).parent


def imports_of(path: Path) -> list[tuple[str, bool]]:
    """(module, type_only) for every import in `path`; `from a import b` counts as a.b when that is a module."""
    tree = ast.parse(path.read_text())
    type_only_nodes = {id(n) for stmt in ast.walk(tree) if isinstance(stmt, ast.If) and _is_type_checking(stmt.test)
                       for body in stmt.body for n in ast.walk(body)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, id(node) in type_only_nodes) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                target = name if _is_module(name) else node.module
                out.append((target, id(node) in type_only_nodes))
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _is_module(name: str) -> bool:
    if not name.startswith("kvstrata."):
        return False
    rel = Path(*name.split(".")[1:])
    root = PACKAGE_DIR
    return (root / rel).with_suffix(".py").exists() or (root / rel / "__init__.py").exists()


TESTS_DIR = Path(__file__).parent


def imported_test_modules(path: Path) -> list[str]:
    """The test modules (files named test_*.py under tests/) that the file at `path` imports, relative
    imports resolved; `from tests.x import test_y` counts as importing tests.x.test_y."""
    package = ".".join(path.relative_to(TESTS_DIR.parent).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [n for n in names if n.startswith("tests.") and n.rsplit(".", 1)[-1].startswith("test_")
                  and _is_test_file(n)]
    return found


def _is_test_file(name: str) -> bool:
    return (TESTS_DIR.parent / Path(*name.split("."))).with_suffix(".py").exists()
