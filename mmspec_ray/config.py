"""Typed settings shared by every layer: sampling, S3 access, media limits, and where the project keeps its files."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    """How the next token is chosen. temperature == 0 means greedy (argmax). A field left None takes the
    checkpoint's generation config (HF's defaults where it says nothing: top_k 50, top_p 1, no penalty), resolved by
    the engine (`decoding/processors.py: resolve_sampling`); an unresolved None reads as off / greedy."""

    model_config = ConfigDict(frozen=True)

    temperature: float | None = Field(None, ge=0.0, allow_inf_nan=False, description="tiny values work (see warp)")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, description="0 disables top-k")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="drop tokens below min_p x the top probability")
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False, description="HF's; 1 disables")
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return not self.temperature


class S3Config(BaseModel):
    """Where S3 lives. Credentials are never stored here: they come from the standard AWS sources."""

    model_config = ConfigDict(frozen=True)

    endpoint_override: str | None = None
    scheme: str = "https"
    region: str | None = None
    # Transient errors (connection, throttling, 5xx) of media reads are retried with exponential backoff:
    # `retries` more attempts, waiting retry_base_s, 2x, 4x ... capped at retry_max_s (default ~31 s in all).
    retries: int = Field(6, ge=0)
    retry_base_s: float = Field(0.5, ge=0.0)
    retry_max_s: float = Field(16.0, ge=0.0)

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before retry number `attempt` (0-based)."""
        return min(self.retry_max_s, self.retry_base_s * (2 ** attempt))

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
    max_video_pixels: int = 200_000_000  # pixels of all frames kept from one clip (after scaling): ~600 MB RGB
    max_aspect_ratio: float = Field(200.0, ge=1.0, description=(
        "long side / short side of an image or video frame; a more extreme one is refused before it is decoded "
        "(Qwen2-VL's own processor refuses past 200:1)"))
    max_processed_pixels: int = Field(25_000_000, ge=1, description=(
        "pixels of an image or frame once the target's processor has scaled its short side to media.short_side "
        "(the long side grows with the aspect ratio; ~10 bytes a pixel while processing); refused before "
        "decoding past it"))


def mmspec_home() -> Path:
    """`$MMSPEC_HOME` (default ~/.cache/mmspec): toy worlds, drafters, checkpoint mirrors, tree calibrations, and the
    batch jobs' default outputs."""
    return Path(os.environ.get("MMSPEC_HOME", Path.home() / ".cache" / "mmspec"))
