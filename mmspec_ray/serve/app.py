"""The Ray Serve app: an OpenAI-compatible chat completions endpoint on the batch pipeline's `SpecDecoder`.

Two deployments. `ChatServer` (one replica = one target + one drafter decoding one request at a time, batch size 1)
answers the routes; `HTTPFront` (no model, no CPU reserved) is the HTTP ingress and relays each request to a
ChatServer replica through a handle, so that a ChatServer replica that dies mid-request, or a full queue, still
answers in the API's error format (503 with `Retry-After`) instead of the proxy's plain-text 500.
`build_app(args)` is the `import_path` of a Serve config (deployments/*.yaml); `args` is `ServeSettings`.
"""

# No `from __future__ import annotations` here: FastAPI reads the route parameter types at run time. Serve ships
# the ingress class by value: helpers it calls live in other modules (a function defined below it is not found).
import asyncio
import hmac
import logging
import math
import os
import time
from collections import Counter
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse
import ray
from ray import serve
from ray.serve import Application

from mmspec_ray.batch.cluster import loopback_only, open_without_auth, serve_replica_on_loopback
from mmspec_ray.batch.plan import auto_gpus, check_drafter
from mmspec_ray.batch.decoder import SpecDecoder
from mmspec_ray.config import SamplingParams
from mmspec_ray.drafters.base import stop_learning
from mmspec_ray.serve.errors import APIError, target_error
from mmspec_ray.serve.messages import remote_media, to_request
from mmspec_ray.serve.metrics import ServeMetrics
from mmspec_ray.serve.protocol import ChatRequest, check_content_type, chunk_body, completion_body, completion_id, \
    decode_json, parse_request, spec_stats, sse_event, usage
from mmspec_ray.serve.proxy_errors import PROXY_CALLBACK, PROXY_CALLBACK_ENV
from mmspec_ray.serve.relay import read_body, relay, respond
from mmspec_ray.serve.replicas import ReplicaWatch
from mmspec_ray.serve.run import DecodeRun, drain
from mmspec_ray.serve.settings import FRONT_DEPLOYMENT, ServeSettings
from mmspec_ray.serve.text import TextStream
from mmspec_ray.targets import TargetError

log = logging.getLogger(__name__)
DEPLOYMENT_NAME = "ChatCompletions"
FRONT_NAME = "HTTPFront"
ROUTES = {"/health": "GET", "/v1/models": "GET", "/v1/chat/completions": "POST"}
LARGE_BODY_BYTES = 1 << 20  # bodies parsed in a worker thread past this size
front = FastAPI(title="mmspec-ray", docs_url=None, redoc_url=None)


@serve.deployment(name=FRONT_NAME)
@serve.ingress(front)
class HTTPFront:
    """The HTTP ingress: relays every request to a ChatServer replica (`serve/relay.py`) and answers in the API's
    error format when none can take it (queue full) or the one decoding it died: 503 with `Retry-After`."""

    def __init__(self, chat: Any, model: str, retry_after_s: float, max_body_bytes: int) -> None:
        serve_replica_on_loopback()
        self.chat = chat
        self.retry_after_s = retry_after_s
        self.max_body_bytes = max_body_bytes
        self.metrics = ServeMetrics(model)
        self.watch = ReplicaWatch(serve.get_replica_context().app_name, DEPLOYMENT_NAME)

    @front.api_route("/{path:path}", methods=["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE"])
    async def any_route(self, path: str, request: HTTPRequest) -> Any:
        # the answers the relay makes itself (413, 503) are counted here, as stream "false" (it does not parse bodies)
        return await relay(self.chat, request, self.retry_after_s, self.max_body_bytes,
                           counted=lambda status: self.metrics.request(status, False), watch=self.watch)


@serve.deployment(name=DEPLOYMENT_NAME)
class ChatServer:
    """SpecDecoder behind the API's routes, one request decoding at a time; HTTPFront relays requests here."""

    def __init__(self, settings: dict[str, Any]) -> None:
        serve_replica_on_loopback()
        self.settings = s = ServeSettings.model_validate(settings)
        self.api_key = s.api_key()
        self.model = s.served_name
        self.decoder = SpecDecoder(s.decode)
        self.max_chars = s.limits.prompt_chars(self.decoder.target.max_context)
        # requests are prepared with the decoder's resolved media settings (the processor's sides read once), so
        # a photo is scaled down before it is kept and the processed-size bound knows the processor
        self.request_settings = s.model_copy(update={"decode": self.decoder.config})
        if stop_learning(self.decoder.drafter):  # one user's answers must not shape (nor, by timing, reveal to)
            log.info("drafter learning from decoded answers is off in the endpoint")  # another user's drafts
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmspec-decode")
        self.slot = asyncio.Lock()  # the decoder: one request at a time
        self.waiting = 0
        self.counts: Counter[str] = Counter()
        self.metrics = ServeMetrics(self.model)

    async def handle(self, scope: dict[str, Any], body: bytes) -> AsyncIterator[dict[str, Any]]:
        """One HTTP request (its ASGI scope and body, from HTTPFront) -> the response's ASGI messages, streamed."""
        async for message in respond(self.route, scope, body):
            yield message

    async def route(self, request: HTTPRequest) -> Any:
        """The response of the route the request names (404 in the API's format for any other)."""
        method, path, root = request.method, request.scope["path"], request.scope.get("root_path", "")
        if root and path.startswith(root):  # an app under a route prefix: its routes are below it
            path = path[len(root):] or "/"
        if path == "/health" and method == "GET":
            return JSONResponse(await self.health())
        if path == "/v1/models" and method == "GET":
            return await self.models(request)
        if path == "/v1/chat/completions" and method == "POST":
            return await self.chat(request)
        routes = "this server answers POST /v1/chat/completions, GET /v1/models and GET /health"
        if path in ROUTES:
            return APIError(405, f"{method} {path} is not allowed: {routes}", code="method_not_allowed",
                            headers={"Allow": ROUTES[path]}).response()
        return APIError(404, f"no route {method} {path}: {routes}", code="not_found").response()

    # ---------- Serve hooks ----------
    def check_health(self) -> None:
        """Serve's periodic probe: the decode thread pool must still accept work."""
        if getattr(self.executor, "_shutdown", False):
            raise RuntimeError("decode thread pool is shut down")

    def stats(self) -> dict[str, int]:
        """Counters for tests and debugging (call through a handle): requests by outcome, steps, tokens."""
        return dict(self.counts, waiting=self.waiting, decoding=int(self.slot.locked()))

    # ---------- routes ----------
    async def health(self) -> dict[str, Any]:
        return {"status": "ok", "model": self.model, "decoding": self.slot.locked(), "waiting": self.waiting}

    async def models(self, request: HTTPRequest) -> JSONResponse:
        try:
            self._auth(request)
        except APIError as e:
            return e.response()
        return JSONResponse({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "mmspec-ray"}]})

    async def chat(self, request: HTTPRequest) -> Any:
        t0 = time.perf_counter()
        stream = False
        try:
            self._auth(request)
            check_content_type(request.headers.get("content-type"))
            body = await self._json(request)
            read_s = time.perf_counter() - t0  # Serve's replica fetches the body from its proxy
            req = parse_request(body)
            stream = req.stream
            run, tokenizer = await self._start(req)
            run.read_s = read_s
        except APIError as e:
            self._count(e.status, stream)
            return e.response()
        except Exception as e:  # a bug must still answer in the API's error format
            log.exception("chat completion failed before decoding")
            self._count(500, stream)
            return APIError(500, f"internal error: {type(e).__name__}").response()
        if stream:
            return StreamingResponse(self._sse(req, run, tokenizer, t0), media_type="text/event-stream")
        try:
            gen = await drain(run)
        except asyncio.CancelledError:
            run.cancel()
            self._count("cancelled", False)
            raise
        except TargetError as e:  # a too-long prompt, a request the target refuses
            err = target_error(e)
            self._count(err.status, False)
            return err.response()
        except Exception as e:
            log.exception("decoding failed: %s: %s", type(e).__name__, e)
            self._count(500, False)
            return APIError(500, f"internal error while decoding: {type(e).__name__}").response()
        self._done(t0, run.first_at, gen, False)
        timing = {"read_s": round(run.read_s, 6), "queue_s": round(run.queued_s, 6),
                  "server_s": round(time.perf_counter() - t0, 6),
                  "first_token_s": round((run.first_at or t0) - t0, 6)}
        return JSONResponse(completion_body(completion_id(), self.model, gen, timing))

    # ---------- pieces ----------
    def _auth(self, request: HTTPRequest) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "missing or invalid API key: send Authorization: Bearer <key>",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def _json(self, request: HTTPRequest) -> Any:
        raw = await read_body(request, self.settings.limits.max_body_bytes)
        if len(raw) > LARGE_BODY_BYTES:  # parsing megabytes takes a while: not on the event loop
            return await asyncio.to_thread(decode_json, raw)
        return decode_json(raw)

    async def _start(self, req: ChatRequest) -> tuple[DecodeRun, Any]:
        """Check the request, decode its media, wait for the decoder and start decoding. A stream also waits for
        prefill: errors up to the first token raise APIError, so they still get a status code."""
        if req.model != self.model:
            raise APIError(400, f"model {req.model!r} is not served here; this endpoint serves {self.model!r} "
                           "(GET /v1/models)", param="model", code="model_not_found")
        max_tokens = req.max_completion_tokens or req.max_tokens or self.settings.default_max_tokens
        if max_tokens > self.settings.limits.max_tokens:
            raise APIError(400, f"max_tokens {max_tokens} is over this server's limit of "
                           f"{self.settings.limits.max_tokens}", param="max_tokens", code="invalid_value")
        if remote_media(req.messages):  # s3:// or http(s): I/O off the event loop
            request = await asyncio.to_thread(to_request, req.messages, self.request_settings, self.max_chars)
        else:  # data: URLs only: a fraction of a millisecond of decoding, not worth a thread hop
            request = to_request(req.messages, self.request_settings, self.max_chars)
        sampling = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                                  repetition_penalty=req.repetition_penalty, seed=req.seed)
        stop = req.stop_strings()
        self.waiting += 1
        self.metrics.depth(self.waiting, int(self.slot.locked()))
        tq = time.perf_counter()
        try:
            await self.slot.acquire()
        finally:
            self.waiting -= 1
        queued_s = time.perf_counter() - tq
        self.metrics.depth(self.waiting, 1)
        run = DecodeRun(lambda: self.decoder.stream(request, sampling, max_tokens, stop), self.executor,
                        on_step=self._step, every_step=req.stream)
        run.future.add_done_callback(self._release)
        run.queued_s = queued_s
        if not req.stream:  # errors come out of drain(); nothing has been sent yet either way
            return run, self.decoder.target.tokenizer
        try:
            first = await run.peek()  # prefill + first token: a too-long prompt fails here, before the stream
        except asyncio.CancelledError:
            run.cancel()
            raise
        if first.error is not None:
            raise target_error(first.error) if isinstance(first.error, TargetError) else first.error
        return run, self.decoder.target.tokenizer

    def _step(self, tokens: list[int]) -> None:
        self.counts["steps"] += 1
        self.counts["tokens"] += len(tokens)

    def _release(self, _: Any) -> None:
        self.slot.release()
        self.metrics.depth(self.waiting, 0)

    async def _sse(self, req: ChatRequest, run: DecodeRun, tokenizer: Any, t0: float) -> AsyncIterator[str]:
        """Server-sent events in OpenAI's chunk format: one chunk per decoding step that adds text."""
        cid, created = completion_id(), int(time.time())
        text = TextStream(tokenizer, req.stop_strings())
        role_sent, first, finished = False, None, False
        try:
            while True:
                step = await run.next()
                if step.error is not None:
                    log.error("decoding failed mid-stream: %s: %s", type(step.error).__name__, step.error,
                              exc_info=step.error)
                    self._count(500, True)
                    err = APIError(500, f"internal error while decoding: {type(step.error).__name__}")
                    yield sse_event(err.body())
                    finished = True
                    return
                if step.generation is not None:
                    break
                first = first or step.at
                delta = text.push(step.tokens or [])
                if delta or not role_sent:
                    piece = {"role": "assistant", "content": delta} if not role_sent else {"content": delta}
                    role_sent = True
                    yield sse_event(chunk_body(cid, self.model, created, piece))
            gen = step.generation
            rest = text.finish(gen.text)
            if rest:
                yield sse_event(chunk_body(cid, self.model, created, {"content": rest}))
            yield sse_event(chunk_body(cid, self.model, created, {}, gen.finish_reason, spec_stats={
                **spec_stats(gen.stats), "read_s": round(run.read_s, 6), "queue_s": round(run.queued_s, 6),
                "server_s": round(time.perf_counter() - t0, 6), "first_token_s": round((first or t0) - t0, 6)}))
            if req.stream_options and req.stream_options.include_usage:
                yield sse_event({"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model,
                              "choices": [], "usage": usage(gen.stats, len(gen.token_ids))})
            yield "data: [DONE]\n\n"
            finished = True
            self._done(t0, first, gen, True)
        finally:
            if not finished:  # the client went away (or the response was dropped): stop decoding
                run.cancel()
                self._count("cancelled", True)

    def _done(self, t0: float, first: float | None, gen: Any, stream: bool) -> None:
        self._count(200, stream)
        now = time.perf_counter()
        self.metrics.finished(now - t0, None if first is None else first - t0, len(gen.token_ids),
                              gen.stats.total_s, gen.stats.mean_accepted)
        self.metrics.guarded(gen.stats.guard, gen.stats.cycles, gen.stats.guard_plain_cycles)

    def _count(self, status: int | str, stream: bool) -> None:
        self.counts[str(status)] += 1
        self.metrics.request(status, stream)


def refuse_open_cluster(settings: ServeSettings) -> None:
    """With Ray's token auth off, every Ray server must listen on loopback only (whatever the environment says):
    before Ray starts (`serve run module:build_app`) this turns the loopback mode on; on a running cluster whose node
    address is not loopback it refuses in one line, unless the config allows an unauthenticated network."""
    if not ray.is_initialized() and not os.environ.get("RAY_ADDRESS"):
        from ray._private.authentication.authentication_utils import is_token_auth_enabled

        if not is_token_auth_enabled():
            loopback_only()
        return
    where = open_without_auth()
    if where is not None and not settings.allow_unauthenticated_network:
        raise ValueError(
            f"refusing to serve: Ray's token auth is off and this cluster's servers listen on {where}, so anyone "
            "who reaches it can run code here. On one machine start it on loopback: python -m mmspec_ray.serve CONFIG "
            "(or RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 serve run CONFIG); on a cluster turn on token auth "
            "(RAY_AUTH_MODE=token); or set allow_unauthenticated_network: true in the app's args if a firewall "
            "already guards this network")


def serve_drafter(decode):
    """(decode with drafter auto made concrete where it is cheap, why): a checkpoint's drafter is found here once
    by its identity; a toy world's shipped drafter stays `auto` (the replica trains it on first start)."""
    from mmspec_ray.toy.drafter import choose_drafter, toy_world_of

    if decode.drafter != "auto":
        return decode, "given"
    if toy_world_of(decode.target) is not None:
        return decode, "auto: the toy world's shipped drafter (each replica trains it on first start if needed)"
    choice = choose_drafter("auto", decode.target, decode.drafter_dirs, None, decode.s3)
    return decode.model_copy(update={"drafter": choice.spec}), choice.why


def serve_plan(settings: ServeSettings, decode, gpus: float, why: str) -> str:
    """The short plan `serve run` prints before replicas start."""
    from mmspec_ray.batch.plan import describe_tree, params_text
    from mmspec_ray.targets.layout import read_layout

    try:
        layout = read_layout(decode.target, decode.s3)
        what = f"{layout.model_type}, {params_text(layout.parameters)} parameters"
    except (TargetError, OSError) as e:
        what = f"not readable here: {e}"
    device = decode.device if decode.device != "auto" else ("cuda" if gpus > 0 else "cpu")
    dtype = decode.dtype if decode.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    return "\n".join([
        "plan:",
        f"  target   {decode.target} ({what}) served as {settings.served_name!r}",
        f"  decode   {dtype} on {device}; {gpus:g} GPU per replica (a ray_actor_options in the config's "
        "deployments: section replaces this)" if gpus else f"  decode   {dtype} on {device}; no GPU (CPU)",
        f"  drafter  {decode.drafter}: {why}",
        f"  tree     {describe_tree(decode)}",
        "  errors   every answer in the API's JSON format" if os.environ.get(PROXY_CALLBACK_ENV) == PROXY_CALLBACK else
        f"  errors   Ray's proxy answers its own errors in plain text: set {PROXY_CALLBACK_ENV}={PROXY_CALLBACK} "
        "where Ray starts (python -m mmspec_ray.serve does)",
    ])


def build_app(args: dict[str, Any]) -> Application:
    """Serve builder (`import_path: mmspec_ray.serve.app:build_app`): `args` is ServeSettings. A toy world name as
    `decode.target` is resolved (built on first use) here, once, not in every replica."""
    from mmspec_ray.batch.cli import resolve_target

    settings = ServeSettings.model_validate(args)
    refuse_open_cluster(settings)
    settings = settings.model_copy(update={"model_name": settings.served_name})
    decode = settings.decode.model_copy(update={"target": resolve_target(settings.decode.target)})
    options = settings.deployment_options()
    actor = dict(options.get("ray_actor_options") or {})
    if "num_gpus" not in actor:  # resources follow the cluster, as the batch jobs' do
        actor["num_gpus"] = auto_gpus(settings.gpus_per_replica, decode.device)
        options = {**options, "ray_actor_options": actor}
    decode, why = serve_drafter(decode)
    check_drafter(decode)  # a drafter that cannot run on the target: one line here, not a traceback per replica
    print(serve_plan(settings, decode, float(actor.get("num_gpus") or 0.0), why), flush=True)
    if decode.torch_threads is None:  # torch threads follow the replica's CPUs
        cpus = (options.get("ray_actor_options") or {}).get("num_cpus") or 1
        decode = decode.model_copy(update={"torch_threads": max(1, math.ceil(cpus))})
    settings = settings.model_copy(update={"decode": decode})
    chat = ChatServer.options(**options).bind(settings.model_dump(mode="json"))
    retry = float((options.get("backpressure_config") or {}).get("retry_after_s") or 1)
    return HTTPFront.options(**FRONT_DEPLOYMENT).bind(chat, settings.served_name, retry,
                                                      settings.limits.max_body_bytes)
