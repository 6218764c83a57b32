"""OpenAI-style errors: one exception type carrying the HTTP status and the `{"error": {...}}` body."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from mmspec_ray.batch.rows import RowError
from mmspec_ray.targets import PromptTooLong, TargetError

# Batch row error kinds (media decoding, validation) -> HTTP status of the online endpoint.
_KIND_STATUS = {"media.too_large": 413}
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 503: "server_overloaded", 500: "server_error"}


class APIError(Exception):
    """A request the server refuses, rendered as OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_row_error(e: RowError, param_prefix: str = "") -> APIError:
    """A batch-layer RowError (field + kind + message) as an API error: 413 for media over a size limit, else 400."""
    status = _KIND_STATUS.get(e.kind, 400)
    code = "too_large" if status == 413 else e.kind.replace(".", "_")
    return APIError(status, str(e), param=param_prefix + e.field, code=code)


def target_error(e: TargetError) -> APIError:
    """A request the target refuses (too long for its context, a media kind it does not take), as a 400."""
    if isinstance(e, PromptTooLong):
        return APIError(400, f"prompt too long: {e}", param="messages", code="context_length_exceeded")
    return APIError(400, f"this model cannot take the request: {e}", param="messages", code="unsupported_request")
