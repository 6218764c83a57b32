"""Typed settings shared by every layer: sampling, S3 access, media limits."""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    """How the next token is chosen. temperature == 0 means greedy (argmax)."""

    model_config = ConfigDict(frozen=True)

    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class S3Config(BaseModel):
    """Where S3 lives. Credentials are never stored here: they come from the standard AWS sources."""

    model_config = ConfigDict(frozen=True)

    endpoint_override: str | None = None
    scheme: str = "https"
    region: str | None = None

    @classmethod
    def from_env(cls) -> "S3Config":
        """Read `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL` (e.g. http://127.0.0.1:9000) and `AWS_REGION`."""
        url = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if not url:
            return cls(region=region)
        scheme = "http" if url.startswith("http://") else "https"
        return cls(endpoint_override=url.split("://", 1)[-1], scheme=scheme, region=region)


class MediaLimits(BaseModel):
    """Upper bounds that protect a worker from hostile or accidental huge inputs."""

    model_config = ConfigDict(frozen=True)

    max_bytes: int = 512 * 1024 * 1024
    max_image_pixels: int = 64_000_000
    max_video_frames: int = 100_000
    max_video_seconds: float = 4 * 3600.0
