"""Hostile request bodies get a 4xx in the API's error format, never an exception that would become a 500: JSON
nested past the parser's depth, seeds outside 64 bits, a top_p that is zero in float32, a number as message content,
lone surrogates in any text; and a property test over generated JSON values and parameters, through the same
checks the endpoint runs before it touches the model (decode_json, parse_request, the messages' media scan)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmspec_ray.serve.errors import APIError
from mmspec_ray.serve.messages import remote_media
from mmspec_ray.serve.protocol import decode_json, parse_request

BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def status_of(raw: bytes) -> int:
    """What the endpoint's pre-model checks answer: 200 when the body passes them, else the APIError's status."""
    try:
        req = parse_request(decode_json(raw))
        remote_media(req.messages)
        return 200
    except APIError as e:
        return e.status


@pytest.mark.parametrize("body,param", [
    ({**BASE, "seed": 2**64}, "seed"),
    ({**BASE, "seed": -(2**63) - 1}, "seed"),
    ({**BASE, "top_p": 1e-46}, "top_p"),
    ({**BASE, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({**BASE, "messages": [{"role": "user", "content": 1.5}]}, "messages[0].content"),
    ({**BASE, "messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
     "messages[0].content[0].text"),
    ({**BASE, "stop": ["x\ud800"]}, "stop[0]"),
])
def test_each_hostile_field_is_a_400_naming_it(body, param):
    raw = json.dumps(body).encode()  # json.dumps writes a lone surrogate as the \ud800 escape a client would send
    with pytest.raises(APIError) as e:
        parse_request(decode_json(raw))
    assert e.value.status == 400 and e.value.param == param, str(e.value)


def test_json_nested_past_the_parser_depth_is_invalid_json():
    raw = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(APIError) as e:
        decode_json(raw)
    assert e.value.status == 400 and e.value.code == "invalid_json"


def test_in_range_values_pass():
    for body in ({**BASE, "seed": 2**64 - 1}, {**BASE, "seed": -(2**63)}, {**BASE, "top_p": 1e-30}):
        assert parse_request(decode_json(json.dumps(body).encode())).model == "m"


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=20)
FIELDS = st.fixed_dictionaries({}, optional={
    "seed": st.integers(min_value=-(2**80), max_value=2**80) | JSON,
    "top_p": st.floats(allow_nan=True, allow_infinity=True) | JSON,
    "temperature": st.floats(allow_nan=True, allow_infinity=True) | JSON,
    "top_k": st.integers(min_value=-(2**70), max_value=2**70) | JSON,
    "max_tokens": st.integers(min_value=-(2**70), max_value=2**70) | JSON,
    "stop": JSON, "stream": JSON, "n": JSON,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x"]) | JSON,
                                                "content": JSON}), max_size=3) | JSON,
})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fields=FIELDS, surrogate=st.booleans())
def test_generated_hostile_bodies_never_raise_anything_but_a_4xx(fields, surrogate):
    body = {**BASE, **fields}
    if surrogate:
        body["messages"] = [{"role": "user", "content": "x\ud800"}]
    raw = json.dumps(body, allow_nan=True).encode()
    assert status_of(raw) in (200, 400)


@given(raw=st.binary(max_size=64) | st.text(max_size=64).map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_generated_raw_bytes_never_raise_anything_but_a_4xx(raw):
    assert status_of(raw) in (200, 400)
