"""The process-wide default backend and the helpers that act on a backend (SGLang's module functions)."""

from __future__ import annotations

import threading
from typing import Any, Optional

from kvstrata.lang.backends.base import Backend

_default_backend: Optional[Backend] = None
_lock = threading.Lock()


def set_default_backend(backend: Optional[Backend]) -> None:
    """Use `backend` for programs run without `backend=` (None clears it)."""
    global _default_backend
    if backend is not None and not isinstance(backend, Backend):
        raise TypeError(f"expected a kvstrata.lang backend (RuntimeEndpoint, EngineBackend), got {backend!r}")
    with _lock:
        _default_backend = backend


def get_default_backend() -> Optional[Backend]:
    """The backend set by `set_default_backend`, if any."""
    return _default_backend


def resolve_backend(backend: Optional[Backend]) -> Backend:
    """`backend`, else the default one; raises ValueError when there is neither."""
    chosen = backend if backend is not None else _default_backend
    if chosen is None:
        raise ValueError("no backend: call kvstrata.lang.set_default_backend(RuntimeEndpoint(url)) "
                         "or pass backend=... to run()")
    if not isinstance(chosen, Backend):
        raise TypeError(f"expected a kvstrata.lang backend (RuntimeEndpoint, EngineBackend), got {chosen!r}")
    return chosen


def flush_cache(backend: Optional[Backend] = None) -> None:
    """Empty the prefix cache of `backend` (or of the default backend)."""
    resolve_backend(backend).flush_cache()


def get_server_info(backend: Optional[Backend] = None) -> dict[str, Any]:
    """Server args and internal state of `backend` (or of the default backend)."""
    return resolve_backend(backend).get_server_info()
