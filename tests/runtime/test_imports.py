"""Layering read from the source: runtime/ does not import disagg/ (the PD handoff is injected, runtime/handoff.py);
Engine, router/ and the serving core do not import the HTTP app (server/)."""

from __future__ import annotations

from tests.import_graph import PACKAGE_DIR, imports_of


def test_runtime_imports_no_handoff_implementation():
    bad = [f"runtime/{path.name} imports {target}" for path in sorted((PACKAGE_DIR / "runtime").glob("*.py"))
           for target, type_only in imports_of(path) if target.startswith("kvstrata.disagg") and not type_only]
    assert not bad, bad


def _imports_server(target: str) -> bool:
    return target == "kvstrata.server" or target.startswith("kvstrata.server.")


def test_engine_router_and_the_serving_core_never_import_the_http_app():
    """server/ (the model server's HTTP app) sits on top: Engine, the router and the shared layers below it
    (serving/, web/) never import it, not even for a type."""
    paths = [PACKAGE_DIR / "engine.py"] + [p for sub in ("router", "serving", "web")
                                           for p in sorted((PACKAGE_DIR / sub).glob("*.py"))]
    bad = [f"{path.relative_to(PACKAGE_DIR)} imports {target}" for path in paths
           for target, _ in imports_of(path) if _imports_server(target)]
    assert not bad, bad


HTTP_OR_WIRE = ("starlette", "fastapi", "uvicorn", "aiohttp", "zmq", "kvstrata.web")


def test_the_serving_core_is_transport_neutral():
    """serving/ carries no HTTP library and no socket: each transport brings its own."""
    bad = [f"serving/{path.name} imports {target}" for path in sorted((PACKAGE_DIR / "serving").glob("*.py"))
           for target, _ in imports_of(path) if target.split(".")[0] in HTTP_OR_WIRE or target.startswith(HTTP_OR_WIRE)]
    assert not bad, bad
