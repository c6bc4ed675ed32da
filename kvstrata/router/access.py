"""Who may change or see the router's worker set.

    data routes (/generate, /v1/..., /dashboard/data)   --api-key when set (ApiKeyMiddleware)
    control routes (CONTROL_PATHS)                      --admin-api-key when set (--api-key is not enough);
                                                        without one, loopback clients only. Mutating ones
                                                        are POST only (no cross-site GET can trigger them).
    /health, /metrics, /dashboard                       open
    worker URLs (in /metrics, /dashboard/data, the      shown only to callers that may use the control
    x-kvstrata-worker header and error messages)        routes; everyone else sees worker ids (worker-N)

A control route refuses an unauthorized caller before it reads the request, so the answer says nothing
about the worker URL it names (no port scanning through /add_worker).
"""

from __future__ import annotations

from typing import Optional

from starlette.requests import Request

from kvstrata.serving.errors import ApiError
from kvstrata.web.auth import require_admin

CONTROL_PATHS = frozenset({"/add_worker", "/remove_worker", "/list_workers", "/abort_request", "/flush_cache"})


def check_control(request: Request, admin_api_key: Optional[str]) -> None:
    """Raise ApiError 401/403 unless the caller may use the control routes."""
    require_admin(request, admin_api_key)


def reveals_workers(request: Request, admin_api_key: Optional[str]) -> bool:
    """Whether this caller may see worker URLs (the same rule as the control routes)."""
    try:
        check_control(request, admin_api_key)
    except ApiError:
        return False
    return True


def worker_name(url: str, worker_id: str, reveal: bool) -> str:
    """How a worker is named to a caller: its URL if they may see it, else its id."""
    return url if reveal else worker_id
