"""HiViS drafter (Xie, Wang, Cheng, "HiViS: Hiding Visual Tokens from the Drafter for Speculative Decoding in
Vision-Language Models"): EAGLE-2 whose drafter never reads a visual token.

The drafter's context is the prompt's text tokens only: every media position is dropped, and the remaining text
entries are chained EAGLE-style (entry k pairs the embedding of text token k+1 with the target's feature at text
token k; across a removed media span the last text token before it is paired with the first text token after it,
the literal reading of the paper's Eq. 3). The target's last-layer features at text positions have attended to
the media inside the target, so they carry the visual information implicitly. The drafter's prefill is therefore
as long as the prompt's text, whatever the number of image or video tokens. Positions are contiguous over the
compressed sequence (0 .. l-1, then on), the drafter's own 1-D RoPE, so 1-D RoPE and M-RoPE targets are alike.

A learned sequential embedding e_seq^i (i = 0 .. 3) is added to every entry's fc output: i = 0 where the feature
is the target's (all context entries), i = min(j, 3) for a tree node at level j, whose feature is the drafter's
own j-th guess. Adding `W_s e_seq^i` after fc is the paper's concatenation `fc([e; f; e_seq^i])` with d_s = d
(spec §2.2). A stage-1 drafter has trained only e_seq^0 and uses it at every step (`seq_rows` = 1); stage 2
copies it to the other rows and trains them in multi-step self-feedback (training/methods.py, `HiViSMethod`).
Tree growth, scratch KV and acceptance are EAGLE-2's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from mmspec_ray.drafters.base import register_drafter
from mmspec_ray.drafters.eagle import Eagle2Config, Eagle2Drafter, Eagle2Head

if TYPE_CHECKING:
    from mmspec_ray.targets.base import TargetOutput, VLMTarget


class HiViSConfig(Eagle2Config):
    """EAGLE-2's sizes plus the number of sequential embeddings (the paper's threshold 3 + 1)."""

    method: str = "hivis"
    seq_steps: int = 4
    # How the authors' released Qwen2.5-VL heads were trained (drafters/released.py sets both for them): each media
    # run is dropped together with the <|vision_start|> before it, the <|vision_end|> after it and one token more,
    # and the kept entries keep their original token indices as positions (a gap where the media was). Heads
    # trained here (and the authors' LLaVA heads) drop the media positions only and number the entries 0 .. l-1.
    drop_vision_markers: bool = False
    original_positions: bool = False


class HiViSHead(Eagle2Head):
    """fc + one decoder layer (EAGLE-2's) plus the sequential embeddings `seq_embed` [seq_steps, d]."""

    config_class = HiViSConfig

    def __init__(self, cfg: HiViSConfig) -> None:
        super().__init__(cfg)
        self.seq_embed = nn.Parameter(torch.zeros(cfg.seq_steps, cfg.hidden_size))
        # rows of seq_embed in use: step i reads row min(i, seq_rows - 1); 1 after stage 1 (one row trained), all
        # after stage 2. Saved with the weights, so a checkpoint drafts exactly as it was trained.
        self.register_buffer("seq_rows", torch.tensor(cfg.seq_steps, dtype=torch.long))

    def with_step(self, x: torch.Tensor, step: torch.Tensor | None) -> torch.Tensor:
        """x + e_seq[min(step, seq_rows - 1)]; no `step` means the target's features (e_seq^0) everywhere."""
        if step is None:
            return x + self.seq_embed[0].to(x.dtype)
        idx = step.to(x.device).clamp(0, int(self.seq_rows) - 1)
        return x + self.seq_embed[idx].to(x.dtype)

    def start_multi_step(self) -> None:
        """Stage 2 begins: every step's embedding starts as the stage-1 e_seq^0 (spec A1), all rows in use."""
        with torch.no_grad():
            self.seq_embed[1:] = self.seq_embed[0]
        self.seq_rows.fill_(self.cfg.seq_steps)


def text_keep(prefill: "TargetOutput", markers: bool = False) -> torch.Tensor:
    """[n] bool: the prompt positions the drafter reads. The media positions (`media_mask`) dropped; `markers`:
    also the token before each media run, the token after it and one more (the authors' Qwen rule). A prefill
    without a media mask cannot be compressed, so it is refused."""
    if prefill.media_mask is None:
        raise ValueError("the HiViS drafter needs the target's media mask at prefill (TargetOutput.media_mask)")
    media = prefill.media_mask[0].to(prefill.hidden.device)
    keep = ~media
    if markers:
        from mmspec_ray.targets.base import media_runs

        for a, b in media_runs(media):
            keep[max(0, a - 1):b + 2] = False
    return keep


@register_drafter("hivis")
class HiViSDrafter(Eagle2Drafter):
    """EAGLE-2 drafting state around a HiViS head; `begin` reads the prompt's text entries only."""

    head_class = HiViSHead

    @torch.inference_mode()
    def begin(self, target: "VLMTarget", prefill: "TargetOutput", root: int) -> None:
        """Context = text entries only: entry k is [embedding of text token k+1 (the root after the last); target
        feature at text token k], positions 0 .. l-1, sequential embedding e_seq^0."""
        self.ctx_len, self.last, self.pos_offset = 0, None, 0
        cfg = self.head.cfg
        keep = text_keep(prefill, cfg.drop_vision_markers)
        embeds, feats = prefill.inputs_embeds[0][keep], prefill.hidden[0][keep]
        pos = torch.nonzero(keep).flatten() if cfg.original_positions else None  # entry k sits at its feature's index
        self._extend(torch.cat([embeds[1:], self._embed([root])], 0), feats, pos=pos)
        if cfg.original_positions:  # later entries continue from the prompt's length
            self.pos_offset = int(keep.shape[0]) - self.ctx_len
        self.prefill_tokens = self.ctx_len
