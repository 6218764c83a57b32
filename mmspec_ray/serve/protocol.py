"""The slice of OpenAI's chat completions schema this server accepts, and the response / chunk bodies it sends."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mmspec_ray.serve.errors import APIError
from mmspec_ray.decoding.output import Generation, GenerationStats


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class ChatRequest(BaseModel):
    """POST /v1/chat/completions body. Unknown fields are ignored (clients send many); `messages` is checked
    part by part in messages.py so that errors name the bad element."""

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[Any] = Field(..., min_length=1)
    # sampling: a field left out takes the checkpoint's generation config (as vLLM does); top_k, min_p and
    # repetition_penalty are vLLM's extra sampling parameters
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, description="0 disables")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1, description="torch's seed range")
    n: int = Field(1, ge=1, le=1, description="one choice per request (batch-size-1 decoding)")
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float | None) -> float | None:
        if v is not None and float(np.float32(v)) == 0.0:  # sampling runs in float32: it would be 0 there
            raise ValueError(f"top_p {v!r} is zero in float32; use at least 1e-38")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


def check_content_type(value: str | None) -> None:
    """A body must say it is JSON: a form or plain-text post (what a web page can make a browser send without
    asking the server first) is a 415."""
    kind = (value or "").split(";", 1)[0].strip().lower()
    if kind != "application/json" and not (kind.startswith("application/") and kind.endswith("+json")):
        raise APIError(415, f"Content-Type {value or '(none)'!r}: send the body as JSON with Content-Type: "
                       "application/json", param="Content-Type", code="unsupported_media_type")


def decode_json(raw: bytes) -> Any:
    """The request body as JSON; anything undecodable (bad syntax or encoding, nesting too deep for the parser)
    is a 400 `invalid_json`."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON ({e})", code="invalid_json") from e
    except RecursionError:
        raise APIError(400, "request body is not valid JSON here: nested too deeply", code="invalid_json") from None


def check_text(data: Any) -> None:
    """Every string in the body must be encodable text: a lone surrogate (JSON's unpaired \\ud800) would reach
    the tokenizer as a TypeError. Walks the body iteratively (any depth), naming the first bad field."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                param = where or None
                raise APIError(400, f"{where or 'body'}: text with a lone surrogate is not valid Unicode",
                               param=param, code="invalid_value") from None
        elif isinstance(v, dict):
            stack += [(f"{where}.{k}" if where else str(k), x) for k, x in v.items()]
        elif isinstance(v, list):
            stack += [(f"{where}[{i}]", x) for i, x in enumerate(v)]


def check_shape(messages: list[Any]) -> None:
    """Every message an object with a string role (or none) and a string, list or null content; every content part
    an object with a string type. Anything else (a list as role or type) is a 400 naming it."""
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise APIError(400, f"{where}: expected a {{role, content}} object", param=where, code="invalid_value")
        role = m.get("role")
        if role is not None and not isinstance(role, str):
            raise APIError(400, f"{where}.role: expected a string (system, user or assistant), got "
                           f"{type(role).__name__}", param=f"{where}.role", code="invalid_value")
        content = m.get("content")
        if not isinstance(content, (str, list, type(None))):
            raise APIError(400, f"{where}.content: expected a string or a list of content parts, got "
                           f"{type(content).__name__}", param=f"{where}.content", code="invalid_value")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            at = f"{where}.content[{j}]"
            if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                raise APIError(400, f"{at}: expected a part like {{\"type\": \"text\", \"text\": ...}} (an object "
                               "whose type is a string)", param=at, code="invalid_value")


# Fields of OpenAI's schema this server does not implement: a request that asks for one gets a 400 naming it, never
# a 200 that silently lacks what it asked for. field -> (is the value a request for the feature?, what to say)
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "logprobs": (lambda v: v not in (None, False), "log probabilities are not returned by this server"),
    "top_logprobs": (lambda v: v is not None, "log probabilities are not returned by this server"),
    "tools": (lambda v: v not in (None, []), "this server does not call tools; send no tools (or tool_choice "
              "\"none\")"),
    "tool_choice": (lambda v: v not in (None, "none", "auto"), "this server does not call tools"),
    "functions": (lambda v: v not in (None, []), "this server does not call functions"),
    "function_call": (lambda v: v not in (None, "none", "auto"), "this server does not call functions"),
    "response_format": (lambda v: not (v is None or (isinstance(v, dict) and v.get("type") == "text")),
                        "only plain text answers (response_format {\"type\": \"text\"}); JSON modes and schemas are "
                        "not enforced by this server"),
    "logit_bias": (lambda v: v not in (None, {}), "logit_bias is not applied by this server"),
    "presence_penalty": (lambda v: v not in (None, 0, 0.0), "presence_penalty is not applied by this server; "
                         "repetition_penalty is"),
    "frequency_penalty": (lambda v: v not in (None, 0, 0.0), "frequency_penalty is not applied by this server; "
                          "repetition_penalty is"),
}


def check_supported(data: dict[str, Any]) -> None:
    """A 400 naming the first field that asks for a feature this server does not implement."""
    tools_off = data.get("tool_choice") == "none"
    for name, (asks, why) in UNSUPPORTED.items():
        if name not in data or (name == "tools" and tools_off):
            continue
        if asks(data[name]):  # (`in` on a tuple compares with ==: any JSON value is safe)
            raise APIError(400, f"{name}: {why}", param=name, code="unsupported_parameter")


def parse_request(data: Any) -> ChatRequest:
    """Validate a decoded JSON body; the first problem becomes a 400 naming its field."""
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_request")
    check_text(data)
    if isinstance(data.get("messages"), list):
        check_shape(data["messages"])
    check_supported(data)
    try:
        return ChatRequest.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise APIError(400, f"{param}: {err['msg']}", param=param, code="invalid_value") from None


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex[:24]}"


def usage(stats: GenerationStats, completion_tokens: int) -> dict[str, Any]:
    """OpenAI usage, plus this server's speculative decoding stats (accepted draft tokens per verify cycle)."""
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": stats.prompt_tokens + completion_tokens}


def spec_stats(stats: GenerationStats) -> dict[str, Any]:
    """The speculative decoding figures of one answer (`spec_stats` in every final body; the server adds read_s,
    reading the body, queue_s, its wait for the decoder, server_s, its time from the request's arrival to sending
    the answer, and first_token_s, from arrival to the first token committed)."""
    return {"accepted_per_cycle": round(stats.mean_accepted, 4),
            "tokens_per_forward": round(stats.tokens_per_forward, 4), "cycles": stats.cycles,
            "prefill_s": round(stats.prefill_s, 6), "decode_s": round(stats.total_s, 6),
            # what the payoff guard did (decoding/payoff.py): drafted, fell_back, held, warm_up; null without one
            "guard": stats.guard, "guard_plain_cycles": sum(stats.guard_plain_cycles.values())}


def completion_body(cid: str, model: str, gen: Generation, timing: dict[str, float] | None = None) -> dict[str, Any]:
    return {
        "id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": gen.text},
                     "finish_reason": gen.finish_reason, "logprobs": None}],
        "usage": usage(gen.stats, len(gen.token_ids)),
        "spec_stats": {**spec_stats(gen.stats), **(timing or {})},
    }


def chunk_body(cid: str, model: str, created: int, delta: dict[str, Any], finish: str | None = None,
               **extra: Any) -> dict[str, Any]:
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}


def sse_event(body: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON body."""
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
