"""Serve pieces without Ray: the engine's streaming form, streamed text deltas, media URL fetching rules,
settings. (The endpoint itself: test_serve.py, test_serve_limits.py.)"""

from __future__ import annotations

import asyncio
import base64
import http.server
import json
import threading

import pytest

from mmspec_ray.config import S3Config, SamplingParams
from mmspec_ray.serve import fetch as fetch_mod
from mmspec_ray.serve.errors import APIError
from mmspec_ray.serve.fetch import fetch_media, is_public_address
from mmspec_ray.serve.settings import FetchSettings, ServeSettings
from mmspec_ray.serve.text import TextStream

S3 = S3Config(endpoint_override="127.0.0.1:1", scheme="http")


@pytest.fixture(scope="module")
def engine(ckpt):
    from mmspec_ray.drafters.base import load_drafter
    from mmspec_ray.decoding.engine import SpecEngine
    from mmspec_ray.targets import load_target

    target = load_target(ckpt)
    return SpecEngine(target, load_drafter("ngram", target))


def test_stream_steps_concatenate_to_generate(engine):
    from mmspec_ray.targets import Request

    req = Request(prompt="red circle left")
    steps = engine.stream(req, SamplingParams(), 20)
    got = []
    while True:
        try:
            got.append(next(steps))
        except StopIteration as done:
            gen = done.value
            break
    assert got[0] and len(got[0]) == 1  # the prefill's token comes alone, before any verify cycle
    assert len(got) == gen.stats.cycles + 1
    assert [t for step in got for t in step] == gen.token_ids == engine.generate(req, SamplingParams(), 20).token_ids


def test_stream_closed_early_stops_and_the_next_request_is_unaffected(engine):
    from mmspec_ray.targets import Request

    req = Request(prompt="blue square")
    steps = engine.stream(req, SamplingParams(), 200)
    next(steps), next(steps)
    steps.close()
    assert engine.generate(req, SamplingParams(), 12).token_ids == engine.generate(req, SamplingParams(), 12).token_ids


class _Tok:
    """Character-level stand-in tokenizer: id i is chr(i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_text_stream_holds_back_possible_stop_strings():
    ts = TextStream(_Tok(), ("END",))
    out = [ts.push([ord(c)]) for c in "abcE"]
    assert "".join(out) == "abc"  # "E" may start "END": held back
    assert ts.push([ord("x")]) == "Ex"  # ruled out: sent
    assert ts.push([ord(c) for c in "yEN"]) == "y"
    assert ts.push([ord("D"), ord("z")]) == ""  # the stop string: nothing of it is sent
    assert ts.finish("abcExy") == "" and ts.sent == "abcExy"


def test_text_stream_holds_back_partial_characters():
    ts = TextStream(_Tok())
    assert ts.push([ord("a"), 0xFFFD]) == "a"
    assert ts.finish("a\u00e9") == "\u00e9"


@pytest.mark.parametrize("ip,public", [("127.0.0.1", False), ("10.1.2.3", False), ("192.168.0.1", False),
                                       ("169.254.169.254", False), ("::1", False), ("fe80::1", False),
                                       ("::ffff:127.0.0.1", False), ("100.64.0.1", False), ("0.0.0.0", False),
                                       ("8.8.8.8", True), ("2606:4700::1111", True)])
def test_public_address_rule(ip, public):
    assert is_public_address(ip) is public


def _status(fn) -> tuple[int, str | None]:
    with pytest.raises(APIError) as e:
        fn()
    return e.value.status, e.value.code


def test_http_urls_off_by_default_and_limited_to_the_allow_list():
    off = FetchSettings()
    assert _status(lambda: fetch_media("http://example.com/a.png", "image", 100, "x", S3, off)) == (400, "invalid_url")
    only = FetchSettings(allow_hosts=("images.example.com",))
    assert _status(lambda: fetch_media("https://evil.example.net/a.png", "image", 100, "x", S3, only))[0] == 400
    loop = FetchSettings(allow_hosts=("localhost", "127.0.0.1"))  # listed, but loopback is refused anyway
    assert _status(lambda: fetch_media("http://localhost/a.png", "image", 100, "x", S3, loop))[0] == 400
    assert _status(lambda: fetch_media("http://127.0.0.1:1/a.png", "image", 100, "x", S3, loop))[0] == 400
    assert _status(lambda: fetch_media("file:///etc/passwd", "image", 100, "x", S3, loop)) == (400, "invalid_url")


def test_data_urls():
    raw = b"0123456789" * 10
    url = "data:image/png;base64," + base64.b64encode(raw).decode()
    assert fetch_media(url, "image", 100, "x", S3, FetchSettings()) == raw
    assert _status(lambda: fetch_media(url, "image", 99, "x", S3, FetchSettings())) == (413, "too_large")
    assert _status(lambda: fetch_media("data:image/png,abc", "image", 99, "x", S3, FetchSettings()))[0] == 400


def test_s3_media_only_from_allow_listed_buckets():
    """A client cannot make the server read an object with the server's credentials outside the allow-list."""
    for fetch in (FetchSettings(), FetchSettings(allow_s3_buckets=("public-media",))):
        with pytest.raises(APIError) as e:
            fetch_media("s3://private-bucket/secret.png", "image", 100, "x", S3, fetch)
        assert (e.value.status, e.value.code) == (400, "invalid_url") and "allow_s3_buckets" in e.value.message


def test_s3_unreachable_is_503_with_retry_after_and_no_store_address():
    fast = S3.model_copy(update={"retry_base_s": 0.01, "retry_max_s": 0.02})
    with pytest.raises(APIError) as e:
        fetch_media("s3://bucket/a.png", "image", 100, "x", fast, FetchSettings(allow_s3_buckets=("bucket",)))
    assert (e.value.status, e.value.code, e.value.headers) == (503, "media_unavailable", {"Retry-After": "5"})
    assert "127.0.0.1" not in e.value.message and "re-run" not in e.value.message
    assert e.value.body()["error"]["param"] == "x"


@pytest.fixture()
def http_server():
    """A loopback HTTP server: /ok.png (200 bytes), /big.png (5000 bytes), /moved (302)."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/moved":
                self.send_response(302)
                self.send_header("Location", "http://169.254.169.254/")
                self.end_headers()
                return
            body = b"x" * (200 if self.path == "/ok.png" else 5000)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def test_allowed_http_fetch_pins_the_checked_address(http_server, monkeypatch):
    """With the address rule relaxed for this loopback server only, the fetch path itself: body, size, redirects."""
    monkeypatch.setattr(fetch_mod, "is_public_address", lambda ip: ip in ("127.0.0.1", "::1"))
    ok = FetchSettings(allow_hosts=("localhost",))
    base = f"http://localhost:{http_server}"
    assert fetch_media(f"{base}/ok.png", "image", 1000, "x", S3, ok) == b"x" * 200
    assert _status(lambda: fetch_media(f"{base}/big.png", "image", 1000, "x", S3, ok)) == (413, "too_large")
    assert _status(lambda: fetch_media(f"{base}/moved", "image", 1000, "x", S3, ok))[0] == 400  # not followed


def test_settings(monkeypatch):
    s = ServeSettings.model_validate({"decode": {"target": "/models/llava-1.5-7b/"}, "api_key_env": "MMSPEC_K"})
    assert s.served_name == "llava-1.5-7b"
    monkeypatch.delenv("MMSPEC_K", raising=False)
    with pytest.raises(ValueError, match="MMSPEC_K"):
        s.api_key()
    monkeypatch.setenv("MMSPEC_K", "k")
    assert s.api_key() == "k"
    opts = ServeSettings.model_validate({"decode": {"target": "t"}, "deployment": {
        "max_queued_requests": 3, "ray_actor_options": {"num_gpus": 1}}}).deployment_options()
    assert opts["max_queued_requests"] == 3 and opts["max_ongoing_requests"] == 2
    assert opts["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 1}
    with pytest.raises(ValueError):
        ServeSettings.model_validate({"decode": {"target": "t"}, "limitz": {}})


# ---------------- the ingress relay (serve/relay.py), with a scripted replica ----------------

class _Replica:
    """A deployment handle's stand-in: `handle.remote(scope, body)` streams the messages of `respond(route, ...)`,
    failing with `fail` after `after` messages (None: never)."""

    def __init__(self, route, fail=None, after=0):
        self.route, self.fail, self.after, self.cancelled = route, fail, after, False

    def options(self, **_):
        return self

    @property
    def handle(self):
        return self

    def remote(self, scope, body):
        from mmspec_ray.serve.relay import respond

        replica = self

        class Gen:
            def __init__(self):
                self.it = respond(replica.route, scope, body).__aiter__()
                self.n = 0

            def __aiter__(self):
                return self

            async def __anext__(self):
                if replica.fail is not None and self.n >= replica.after:
                    raise replica.fail
                self.n += 1
                return await self.it.__anext__()

            def cancel(self):
                replica.cancelled = True

        return Gen()


def _call(replica, path="/v1/chat/completions", body=b"{}", limit=1 << 20):
    """Run the relay as the ingress does, through Starlette's test client."""
    from fastapi.testclient import TestClient
    from starlette.applications import Starlette
    from starlette.routing import Route

    from mmspec_ray.serve.relay import relay

    async def any_route(request):
        return await relay(replica, request, 3.0, limit)

    return TestClient(Starlette(routes=[Route("/{path:path}", any_route, methods=["GET", "POST"])])).post(
        path, content=body)


def test_the_relay_answers_503_with_retry_after_when_the_replica_dies_or_the_queue_is_full():
    """A replica that dies before answering, or a full queue, is a 503 in the API's error format with Retry-After
    (never the proxy's plain-text 500); one that dies mid-stream ends the stream with an error event; an answer
    passes through unchanged; a body over the limit is a 413 before any replica sees it."""
    from fastapi.responses import JSONResponse, StreamingResponse
    from ray.exceptions import ActorDiedError
    from ray.serve.exceptions import BackPressureError

    async def ok(request):
        return JSONResponse({"echo": (await request.body()).decode()}, status_code=201, headers={"X-Extra": "1"})

    r = _call(_Replica(ok), body=b"hello")
    assert r.status_code == 201 and r.json() == {"echo": "hello"} and r.headers["x-extra"] == "1"
    for fail, text in ((ActorDiedError(), "stopped before answering"),
                       (BackPressureError(num_queued_requests=4, max_queued_requests=4), "at capacity")):
        r = _call(_Replica(ok, fail=fail))
        assert r.status_code == 503 and r.headers["retry-after"] in ("1", "3"), r.headers
        assert r.json()["error"]["code"] == "unavailable" and text in r.json()["error"]["message"]

    async def stream(request):
        async def events():
            for i in range(5):
                yield f"data: {i}\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    full = _call(_Replica(stream))
    assert full.status_code == 200 and full.text == "".join(f"data: {i}\n\n" for i in range(5))
    replica = _Replica(stream, fail=ActorDiedError(), after=3)  # the start message and two events, then gone
    cut = _call(replica)
    assert cut.status_code == 200 and cut.text.startswith("data: 0\n\ndata: 1\n\n")
    assert '"code":"unavailable"' in cut.text and "stopped mid-stream" in cut.text and replica.cancelled
    big = _call(_Replica(ok), body=b"x" * 2048, limit=1024)
    assert big.status_code == 413 and big.json()["error"]["code"] == "too_large"


def test_the_relay_answers_a_replica_failure_in_the_api_format_and_keeps_the_back_pressure_status():
    """Any other failure of the replica is a 500 with the API's error body (before the answer) or an error event
    (mid-stream); a back-pressure status other than 503 (backpressure_config.status_code) is kept."""
    from fastapi.responses import JSONResponse, StreamingResponse
    from ray.serve.exceptions import BackPressureError

    async def ok(request):
        return JSONResponse({"ok": True})

    r = _call(_Replica(ok, fail=RuntimeError("boom")))
    assert r.status_code == 500 and r.json()["error"]["message"] == "internal error: RuntimeError"
    busy = BackPressureError(num_queued_requests=4, max_queued_requests=4, status_code=429, retry_after_s=2)
    r = _call(_Replica(ok, fail=busy))
    assert r.status_code == 429 and "retry-after" in r.headers

    async def stream(request):
        async def events():
            for i in range(5):
                yield f"data: {i}\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    cut = _call(_Replica(stream, fail=RuntimeError("boom"), after=2))
    assert cut.text.startswith("data: 0\n\n") and "internal error: RuntimeError" in cut.text


class _Pending:
    """A stand-in for Serve's response generator: assigned to a replica when `assigned` is set."""

    def __init__(self) -> None:
        self.assigned = asyncio.Event()

    async def _fetch_future_result_async(self) -> None:
        await self.assigned.wait()


def test_replica_watch_answers_no_replica_promptly_and_learns_the_restart_time():
    """A request not at a replica after the probe while none runs -> False (the relay's 503); a request that gets
    assigned -> True, and the outage's length becomes the next Retry-After."""
    from mmspec_ray.serve.replicas import DEFAULT_RESTART_S, ReplicaWatch

    running = {"n": 0}

    async def count() -> int:
        return running["n"]

    async def scenario() -> None:
        watch = ReplicaWatch("app", "Chat", running=count, probe_s=0.05, ttl_s=0.0)
        assert not await watch.wait_assigned(_Pending())
        assert 1.0 <= watch.retry_after_s() <= DEFAULT_RESTART_S
        running["n"] = 1  # a replica runs but is busy: keep waiting (a queued request is not refused)
        busy = _Pending()
        task = asyncio.ensure_future(watch.wait_assigned(busy))
        await asyncio.sleep(0.3)
        assert not task.done()
        busy.assigned.set()
        assert await task
        assert watch.down_since is None and watch.restart_s < 5  # the outage, measured: about 0.35 s
        assert 1.0 <= watch.retry_after_s() < 5

    asyncio.run(scenario())


def _run_asgi(app, scope=None) -> list[dict]:
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope or {"type": "http", "path": "/"}, receive, send))
    return sent


@pytest.mark.parametrize("status,ctype,body,retry", [
    (500, b"text/plain", b"Internal Server Error", True), (503, b"text/plain; charset=utf-8", b"no replica", True),
    (404, b"text/plain", b"Path '/x' not found.", False), (400, None, b"bad", False),
])
def test_the_proxy_middleware_turns_plain_errors_into_api_errors(status, ctype, body, retry):
    """What Ray Serve's proxy answers itself (plain text) reaches the client as the API's JSON error, 5xx with
    Retry-After; JSON errors and successes pass untouched."""
    from mmspec_ray.serve.proxy_errors import JSONErrors

    async def app(scope, receive, send):
        headers = [(b"content-type", ctype)] if ctype else []
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body[:3], "more_body": True})
        await send({"type": "http.response.body", "body": body[3:], "more_body": False})

    start, payload = _run_asgi(JSONErrors(app))
    headers = dict(start["headers"])
    assert start["status"] == status and headers[b"content-type"] == b"application/json"
    err = json.loads(payload["body"])["error"]
    assert body.decode() in err["message"] and err["code"]
    assert int(headers[b"content-length"]) == len(payload["body"])
    assert (b"retry-after" in headers) == retry


def test_the_proxy_middleware_answers_when_the_proxy_sent_nothing_and_passes_the_rest():
    """An ingress that died before answering: the proxy sends nothing (the HTTP server would send a plain-text 500);
    the middleware sends the API's 500 with Retry-After. A JSON error and a 200 stream pass as they are."""
    from mmspec_ray.serve.proxy_errors import JSONErrors

    async def silent(scope, receive, send):
        return None

    start, payload = _run_asgi(JSONErrors(silent))
    assert start["status"] == 500 and json.loads(payload["body"])["error"]["code"] == "unavailable"
    assert dict(start["headers"])[b"retry-after"]

    for status, ctype in ((400, b"application/json"), (200, b"text/event-stream")):
        async def app(scope, receive, send, status=status, ctype=ctype):
            await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", ctype)]})
            await send({"type": "http.response.body", "body": b"data", "more_body": False})

        sent = _run_asgi(JSONErrors(app))
        assert [m.get("status") for m in sent] == [status, None] and sent[1]["body"] == b"data"


def test_metrics_count_what_the_payoff_guard_did(monkeypatch):
    """Each answer adds its cycles; under a guard, one request to its outcome and its plain cycles by why; a decoder
    without a guard (outcome None) counts cycles only."""
    from mmspec_ray.serve import metrics as metrics_mod

    counted: list[tuple[str, float, dict]] = []

    class Recording:
        def __init__(self, name, *args, **kwargs):
            self.name = name

        def inc(self, value=1, tags=None):
            counted.append((self.name, value, tags))

        def observe(self, value, tags=None):
            pass

        def set(self, value, tags=None):
            pass

    for kind in ("Counter", "Histogram", "Gauge"):
        monkeypatch.setattr(metrics_mod.metrics, kind, Recording)
    m = metrics_mod.ServeMetrics("tiny")
    m.guarded("fell_back", 20, {"fell_back": 12, "warm_up": 3})
    m.guarded(None, 7, {})
    assert counted == [
        ("mmspec_serve_cycles", 20, {"model": "tiny"}),
        ("mmspec_serve_guard_requests", 1, {"model": "tiny", "guard": "fell_back"}),
        ("mmspec_serve_guard_plain_cycles", 12, {"model": "tiny", "why": "fell_back"}),
        ("mmspec_serve_guard_plain_cycles", 3, {"model": "tiny", "why": "warm_up"}),
        ("mmspec_serve_cycles", 7, {"model": "tiny"}),
    ]
