"""Who may call what, for both HTTP apps (the server's rules below; the router passes its own admin paths,
router/access.py): the API key for every route but the open ones, the admin key for admin routes.

    /health, /metrics            open (load balancers and scrapers carry no key)
    admin routes (ADMIN_PATHS)   --admin-api-key when set (the plain --api-key is not enough);
                                 without an admin key: loopback clients only (plus --api-key if set),
                                 and never a browser request made by another site's page (CSRF)
    everything else              --api-key when set

Keys travel as `Authorization: Bearer <key>`; the scheme name is case-insensitive (RFC 7235).
"""

from __future__ import annotations

import hmac
import ipaddress
from typing import Optional
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kvstrata.serving.errors import ApiError

# The static dashboard page is open; its data (/dashboard/data) needs the key like every endpoint.
OPEN_PATHS = frozenset({"/health", "/metrics", "/dashboard"})
ADMIN_PATHS = frozenset({"/abort_request", "/prefetch", "/start_expert_distribution_record",
                         "/stop_expert_distribution_record", "/dump_expert_distribution_record"})


def bearer_token(headers: list[tuple[bytes, bytes]]) -> Optional[str]:
    """The token of an `Authorization: Bearer <token>` header (any case of 'Bearer'), or None."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


def key_matches(token: Optional[str], key: str) -> bool:
    """Constant-time comparison of a presented token with a configured key."""
    return token is not None and hmac.compare_digest(token.encode(), key.encode())


class ApiKeyMiddleware:
    """Reject requests without the API key (401), except open paths and admin paths guarded by their own key."""

    def __init__(self, app: ASGIApp, api_key: str, admin_key_set: bool, admin_paths: frozenset = ADMIN_PATHS):
        self.app = app
        self.api_key = api_key
        self.admin_key_set = admin_key_set
        self.admin_paths = admin_paths      # the router has its own (kvstrata/router/access.py)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and self._needs_api_key(scope["path"]):
            if not key_matches(bearer_token(scope["headers"]), self.api_key):
                err = ApiError("invalid or missing API key (send 'Authorization: Bearer <key>')", 401)
                await JSONResponse(err.to_dict(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _needs_api_key(self, path: str) -> bool:
        if path in OPEN_PATHS:
            return False
        return not (path in self.admin_paths and self.admin_key_set)


def require_admin(request: Request, admin_api_key: Optional[str]) -> None:
    """Raise 401/403 unless the caller may use an admin route (see the module docstring)."""
    if admin_api_key:
        if not key_matches(bearer_token(request.scope["headers"]), admin_api_key):
            raise ApiError("this is an admin action: send 'Authorization: Bearer <admin api key>'", 401)
        return
    host = request.client.host if request.client else ""
    if not _is_loopback(host):
        raise ApiError("this is an admin action, allowed only from loopback unless --admin-api-key is set", 403)
    if _cross_site(request):
        raise ApiError("this is an admin action: refused from another site's page (the browser's Origin / "
                       "Sec-Fetch-Site says so); set --admin-api-key to call it from a browser", 403)


def _cross_site(request: Request) -> bool:
    """Whether a browser sent this for a page of another origin. Without an admin key a loopback caller is
    trusted, and any web page the local user opens can make the browser POST to 127.0.0.1 (a form needs no
    CORS preflight); browsers name the page's origin in `Origin` and `Sec-Fetch-Site`. Clients that are not
    browsers send neither."""
    if request.headers.get("sec-fetch-site", "none") not in ("none", "same-origin"):
        return True
    origin = request.headers.get("origin")
    if origin is None:
        return False
    return urlsplit(origin).netloc.lower() != request.headers.get("host", "").lower()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
