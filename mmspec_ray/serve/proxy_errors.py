"""An ASGI middleware for Ray Serve's HTTP proxy: the answers the proxy makes itself (a plain-text 500 when the
ingress replica dies, a 503 while no ingress runs, its 404 for an unknown route prefix) reach clients in the API's
JSON error format, 5xx with Retry-After. Ray installs it from RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH
(`PROXY_CALLBACK`), which `python -m mmspec_ray.serve` sets. Imports nothing heavy: it runs in the proxy process."""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

PROXY_CALLBACK = "mmspec_ray.serve.proxy_errors:middlewares"
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
RETRY_AFTER_S = 5  # a replaced ingress replica (no model) is back within seconds
_TYPES = {404: "not_found_error", 503: "server_overloaded"}

Message = dict[str, Any]


class JSONErrors:
    """Rewrites every error response (status >= 400) whose body is not JSON into `{"error": {...}}`, keeping its
    status and its text as the message; a 5xx without Retry-After gets one. JSON and successful responses pass."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable[[Message], Awaitable[None]]) \
            -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        held: Message | None = None
        started = False
        body = bytearray()

        async def wrapped(message: Message) -> None:
            nonlocal held, started
            if message["type"] == "http.response.start":
                started = True
                if _plain_error(message):
                    held = message
                    return
            if held is None or message["type"] != "http.response.body":
                await send(message)
                return
            body.extend(message.get("body", b""))
            if not message.get("more_body", False):
                for m in error_messages(held["status"], bytes(body), held.get("headers") or []):
                    await send(m)

        try:
            await self.app(scope, receive, wrapped)
        finally:  # the proxy gave up before answering (its ingress died): it leaves the 500 to the HTTP server
            if not started:
                for m in error_messages(500, b"the request's ingress replica failed before answering; retry", []):
                    await send(m)


def _plain_error(start: Message) -> bool:
    ctype = next((v for k, v in start.get("headers") or [] if bytes(k).lower() == b"content-type"), b"")
    return start["status"] >= 400 and b"json" not in bytes(ctype).lower()


def error_messages(status: int, text: bytes, headers: list) -> list[Message]:
    """The ASGI messages of the API-format error for a proxy answer of `status` with body `text`."""
    message = text.decode("utf-8", "replace").strip() or f"HTTP {status}"
    code = "unavailable" if status >= 500 else "not_found" if status == 404 else "invalid_request"
    payload = json.dumps({"error": {"message": f"the server's HTTP proxy answered: {message}"[:2000],
                                    "type": _TYPES.get(status, "server_error" if status >= 500 else
                                                       "invalid_request_error"),
                                    "param": None, "code": code}}).encode()
    keep = [(bytes(k), bytes(v)) for k, v in headers
            if bytes(k).lower() not in (b"content-type", b"content-length")]
    if status >= 500 and not any(k.lower() == b"retry-after" for k, _ in keep):
        keep.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    keep += [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    return [{"type": "http.response.start", "status": status, "headers": keep},
            {"type": "http.response.body", "body": payload, "more_body": False}]


def middlewares() -> list:
    """Ray Serve's proxy callback: the middlewares to wrap the proxy's app with."""
    from starlette.middleware import Middleware

    return [Middleware(JSONErrors)]
