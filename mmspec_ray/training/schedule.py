"""Training stages as a per-epoch data mixture: stage 1 trains on text-only examples, stage 2 on multimodal ones,
entered gradually (MSD's two-stage schedule) or at once. A single-stage run is all multimodal (EAGLE-2 today).

A mixed run (`mixed`, HiViS: ShareGPT + LLaVA-Mix665k in both of its stages) draws every item of both pools in
every epoch after the text-only ones, shuffled together.

MSD's rule (spec §3.2, from the authors' code): E epochs in all, stage 1 = epochs 1..E1 (text only), then the
share of multimodal examples rises linearly, r_e = (e - E1) / (E - E1) for e = E1+1 .. E (1-indexed), so the last
epoch is all multimodal. Each epoch of a mixed run has min(N_text, N_multimodal) items, each drawn from the
multimodal pool with probability r_e (independently), from the text pool otherwise.
"""

from __future__ import annotations

import numpy as np
from typing import Protocol

from pydantic import BaseModel, Field, model_validator


class StageSchedule(BaseModel):
    """Which pool each epoch's items come from. `text_epochs` = 0: one stage, every item multimodal."""

    epochs: int = Field(ge=1)
    text_epochs: int = Field(0, ge=0)
    gradual: bool = True  # stage 2 ramps the multimodal share up linearly (False: 100 % from its first epoch)
    mixed: bool = False  # epochs after the text-only ones hold every multimodal and every text item, shuffled

    @property
    def uses_text(self) -> bool:
        """Whether the run reads the text-only pool at all (so a caller knows to load it)."""
        return self.text_epochs > 0 or self.mixed

    @model_validator(mode="after")
    def _stage2_exists(self) -> "StageSchedule":
        if self.text_epochs >= self.epochs:
            raise ValueError(f"text_epochs ({self.text_epochs}) must be below epochs ({self.epochs}): stage 2 "
                             "(multimodal data) needs at least one epoch")
        return self

    def ratio(self, epoch: int) -> float:
        """Share of multimodal items in `epoch` (1-indexed)."""
        if not 1 <= epoch <= self.epochs:
            raise ValueError(f"epoch {epoch} is outside 1..{self.epochs}")
        if epoch <= self.text_epochs:
            return 0.0
        if not self.gradual or self.text_epochs == 0:  # one stage, or stage 2 entered at once
            return 1.0
        return (epoch - self.text_epochs) / (self.epochs - self.text_epochs)

    def items(self, epoch: int, n_multimodal: int, n_text: int, rng: np.random.Generator) -> list[tuple[bool, int]]:
        """The epoch's items in training order: (from the multimodal pool?, index in that pool)."""
        if self.mixed and epoch > self.text_epochs:
            order = rng.permutation(n_multimodal + n_text)
            return [(True, int(i)) if i < n_multimodal else (False, int(i - n_multimodal)) for i in order]
        if self.text_epochs == 0:
            return [(True, int(i)) for i in rng.permutation(n_multimodal)]
        if n_text == 0 or n_multimodal == 0:
            raise ValueError(f"a two-stage schedule needs text and multimodal examples (got {n_text} text, "
                             f"{n_multimodal} multimodal); generate a text-only corpus or set text_epochs=0")
        n = min(n_multimodal, n_text)
        r = self.ratio(epoch)
        pm, pt = rng.permutation(n_multimodal)[:n], rng.permutation(n_text)[:n]
        pick = rng.random(n) < r
        return [(True, int(pm[i])) if pick[i] else (False, int(pt[i])) for i in range(n)]

    def items_per_epoch(self, n_multimodal: int, n_text: int) -> int:
        if self.mixed:
            return n_multimodal + n_text
        return n_multimodal if self.text_epochs == 0 else min(n_multimodal, n_text)


class StagedMethod(Protocol):
    """What the stage schedule reads of a training method (`training.methods.TrainingMethod`)."""

    direct_stage2: bool
    mixes_text: bool

    def default_text_epochs(self, epochs: int) -> int: ...


class TrainConfig(BaseModel):
    """The shared trainer's settings (every method, single-process and Ray Train)."""

    epochs: int = Field(10, ge=1)
    batch_size: int = Field(16, ge=1)
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 50
    noise: float = 0.2  # uniform feature noise amplitude: U(-noise/2, noise/2), as in EAGLE
    grad_clip: float = 0.5
    p_weight: float = 0.1
    seed: int = 0
    eval_max_new_tokens: int = 96
    eval_every: int = Field(1, ge=1, description="held-out tau every this many epochs and after the last one (it "
                            "decodes real prompts: seconds per epoch on a CPU, more than a small epoch's training)")
    text_epochs: int | None = Field(None, ge=0, description="stage-1 (text-only) epochs; None: the method's default")
    bucket_batches: int = Field(8, ge=1, description="length bucketing: consecutive items are sorted by length "
                                "in chunks of this many batches (less padding, less varied batches)")
    gradual: bool = True  # stage 2 ramps the multimodal share linearly (False: all multimodal at once)
    multistep_epochs: int | None = Field(None, ge=0, description="epochs of a method's multi-step stage at the "
                                         "end of the run (HiViS stage 2); None: the method's default")


def stage_schedule(method: StagedMethod, cfg: TrainConfig) -> StageSchedule:
    """The stages a run of `method` under `cfg` goes through (the method's defaults where cfg leaves them open)."""
    text = method.default_text_epochs(cfg.epochs) if cfg.text_epochs is None else cfg.text_epochs
    return StageSchedule(epochs=cfg.epochs, text_epochs=text, gradual=cfg.gradual and not method.direct_stage2,
                         mixed=method.mixes_text)
