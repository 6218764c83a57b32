"""What `build_app(args)` reads: the decoder (the batch layer's `DecodeConfig`), the served model name, request
limits, media fetching rules, auth, and the deployment's Serve options (resources, back-pressure, scaling)."""

from __future__ import annotations

import os
from pathlib import PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mmspec_ray.batch.jobspec import DecodeConfig

# Serve options of the chat deployment when the config says nothing: one request decoding (batch size 1) plus one
# staged behind it, a bounded proxy queue, 503 + Retry-After past it.
DEFAULT_DEPLOYMENT: dict[str, Any] = {
    "max_ongoing_requests": 2,
    "max_queued_requests": 16,
    "backpressure_config": {"status_code": 503, "retry_after_s": 1},
    "ray_actor_options": {"num_cpus": 1},
    "health_check_period_s": 10,
}


# The HTTP ingress (`HTTPFront`): it holds no model and only relays, so it reserves no CPU and never queues; the
# chat deployment's queue bound answers overload.
FRONT_DEPLOYMENT: dict[str, Any] = {
    "max_ongoing_requests": 1000,
    "ray_actor_options": {"num_cpus": 0},
}


# Characters per token of context in the default text bound: natural text and code average 2-5 characters a token.
CHARS_PER_TOKEN = 8


class FetchSettings(BaseModel):
    """Media URLs a client may name: plain http(s) only for listed hosts (private, loopback and link-local addresses
    refused whatever the list says), s3:// only in listed buckets, so no client makes the server read an object
    with the server's own credentials that it could not read itself."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    allow_hosts: tuple[str, ...] = Field((), description="host names allowed in http(s) media URLs; empty = off")
    allow_s3_buckets: tuple[str, ...] = Field((), description=(
        "buckets whose objects clients may name as s3:// media URLs (read with the server's own credentials); "
        "empty = s3:// media URLs refused"))
    timeout_s: float = Field(10.0, gt=0)


class ServeLimits(BaseModel):
    """Per-request bounds (413 past the byte limits, 400 past the counts)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    max_image_bytes: int = Field(16 * 1024 * 1024, ge=1)
    max_video_bytes: int = Field(64 * 1024 * 1024, ge=1)
    max_media_parts: int = Field(16, ge=0)
    max_tokens: int = Field(4096, ge=1, description="largest max_tokens a request may ask for")
    max_prompt_chars: int | None = Field(None, ge=1, description=(
        "characters of text a request may carry, checked before tokenizing; None: the target's context length x "
        f"{CHARS_PER_TOKEN} (more text than that cannot fit at any usual tokenization)"))

    def prompt_chars(self, context_tokens: int) -> int:
        """The text bound for a target of `context_tokens` positions."""
        return self.max_prompt_chars or CHARS_PER_TOKEN * context_tokens


class ServeSettings(BaseModel):
    """The `args` of `build_app`: a Serve config's `applications[].args`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    decode: DecodeConfig
    model_name: str | None = Field(None, description="the `model` clients send; default: the target's basename")
    default_max_tokens: int = Field(256, ge=1)
    limits: ServeLimits = ServeLimits()
    fetch: FetchSettings = FetchSettings()
    api_key_env: str | None = Field(None, description="environment variable holding the bearer token clients "
                                    "must send (read in the replica; never logged); None: no auth")
    allow_unauthenticated_network: bool = Field(False, description=(
        "serve even where Ray's token auth is off and its servers listen beyond loopback (only behind a firewall "
        "that keeps every untrusted host off the cluster's network)"))
    deployment: dict[str, Any] = Field(default_factory=dict, description="Serve deployment options merged over "
                                       "DEFAULT_DEPLOYMENT (a config's deployments: section overrides both)")
    gpus_per_replica: Annotated[float, Field(ge=0.0)] | Literal["auto"] = Field("auto", description=(
        "auto: one GPU per replica where the cluster has GPUs, none where it has none (a num_gpus in the "
        "deployment's ray_actor_options wins); a fraction packs replicas on one GPU"))

    @property
    def served_name(self) -> str:
        """The model id of /v1/models and of every response."""
        if self.model_name:
            return self.model_name
        return PurePosixPath(self.decode.target.rstrip("/")).name or "mmspec"

    def api_key(self) -> str | None:
        """The expected bearer token (None: auth off). A named but unset variable is a config error."""
        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ValueError(f"api_key_env names {self.api_key_env!r} but that environment variable is empty or "
                             "unset in the replica; set it (e.g. runtime_env.env_vars) or drop api_key_env")
        return key

    def deployment_options(self) -> dict[str, Any]:
        """DEFAULT_DEPLOYMENT with `deployment` merged over it (nested dicts merge)."""
        from mmspec_ray.batch.jobspec import merge

        return merge(DEFAULT_DEPLOYMENT, self.deployment)
