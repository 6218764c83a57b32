"""The batch job spec (pydantic): what to read, how to decode, where to write, how many actors.

`DecodeConfig` is everything one `SpecDecoder` needs (also what a Serve deployment is built from); `JobSpec` adds
the pipeline around it. Both load from YAML; the job scripts overlay command-line flags on top.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mmspec_ray.config import MediaLimits, S3Config, SamplingParams
from mmspec_ray.media.errors import TRANSIENT_KINDS, MediaErrorKind
from mmspec_ray.decoding.tree import TreeConfig

# The default drafter of the batch jobs, Serve and `mmspec generate`: the drafter measured fastest on the target
# where one ships (a toy world's, trained on first use: toy/drafter.py SHIPPED), else ngram (resolve_auto_drafter).
DEFAULT_DRAFTER = "auto"

# The embedded default world the jobs run on when no --target / --input is given.
DEFAULT_TOY = "toy-s"
DEFAULT_SPLIT = "test"

CAPTION_PROMPT = "Describe what happens in the video."


# Error kinds a re-run of the job decodes again by itself (the media store was unreachable, not the row wrong).
RETRYABLE_KINDS = tuple(f"media.{k}" for k in TRANSIENT_KINDS)
# Every `error_kind` a row can get (what --retry-errors accepts).
ERROR_KINDS = frozenset({"null_field", "missing_field", "invalid", "too_long", "target", "internal", "crash"} |
                        {f"media.{k}" for k in get_args(MediaErrorKind)})

# Media settings that only decide which rows are refused (size and shape bounds), never an answered row's text: a
# resume may change them (rows they refused are retried with --retry-errors).
REFUSAL_ONLY_MEDIA = ("limits", "short_side")


class MediaSpec(BaseModel):
    """How a row's media becomes model input."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_frames: int | None = Field(None, ge=1, description="uniform frames per clip; None: the target's convention")
    fps: float | None = Field(None, gt=0, description="sample clips at this rate instead of num_frames")
    require: Literal["image", "video"] | None = Field(
        None, description="every row must carry this media kind (a null one is a row error)")
    limits: MediaLimits = MediaLimits()
    image_side: int | Literal["auto"] | None = Field(
        "auto", description="largest side (px) the target's processor uses; images and frames far larger are "
        "scaled down before they travel to the decoder (see media.image.prescale_size). auto: read from the "
        "checkpoint's processor config; null: never scale")
    short_side: Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field(
        "auto", description="short side (px) the target's processor scales every image and frame to before it crops "
        "(CLIP-style shortest_edge: the long side grows with the aspect ratio); bounds the processed size "
        "(limits.max_processed_pixels) before decoding. auto: read from the checkpoint's processor config; null: "
        "the processor bounds its output itself (fixed size, longest edge, pixel count, anyres tiles)")

    @model_validator(mode="after")
    def _one_sampling_rule(self) -> "MediaSpec":
        if self.num_frames is not None and self.fps is not None:
            raise ValueError("give media.num_frames or media.fps, not both")
        return self


class DecodeConfig(BaseModel):
    """One target + one drafter + how to decode: the constructor argument of `SpecDecoder`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    target: str = Field(..., description="checkpoint directory or s3:// prefix (save_pretrained layout)")
    drafter: str = Field(DEFAULT_DRAFTER, description=(
        '"auto" (a toy world\'s shipped drafter: toy-s its suffix drafter, built on first use, toy-m toy-s as draft '
        'model; ngram for other targets), "none", "ngram", "suffix" or '
        "a trained drafter checkpoint directory or s3:// prefix, or draft-model:PATH (a smaller checkpoint of the "
        "target's family sharing its tokenizer and processor)"))
    device: str = Field("auto", description='"auto" (cuda when the actor has a GPU), "cpu", "cuda", "cuda:1" ...')
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    tree: TreeConfig | Literal["auto"] = Field("auto", description=(
        "draft tree (top_k, depth, total_tokens), or auto: calibrated on this machine for this target and drafter "
        "while the first rows decode, then cached (decoding/calibrate.py)"))
    payoff_guard: bool | None = Field(None, description=(
        "shrink the tree per request, down to plain one-token steps, where drafting does not pay (decoding/payoff.py);"
        " None: on with tree auto, off with a tree given explicitly"))
    tie_margin: float | None = Field(None, ge=0.0, description=(
        "half precision: relative top-2 logit gap under which a greedy token is re-decided by a one-token forward "
        "(None: the engine's per-dtype default; 0: off; docs/design.md, Precision)"))
    temperature: float = Field(0.0, ge=0.0, description="0: greedy (the default: one deterministic answer per row)")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="None: the checkpoint's generation config")
    top_k: int | None = Field(None, ge=0, description="None: the checkpoint's generation config (HF's default 50)")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, description="None: the checkpoint's generation config")
    seed: int = Field(0, description="with temperature > 0 each row samples with a seed derived from (seed, id)")
    max_new_tokens: int = Field(128, ge=1)
    stop: tuple[str, ...] = ()
    default_prompt: str | None = Field(None, description="prompt for rows of an input that has no prompt column")
    media: MediaSpec = MediaSpec()
    s3: S3Config = Field(default_factory=S3Config.from_env)
    drafter_dirs: tuple[str, ...] = Field((), description=(
        "folders (local or s3://) where drafter auto also looks for drafters trained for this target, besides "
        "$MMSPEC_HOME/drafters"))
    torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads per decoder (None: leave)")
    speedup_sample: int = Field(16, ge=0, description=(
        "per decoder, this many rows (every 4th once the tree is calibrated) are decoded a second time with plain AR "
        "decoding, so the job summary states the speedup it measured; the AR answer is not written. 0: off"))

    def text_settings(self) -> dict:
        """What decides the output text, recorded in the output's marker: a resume must match it (drafter, tree
        and sampling knobs may change at temperature 0, where they cannot change the text)."""
        return self.model_dump(mode="json", include={
            "target", "drafter", "dtype", "tree", "tie_margin", "temperature", "top_p", "top_k", "min_p",
            "repetition_penalty", "seed", "max_new_tokens", "stop",
            "default_prompt", "media"}, exclude={"media": set(REFUSAL_ONLY_MEDIA)})

    def sampling_for(self, row_id: object) -> SamplingParams:
        """Sampling parameters of one row. The seed depends only on (seed, id), so a retried or resumed row
        samples exactly what it would have the first time."""
        if self.temperature == 0.0:
            return SamplingParams(temperature=0.0, repetition_penalty=self.repetition_penalty)
        digest = hashlib.sha256(f"{self.seed}\x00{row_id}".encode()).digest()
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                              repetition_penalty=self.repetition_penalty,
                              seed=int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


class JobSpec(BaseModel):
    """A batch job: input parquet (local or s3://) -> SpecDecoder actor pool -> output parquet (+ _summary.json)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    input: str = Field(..., description="parquet file or directory, local or s3://")
    output: str = Field(..., description="output directory, local or s3://; re-running resumes into it")
    decode: DecodeConfig
    num_actors: int = Field(1, ge=1, description="most decoder actors (ActorPoolStrategy max_size)")
    min_actors: int | None = Field(None, ge=1, description="fewest decoder actors; None: num_actors (fixed pool)")
    gpus_per_actor: Annotated[float, Field(ge=0.0)] | Literal["auto"] = Field("auto", description=(
        "auto: one GPU per actor where the cluster has GPUs, none where it has none; a fraction packs several actors "
        "on one GPU (the plan says how many and the memory each needs)"))
    cpus_per_actor: float = Field(1.0, gt=0.0, description="lowered automatically so reads keep a CPU")
    cpus_per_task: float = Field(0.5, gt=0.0, description="CPUs of each read / media-decode / write task")
    rows_per_block: int = Field(4, ge=1, description="rows per actor call: the unit of retry and of resume")
    rows_per_file: int | None = Field(64, ge=1, description="combine blocks into files of at least this many rows "
                                      "(None: one file per block; rows not yet in a file are redone on resume)")
    limit: int | None = Field(None, ge=1, description="only the first N input rows (stable across re-runs)")
    overwrite: bool = Field(False, description="delete the job's existing output first instead of resuming")
    break_lease: bool = Field(False, description="take the output's lease even if another job holds it (after a "
                              "crash, instead of waiting for the lease to expire); never while that job still runs")
    redecode_changed: bool = Field(False, description="resume after the input changed: decode the rows of the new or "
                                   "changed input files again and drop rows no longer in the input (without it such "
                                   "a resume is refused)")
    fingerprint_media: bool = Field(False, description="record each row's media URIs' ETag (S3) or size + mtime, and "
                                    "on a resume decode again the rows whose media changed behind the same URI")
    retry_errors: tuple[str, ...] = Field((), description="error kinds to decode again on a resume, besides the "
                                          "always-retried transient ones (e.g. internal, crash, media.not_found)")
    max_row_crashes: int = Field(2, ge=1, description="a row whose decoder process died this many times is filed "
                                 "as error kind `crash` instead of being retried forever")
    progress_interval_s: float = Field(10.0, gt=0.0)
    progress_bars: bool = True

    @field_validator("retry_errors")
    @classmethod
    def _known_kinds(cls, kinds: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [k for k in kinds if k not in ERROR_KINDS]
        if unknown:
            raise ValueError(f"unknown error kind(s) {unknown}; known: {sorted(ERROR_KINDS)}")
        return kinds

    @property
    def pool_min(self) -> int:
        return min(self.min_actors or self.num_actors, self.num_actors)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> "JobSpec":
        """Load a YAML job file; `overrides` (already nested, e.g. decode={...}) win over the file."""
        data = yaml.safe_load(Path(path).read_text()) or {}
        return cls.model_validate(merge(data, overrides))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def merge(base: dict, over: dict) -> dict:
    """Recursive dict merge; values in `over` win, nested dicts merge."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
