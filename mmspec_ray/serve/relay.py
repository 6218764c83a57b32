"""HTTP across two Serve deployments: the ingress (`HTTPFront`) hands each request to a ChatServer replica through a
deployment handle as its ASGI scope and body (`relay`), the replica runs its route and streams the response back as
ASGI messages (`respond`). What the proxy alone cannot do, the ingress does here: a full queue or a replica that
died before answering becomes a 503 in the API's error format with `Retry-After`; one that dies mid-stream ends
the stream with an error event. A client that goes away cancels the replica's work."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import Response, StreamingResponse
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from mmspec_ray.serve.errors import APIError
from mmspec_ray.serve.protocol import sse_event
from mmspec_ray.serve.replicas import ReplicaWatch

log = logging.getLogger(__name__)

# The parts of an ASGI scope a route reads (the rest holds objects of the ingress's own process).
SCOPE_KEYS = ("type", "http_version", "method", "scheme", "path", "raw_path", "root_path", "query_string", "headers",
              "client", "server")
GONE = (RayActorError, ActorUnavailableError, DeploymentUnavailableError)


def unavailable(retry_after_s: float, message: str, status: int = 503) -> Response:
    """503 (or the back-pressure's own status) in the API's error format, with Retry-After (whole seconds, >= 1)."""
    return APIError(status, message, code="unavailable",
                    headers={"Retry-After": str(max(1, round(retry_after_s)))}).response()


def internal_error(e: BaseException) -> APIError:
    """A failure of the replica's own (logged there): a 500 in the API's format, never the proxy's plain text."""
    log.warning("the replica failed a request: %s: %s", type(e).__name__, e)
    return APIError(500, f"internal error: {type(getattr(e, 'cause', None) or e).__name__}")


async def read_body(request: HTTPRequest, limit: int) -> bytes:
    """The request body, refused (413) past `limit` bytes before it is all read."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes is over this server's limit of {limit} bytes",
                       code="too_large")
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body is over this server's limit of {limit} bytes", code="too_large")
        parts.append(chunk)
    return b"".join(parts)


async def relay(handle: Any, request: HTTPRequest, retry_after_s: float, max_body_bytes: int,
                counted: Callable[[int], None] = lambda status: None, watch: ReplicaWatch | None = None) -> Response:
    """Send `request` to a replica behind `handle` (its `handle` method) and return its response as it streams.
    `counted(status)` is told of every answer the relay makes itself (413, 503), which no replica counts. With
    `watch`, a request that waits while no replica runs gets a 503 whose Retry-After is a replacement's time."""
    try:
        body = await read_body(request, max_body_bytes)
    except APIError as e:
        counted(e.status)
        return e.response()
    scope = {k: request.scope[k] for k in SCOPE_KEYS if k in request.scope}
    gen = handle.options(stream=True).handle.remote(scope, body)
    if watch is not None and not await watch.wait_assigned(gen):
        gen.cancel()
        counted(503)
        return unavailable(watch.retry_after_s(), "no decoder replica is running right now (one is being started); "
                           "retry after the time in Retry-After")
    try:
        start = await gen.__anext__()
    except BackPressureError as e:
        status = int(getattr(e, "status_code", None) or 503)
        counted(status)
        return unavailable(e.retry_after_s or retry_after_s, "the server is at capacity (every decoder busy and "
                           "its queue full); retry after the time in Retry-After", status)
    except GONE as e:
        log.warning("the replica decoding a request stopped before answering: %s: %s", type(e).__name__, e)
        counted(503)
        return unavailable(retry_after_s, "the replica decoding this request stopped before answering (it is being "
                           "replaced); retry after the time in Retry-After")
    except StopAsyncIteration:
        counted(500)
        return APIError(500, "internal error: the replica sent no response").response()
    except Exception as e:  # noqa: BLE001  (the replica's own failure: still the API's error format)
        counted(500)
        return internal_error(e).response()
    sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start["headers"])

    async def rest() -> AsyncIterator[bytes]:
        finished = False
        try:
            async for message in gen:
                if message["type"] != "http.response.body":
                    continue
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    finished = True
                    return
        except GONE as e:
            log.warning("the replica streaming a response stopped mid-stream: %s: %s", type(e).__name__, e)
            counted(503)
            if sse:
                yield sse_event(APIError(503, "the replica decoding this request stopped mid-stream; retry the "
                                         "request", code="unavailable").body()).encode()
        except Exception as e:  # noqa: BLE001  (a failure mid-body: end with an error event where the client reads one)
            counted(500)
            if sse:
                yield sse_event(internal_error(e).body()).encode()
        finally:
            if not finished:  # the client went away, or the replica did: stop the replica's work
                gen.cancel()

    response = StreamingResponse(rest(), status_code=start["status"])
    response.raw_headers = [(bytes(k), bytes(v)) for k, v in start["headers"]]
    return response


async def respond(route: Callable[[HTTPRequest], Awaitable[Response]], scope: dict[str, Any],
                  body: bytes) -> AsyncIterator[dict[str, Any]]:
    """Run `route` on a request rebuilt from `scope` and `body`; yield its response's ASGI messages as it sends
    them. Closing this generator (the client went away) tells the response the client disconnected."""
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    response = await route(HTTPRequest(scope, receive))
    queue: asyncio.Queue = asyncio.Queue()

    async def run() -> None:
        try:
            await response(scope, receive, queue.put)
        except BaseException as e:  # noqa: BLE001  (handed to the reader, which re-raises it)
            await queue.put(e)
        finally:
            await queue.put(None)

    task = asyncio.create_task(run())
    try:
        while (message := await queue.get()) is not None:
            if isinstance(message, BaseException):
                raise message
            yield message
    finally:
        gone.set()
        if not task.done():
            task.cancel()
