"""Fixtures shared by the Serve test modules: one local Ray + Serve instance on loopback with two apps built from
the tiny LLaVA checkpoint (`main`: auth on, roomy queue; `tight`: one request at a time, a queue of one), and the
SpecEngine reference the endpoint's answers must match."""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import pytest

from mmspec_ray.decoding.tree import TreeConfig

MODEL = "tiny-llava"
KEY = "sk-test-not-a-secret"
KEY_ENV = "MMSPEC_SERVE_TEST_KEY"
FRAMES = 4


def png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def unknown_serve_keys(model: Any, data: Any, where: str = "") -> list[str]:
    """Keys of a Serve config (a dict for `model`, e.g. ServeDeploySchema) that the schema does not define, at every
    level, where Ray's schema would silently ignore them (`max_ongoing_request`, `autoscaling_config.max_replica`).
    Dict-typed fields (`args`, `runtime_env`) are left to their own validators."""
    import typing

    from pydantic import BaseModel

    def models(ann: Any) -> list[type]:
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            return [ann]
        return [m for a in typing.get_args(ann) for m in models(a)]

    out: list[str] = []
    if not isinstance(data, dict):
        return out
    fields = {f.alias or n: f for n, f in model.model_fields.items()}
    for key, value in data.items():
        if key not in fields:
            out.append(f"{where}{key}")
            continue
        for sub in models(fields[key].annotation)[:1]:  # Union[Dict, AutoscalingConfig]: the model's keys
            items = value if isinstance(value, list) else [value]
            for i, item in enumerate(items):
                at = f"{where}{key}[{i}]." if isinstance(value, list) else f"{where}{key}."
                out += unknown_serve_keys(sub, item, at)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServeApp:
    port: int
    key: str
    s3: Any
    bucket: str
    metrics_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @staticmethod
    def handle(name: str):
        """A handle to app `name`'s decoder deployment (ChatServer: its `stats()`), behind the HTTP ingress."""
        from ray import serve

        from mmspec_ray.serve.app import DEPLOYMENT_NAME

        return serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=name)


def app_args(ckpt: str, s3_config, **over: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "decode": {"target": ckpt, "drafter": "ngram", "device": "cpu", "media": {"num_frames": FRAMES},
                   "s3": s3_config.model_dump(),
                   "tree": TreeConfig().model_dump()},  # the reference engine's: the same cycles to compare
        "model_name": MODEL,
        "default_max_tokens": 16,
        "limits": {"max_body_bytes": 2_000_000, "max_image_bytes": 200_000, "max_video_bytes": 400_000,
                   "max_tokens": 10_000, "max_media_parts": 4},
        "deployment": {"ray_actor_options": {"num_cpus": 0.5}, "health_check_period_s": 2},
    }
    args.update(over)
    return args


@pytest.fixture(scope="module")
def serve_app(ckpt, s3_server):
    """Ray (2 CPUs, no dashboard) + Serve on 127.0.0.1:<free port>; apps `main` at / and `tight` at /tight."""
    import ray
    from ray import serve

    from mmspec_ray.serve.app import build_app

    from mmspec_ray.batch.cluster import start_local_ray

    from mmspec_ray.serve.__main__ import serve_environment

    os.environ["RAY_AUTH_MODE"] = "disabled"
    serve_environment(os.environ)  # as `python -m mmspec_ray.serve` starts it: the proxy's errors in JSON
    os.environ[KEY_ENV] = KEY  # replicas inherit the driver's environment (read there, never logged)
    metrics_port = free_port()
    start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False, _metrics_export_port=metrics_port)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        bucket = s3_server.new_bucket("serve")
        serve.run(build_app(app_args(ckpt, s3_server.s3_config, api_key_env=KEY_ENV, deployment={
            "ray_actor_options": {"num_cpus": 0.5}, "max_ongoing_requests": 2, "max_queued_requests": 64},
            fetch={"allow_s3_buckets": [bucket]})),
            name="main", route_prefix="/")
        serve.run(build_app(app_args(ckpt, s3_server.s3_config, fetch={"allow_s3_buckets": [bucket]}, deployment={
            "ray_actor_options": {"num_cpus": 0.5}, "max_ongoing_requests": 1, "max_queued_requests": 1})),
            name="tight", route_prefix="/tight")
        yield ServeApp(port=port, key=KEY, s3=s3_server, bucket=bucket, metrics_port=metrics_port)
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def reference(ckpt):
    """SpecEngine (n-gram drafter) on a Request built by hand from the same messages and media bytes."""
    from mmspec_ray.config import SamplingParams
    from mmspec_ray.drafters.base import load_drafter
    from mmspec_ray.media import load_image, load_video
    from mmspec_ray.decoding.engine import SpecEngine
    from mmspec_ray.targets import Request, load_target

    target = load_target(ckpt)
    engine = SpecEngine(target, load_drafter("ngram", target))

    def run(messages: list[dict], max_new: int, images: list[bytes] = (), videos: list[bytes] = (),
            sampling: SamplingParams | None = None):
        # LLaVA takes a clip as its frames: each video part is FRAMES image parts, its frames where the part stands
        msgs, pixels = [], []
        next_image, next_video = iter(images), iter(videos)
        for m in messages:
            content = m["content"]
            if isinstance(content, str):
                content = [{"type": "text", "text": content}]
            parts = []
            for p in content:
                if p["type"] == "text":
                    parts.append(p)
                elif p["type"] == "video_url":
                    parts += [{"type": "image"}] * FRAMES
                    pixels += load_video(next(next_video), num_frames=FRAMES).frames
                else:
                    parts.append({"type": "image"})
                    pixels.append(load_image(next(next_image)))
            msgs.append({"role": m["role"], "content": parts})
        request = Request(messages=msgs, images=tuple(pixels))
        return engine.generate(request, sampling or SamplingParams(), max_new)

    return run


def post(app: ServeApp, path: str, body: Any, headers: dict[str, str] | None = None, method: str = "POST",
         key: bool = True):
    """A raw HTTP request; returns the response (an HTTPError is a response too). `body`: dict, bytes or None."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    h = {"Content-Type": "application/json", **(headers or {})}
    if key:
        h.setdefault("Authorization", f"Bearer {app.key}")
    req = urllib.request.Request(app.url + path, data=data, headers=h, method=method)
    try:
        return urllib.request.urlopen(req, timeout=60)
    except urllib.error.HTTPError as e:
        return e
