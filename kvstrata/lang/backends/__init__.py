"""Lang backends: RuntimeEndpoint (native HTTP API) and EngineBackend (in-process Engine)."""

from kvstrata.lang.backends.base import Backend, BackendError, GenOutput
from kvstrata.lang.backends.engine_backend import EngineBackend
from kvstrata.lang.backends.runtime_endpoint import RuntimeEndpoint

__all__ = ["Backend", "BackendError", "EngineBackend", "GenOutput", "RuntimeEndpoint"]
