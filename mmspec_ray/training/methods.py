"""Drafter training methods: what each drafter method tells the one shared trainer.

A method declares the target features its examples must carry (`needs`), builds its trainable head, collates
examples into a batch, computes its loss, says how many of the epochs its stage 1 (text only) takes by default,
and wraps a head as a ready drafter (for the trainer's held-out τ). The trainer owns everything else: the loop,
the stage schedule, the optimiser and LR schedule, checkpoints, resume and held-out τ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from mmspec_ray.drafters.eagle import Eagle2Drafter, Eagle2Head
from mmspec_ray.drafters.msd import MSDDrafter, MSDHead
from mmspec_ray.drafters.specflash import SpecFlashDrafter, SpecFlashHead
from mmspec_ray.training.datagen import FeatureExample
from mmspec_ray.training.losses import eagle_loss
from mmspec_ray.training.specflash import expand_example, specflash_loss

if TYPE_CHECKING:
    from mmspec_ray.drafters.base import Drafter
    from mmspec_ray.targets.base import VLMTarget


def causal_pad_mask(valid: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool: causal, no attention to padding (padding rows attend to themselves to stay finite)."""
    T = valid.shape[1]
    m = torch.ones(T, T, dtype=torch.bool).tril()[None] & valid[:, None, :]
    m |= torch.eye(T, dtype=torch.bool)[None]
    return m[:, None]


def eagle_collate(examples: list[FeatureExample], idx: list[int], noise: float,
                  gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Entry j pairs embeds[j+1] with hidden[j] (noised) and predicts hidden[j+1]; loss only where j+1 is an answer
    position whose successor is still inside the sequence. `visual[b, j]`: token j+1 is a media token (examples
    stored without a media mask count as none)."""
    T = max(examples[i].input_ids.shape[0] for i in idx) - 1
    d = examples[idx[0]].hidden.shape[1]
    B = len(idx)
    emb, feat, tgt = torch.zeros(B, T, d), torch.zeros(B, T, d), torch.zeros(B, T, d)
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    valid = torch.zeros(B, T, dtype=torch.bool)
    visual = torch.zeros(B, T, dtype=torch.bool)
    for b, i in enumerate(idx):
        ex = examples[i]
        n = ex.input_ids.shape[0] - 1
        emb[b, :n] = ex.embeds[1:].float()
        feat[b, :n] = ex.hidden[:-1].float()
        tgt[b, :n] = ex.hidden[1:].float()
        valid[b, :n] = True
        if ex.media is not None:
            visual[b, :n] = ex.media[1:]
        loss_mask[b, max(0, ex.n_prompt - 1): max(0, n - 1)] = True
    if noise > 0:
        feat = feat + (torch.rand(feat.shape, generator=gen) - 0.5) * noise
    return {"emb": emb, "feat": feat, "tgt": tgt, "loss_mask": loss_mask, "valid": valid, "visual": visual}


class TrainingMethod:
    """EAGLE-2 (the base every feature-level method extends): fc + one layer, EAGLE losses, one stage."""

    name: ClassVar[str] = "eagle2"
    needs: ClassVar[tuple[str, ...]] = ("hidden", "embeds")  # FeatureExample fields the examples must carry
    head_class: ClassVar[type[Eagle2Head]] = Eagle2Head
    drafter_class: ClassVar[type[Eagle2Drafter]] = Eagle2Drafter

    def head(self, target: "VLMTarget") -> nn.Module:
        return self.head_class(self.head_class.config_class.for_target(target))

    def drafter(self, head: nn.Module, target: "VLMTarget") -> "Drafter":
        return self.drafter_class(head, target)

    def default_text_epochs(self, epochs: int) -> int:
        """Stage-1 (text-only) epochs when the run does not say."""
        return 0

    def check(self, examples: list[FeatureExample]) -> None:
        missing = [f for f in self.needs if examples and getattr(examples[0], f) is None]
        if missing:
            raise ValueError(f"{self.name} training needs {missing} in the feature examples, which these were "
                             "generated without; regenerate them with the current `generate_features`")

    def collate(self, examples: list[FeatureExample], idx: list[int], noise: float,
                gen: torch.Generator) -> dict[str, torch.Tensor]:
        return eagle_collate(examples, idx, noise, gen)

    def loss(self, head: nn.Module, batch: dict[str, torch.Tensor], lm_head_weight: torch.Tensor,
             p_weight: float) -> tuple[torch.Tensor, dict[str, float]]:
        emb = batch["emb"]
        pos = torch.arange(emb.shape[1])[None].expand(emb.shape[0], -1)
        pred = head(emb, batch["feat"], pos, causal_pad_mask(batch["valid"]), visual=batch["visual"])
        return eagle_loss(pred, batch["tgt"], lm_head_weight, batch["loss_mask"], p_weight=p_weight)


class MSDMethod(TrainingMethod):
    """MSD: EAGLE-2 with media entries fed the raw projected embeddings (`MSDHead`); two stages by default, the
    first half of the epochs text only, then the gradual text -> multimodal ramp (spec §3.2)."""

    name = "msd"
    needs = ("hidden", "embeds", "media")
    head_class = MSDHead
    drafter_class = MSDDrafter

    def default_text_epochs(self, epochs: int) -> int:
        return epochs // 2


class SpecFlashMethod(TrainingMethod):
    """SpecFLASH: per-image / per-frame latent compression + the semi-autoregressive head (`SpecFlashHead`),
    trained in one multimodal stage with the block-diagonal placeholder expansion (training/specflash.py).
    Options (the C/N ratio, the query bank, K) override the head config's defaults, for ablations."""

    name = "specflash"
    needs = ("hidden", "embeds", "media")
    head_class = SpecFlashHead
    drafter_class = SpecFlashDrafter

    def __init__(self, ratio: float | None = None, group: int | None = None, max_queries: int | None = None) -> None:
        self.options = {k: v for k, v in (("ratio", ratio), ("group", group), ("max_queries", max_queries))
                        if v is not None}
        self.target: "VLMTarget | None" = None

    def head(self, target: "VLMTarget") -> nn.Module:
        """The head for `target`; also records the target, whose media layout cuts stored examples' media runs
        into images / frames (`VLMTarget.media_pieces` from the ids)."""
        self.target = target
        cfg = self.head_class.config_class.for_target(target).model_copy(update=self.options)
        return self.head_class(cfg)

    def collate(self, examples: list[FeatureExample], idx: list[int], noise: float,
                gen: torch.Generator) -> dict:
        if self.target is None:
            raise RuntimeError("specflash collate before head(target): the media pieces need the target")
        cfg = self.head_class.config_class.for_target(self.target).model_copy(update=self.options)
        return {"items": [expand_example(examples[i], self.target.media_pieces(examples[i].input_ids), cfg.ratio,
                                         cfg.max_queries, cfg.group, noise, gen) for i in idx]}

    def loss(self, head: nn.Module, batch: dict, lm_head_weight: torch.Tensor,
             p_weight: float) -> tuple[torch.Tensor, dict[str, float]]:
        return specflash_loss(head, batch["items"], lm_head_weight, p_weight)


METHODS: dict[str, type[TrainingMethod]] = {m.name: m for m in (TrainingMethod, MSDMethod)}
METHODS[SpecFlashMethod.name] = SpecFlashMethod


def training_method(name: str) -> TrainingMethod:
    if name not in METHODS:
        raise ValueError(f"no training for drafter method {name!r}; trainable methods: {sorted(METHODS)}")
    return METHODS[name]()
