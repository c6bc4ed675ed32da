"""ApiError: a request refused or failed, with the HTTP status that classifies it (4xx: the caller's fault).

Transport-neutral: the HTTP apps (server/, router/) answer it with OpenAI's error object and its status;
Engine raises InvalidRequest for a 4xx and RuntimeError otherwise.
"""

from __future__ import annotations

from typing import Optional


class ApiError(Exception):
    """An error answered to the client with an HTTP status and an OpenAI-style error object."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None,
                 err_type: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.err_type = err_type or _ERROR_TYPES.get(status, "server_error" if status >= 500 else
                                                     "invalid_request_error")

    def headers(self) -> dict[str, str]:
        """Response headers: a 503 (queue full, draining, scheduler gone) tells the client when to retry."""
        return {"Retry-After": str(RETRY_AFTER_S)} if self.status == 503 else {}

    def to_dict(self) -> dict:
        """The JSON body: OpenAI's error shape (the openai client reads `error.message`)."""
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param,
                          "code": self.status}}


RETRY_AFTER_S = 1
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable"}
