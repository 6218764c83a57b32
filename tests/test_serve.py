"""The Serve endpoint end to end on loopback, with the official `openai` client: plain, streaming, image, video and
several-image requests must give exactly what SpecEngine gives for the same request (greedy), streamed chunks must
concatenate to the non-streamed answer, a client that disconnects must stop its decoding.

One Ray instance and two Serve apps for the module (2 CPUs, replicas of 0.5 CPU, a tiny random LLaVA), shut down at
the end. Error codes and the load test are in test_serve_limits.py, which shares these fixtures.
"""

from __future__ import annotations

import base64
import http.client
import json
import time

import pytest

pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from serve_fixtures import MODEL, data_url, png, post, reference, serve_app  # noqa: E402,F401
from mmspec_ray.toy.clips import encode_mp4  # noqa: E402
from tiny import random_images  # noqa: E402

MAX_NEW = 12


@pytest.fixture(scope="module")
def client(serve_app):
    return openai.OpenAI(base_url=f"{serve_app.url}/v1", api_key=serve_app.key, max_retries=0, timeout=60)


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def video(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def ask(client, messages, **kw):
    kw.setdefault("max_tokens", MAX_NEW)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=messages, **kw)


def streamed(client, messages, **kw) -> tuple[str, list, str | None]:
    kw.setdefault("max_tokens", MAX_NEW)
    kw.setdefault("temperature", 0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True, **kw))
    body = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return body, chunks, finish[-1] if finish else None


def test_models_and_health(serve_app, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    with post(serve_app, "/health", None, method="GET") as resp:
        assert resp.status == 200 and json.loads(resp.read())["status"] == "ok"


def test_plain_text_matches_engine_and_streams_the_same(client, reference):
    messages = user(text("describe the image objects"))
    resp = ask(client, messages)
    ref = reference(messages, max_new=MAX_NEW)
    assert resp.choices[0].message.content == ref.text
    assert resp.choices[0].finish_reason == ref.finish_reason == "length"
    assert resp.usage.completion_tokens == len(ref.token_ids) == MAX_NEW
    assert resp.usage.prompt_tokens == ref.stats.prompt_tokens
    stats = resp.model_extra["spec_stats"]
    assert stats["cycles"] == ref.stats.cycles and stats["accepted_per_cycle"] == pytest.approx(ref.stats.mean_accepted,
                                                                                                abs=1e-3)
    assert stats["guard"] is None and stats["guard_plain_cycles"] == 0  # a tree given as is: no payoff guard
    body, chunks, finish = streamed(client, messages)
    assert body == ref.text and finish == "length"
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 2  # sent as it was decoded
    assert chunks[0].choices[0].delta.role == "assistant"


def test_image_video_and_several_images(serve_app, client, reference):
    imgs = [png(im) for im in random_images(3, seed=7, size=64)]
    clip = encode_mp4(random_images(6, seed=8, size=64), fps=6)
    s3_uri = serve_app.s3.put(serve_app.bucket, "img/b.png", imgs[1])
    cases = [
        user(image(data_url(imgs[0], "image/png")), text("what is in the image")),
        user(video(data_url(clip, "video/mp4")), text("what is happening in the video")),
        user(text("compare"), image(data_url(imgs[0], "image/png")), image(s3_uri),
             image(data_url(imgs[2], "image/png")), text("the three images")),
        user(video(data_url(clip, "video/mp4")), text("then"), image(data_url(imgs[2], "image/png"))),  # clip first
    ]
    media = [{"images": [imgs[0]]}, {"videos": [clip]}, {"images": imgs}, {"images": [imgs[2]], "videos": [clip]}]
    for messages, m in zip(cases, media):
        ref = reference(messages, max_new=MAX_NEW, **m)
        assert ask(client, messages).choices[0].message.content == ref.text
        assert streamed(client, messages)[0] == ref.text


def test_vllm_sampling_extras_reach_the_engine(client, reference):
    """top_k, min_p and repetition_penalty (vLLM's extra parameters) are applied as the engine applies them; a
    strong penalty changes the greedy answer, so the test fails if the field is dropped."""
    from mmspec_ray.config import SamplingParams

    messages = user(text("describe the image objects"))
    extra = {"repetition_penalty": 1.8, "top_k": 3, "min_p": 0.05}
    got = ask(client, messages, max_tokens=24, extra_body=extra).choices[0].message.content
    want = reference(messages, max_new=24, sampling=SamplingParams(temperature=0.0, **extra))
    assert got == want.text
    assert want.text != reference(messages, max_new=24).text


def test_multi_turn_system_stop_and_seed(client, reference):
    messages = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "red circle"},
                {"role": "assistant", "content": "a red circle"}, {"role": "user", "content": "and the square"}]
    ref = reference(messages, max_new=20)
    words = ref.text.split()
    stop = " ".join(words[3:5]) if len(words) > 5 else words[-1]
    cut = ref.text[: ref.text.find(stop)]
    resp = ask(client, messages, max_tokens=20, stop=[stop])
    assert resp.choices[0].message.content == cut and resp.choices[0].finish_reason == "stop"
    assert streamed(client, messages, max_tokens=20, stop=[stop])[0] == cut
    # temperature > 0: a seed makes the sample reproducible, streamed or not
    a = ask(client, messages, max_tokens=16, temperature=0.9, top_p=0.9, seed=3).choices[0].message.content
    b = ask(client, messages, max_tokens=16, temperature=0.9, top_p=0.9, seed=3).choices[0].message.content
    c = streamed(client, messages, max_tokens=16, temperature=0.9, top_p=0.9, seed=3)[0]
    assert a == b == c


def test_usage_chunk_when_asked(client):
    _, chunks, _ = streamed(client, user(text("red")), stream_options={"include_usage": True})
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == MAX_NEW and not chunks[-1].choices


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
def test_client_disconnect_stops_decoding(serve_app, stream):
    """An answer of 3000 tokens, dropped early (after its first event, or 1 s in): the replica stops decoding."""
    handle = serve_app.handle("main")
    before = handle.stats.remote().result()
    conn = http.client.HTTPConnection("127.0.0.1", serve_app.port, timeout=30)
    body = json.dumps({"model": MODEL, "messages": user(text("red")), "max_tokens": 3000, "temperature": 0,
                       "stream": stream})
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json",
                                                         "Authorization": f"Bearer {serve_app.key}"})
    if stream:
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
    else:
        deadline = time.time() + 20
        while handle.stats.remote().result()["decoding"] == 0 and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
    conn.sock.close()
    conn.close()
    deadline = time.time() + 30
    while time.time() < deadline:
        now = handle.stats.remote().result()
        if now.get("cancelled", 0) > before.get("cancelled", 0) and not now["decoding"]:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the replica did not stop decoding: {now}")
    assert now["tokens"] - before.get("tokens", 0) < 3000


def test_data_url_helper_roundtrip():
    raw = b"\x89PNG..."
    assert base64.b64decode(data_url(raw, "image/png").split(",", 1)[1]) == raw
