"""MSD drafter (Lin et al. 2025, "Speculative Decoding Reimagined for Multimodal Large Language Models"): EAGLE-2
with the text and visual inputs decoupled.

Context entry j normally pairs the embedding of token j+1 with the target feature f_j through the fc layer (EAGLE's
shifted concatenation). MSD treats entries whose next token is a media token apart: their decoder input is the
target's projected visual embedding E[j+1] itself, untouched (no fc, no feature). So if an image occupies
positions [p, p+n), entries p-1 .. p+n-2 take v_0 .. v_{n-1}, and the last image entry p+n-1 is fused as usual
(f_{p+n-1} with the first text token after the image). This is the authors' code rule (spec §2.3), driven by the
target's media mask, so several images, video frames and every family's media layout follow the same rule.
Tree nodes and accepted tokens are text: the rest is EAGLE-2 (same head, same tree growth, same KV handling).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mmspec_ray.drafters.base import register_drafter
from mmspec_ray.drafters.eagle import Eagle2Config, Eagle2Drafter, Eagle2Head
from mmspec_ray.drafters.layers import rms_normalise

if TYPE_CHECKING:
    from mmspec_ray.targets.base import VLMTarget


class MSDConfig(Eagle2Config):
    """Same sizes as EAGLE-2's head; `method` tells `load_drafter` to decouple the visual inputs."""

    method: str = "msd"
    # RMS-normalise the raw visual entries (layers.rms_normalise). The decoder layer has no input norm (EAGLE's), so
    # a projector output hundreds of times the text entries' size swamps its attention and training diverges. New
    # heads set it (for_target); a config saved without the field loads as it was trained (False).
    media_norm: bool = False

    @classmethod
    def for_target(cls, target: "VLMTarget") -> "MSDConfig":
        return super().for_target(target).model_copy(update={"media_norm": True})


class MSDHead(Eagle2Head):
    """fc + one decoder layer, as EAGLE-2's; media entries bypass the fc (same parameters, so an `eagle2` and an
    `msd` head differ only in how they build the layer's input)."""

    config_class = MSDConfig

    def inputs(self, embeds: torch.Tensor, feats: torch.Tensor, visual: torch.Tensor | None) -> torch.Tensor:
        """[B, T, d]: embeds where `visual` ([B, T] bool: entry j's next token is a media token), else
        fc([embeds; feats])."""
        fused = self.fc(torch.cat([embeds, feats], dim=-1))
        if visual is None:
            return fused
        raw = rms_normalise(embeds) if self.cfg.media_norm else embeds
        return torch.where(visual[..., None].to(fused.device), raw.to(fused.dtype), fused)


@register_drafter("msd")
class MSDDrafter(Eagle2Drafter):
    """EAGLE-2 drafting state around an MSD head: `begin` passes the prefill's media mask (shifted by one, as the
    embeddings are), so the media entries of the prompt take the raw projected embeddings."""

    head_class = MSDHead
