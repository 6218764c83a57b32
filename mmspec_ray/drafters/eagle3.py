"""EAGLE-3 drafter (Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time
Test"): the target's states at three decoder layers (low, mid, high) fused by `fc` (3d -> d), one decoder layer whose
attention reads [normed token embedding; normed feature] (2d wide), its own final norm and LM head over a reduced
draft vocabulary, mapped to target ids by `d2t` (an offset: target id = i + d2t[i]).

Wiring, as SafeAILab/EAGLE, SpecForge, vLLM and SGLang run these heads: feature k is hs[k], the input of decoder
layer k (HF `hidden_states[k]`), by default k in (2, L // 2, L - 3), concatenated in that order; the layer's residual
is the un-normed fused feature; the draft's own pre-norm output is fed back as the next step's feature (no fc);
released heads read the token embedding of a media position's placeholder id, as SpecForge trains its Qwen2.5-VL
heads and vLLM runs them (heads trained here read the merged media embeddings, as every drafter here).
Positions: entry j (token j+1) sits at token j+1's target position minus one, as SpecForge numbers the shifted
sequence. On a 1-D RoPE target that is j; on an M-RoPE target (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) the head rotates by
the target's own 3-axis ids (`mrope_section`, chunked or interleaved as the target's), so media positions share ids
as they do in the target and generated tokens continue at the target's rope delta.
The drafting loop is EAGLE-2's (`Eagle2Drafter`): only the head, the features and the logits differ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from mmspec_ray.drafters.base import register_drafter
from mmspec_ray.drafters.eagle import Eagle2Config, Eagle2Drafter, Eagle2Head
from mmspec_ray.drafters.layers import DecoderLayer, RMSNorm

if TYPE_CHECKING:
    from mmspec_ray.targets.base import TargetOutput, VLMTarget


def default_feature_layers(n_layers: int) -> list[int]:
    """EAGLE-3's feature layers for a target of n decoder layers: hs[2], hs[L // 2], hs[L - 3], each kept inside
    [1, L - 1] (tiny targets have fewer layers than the rule assumes)."""
    return [min(max(k, 1), max(n_layers - 1, 1)) for k in (2, n_layers // 2, n_layers - 3)]


class Eagle3Config(Eagle2Config):
    method: str = "eagle3"
    draft_vocab_size: int = 0  # 0: the target's vocabulary (no d2t mapping needed)
    # the target ids the draft vocabulary holds, ascending (trained here: the most frequent answer tokens of the
    # training data); [] with a reduced vocabulary: d2t / t2d come with the weights (released heads)
    draft_tokens: list[int] = []
    feature_layers: list[int] = []  # hs indices (input of decoder layer k); [] = default_feature_layers(L)
    head_dim: int | None = None  # None: hidden_size // num_heads
    norm_before_residual: bool = False  # residual = the normed feature (some producers); False: the un-normed one
    layout: str = "mmspec"  # where the weights came from (a released layout keeps its name here, for inspect)
    # what a media position of the prompt feeds the drafter: "merged" (the target's own input: the media embeddings,
    # as this project trains every drafter) or "token" (the placeholder id's token embedding, as SpecForge trains
    # released Qwen2.5-VL heads and vLLM runs them)
    media_embeds: Literal["merged", "token"] = "merged"
    # M-RoPE: the rotary frequencies per axis (temporal, height, width), as the target's text config; [] = 1-D RoPE
    mrope_section: list[int] = []
    mrope_interleaved: bool = False  # Qwen3-VL's layout of the sections (else Qwen2-VL's chunks)

    @classmethod
    def for_target(cls, target: "VLMTarget") -> "Eagle3Config":
        base = Eagle2Config.for_target(target)
        n = int(getattr(target.text_config, "num_hidden_layers", 1))
        section, interleaved = target_mrope(target)
        return cls(**{**base.model_dump(), "method": "eagle3"}, draft_vocab_size=target.vocab_size,
                   feature_layers=default_feature_layers(n), mrope_section=section, mrope_interleaved=interleaved,
                   head_dim=getattr(target.text_config, "head_dim", None) if section else None)


def target_mrope(target: "VLMTarget") -> tuple[list[int], bool]:
    """The target's M-RoPE layout from its text config (`rope_parameters`, or the older `rope_scaling`):
    ([temporal, height, width] frequencies, interleaved?), or ([], False) for a 1-D RoPE target. A target that
    rotates only part of each head (GLM-4.1V: `partial_rotary_factor` 0.5) has fewer sections than the head's
    frequencies: the sections are scaled up to them (the drafter's own RoPE, whole-head; same axes, same ratios)."""
    tc = target.text_config
    rope = getattr(tc, "rope_parameters", None) or getattr(tc, "rope_scaling", None) or {}
    section = [int(n) for n in rope.get("mrope_section") or []]
    if not section:
        return [], False
    heads = int(getattr(tc, "num_attention_heads", 1))
    half = int(getattr(tc, "head_dim", None) or tc.hidden_size // heads) // 2
    if half % sum(section):
        return [], False  # no whole-number scaling: 1-D positions (text-only prompts are alike)
    return [n * (half // sum(section)) for n in section], bool(rope.get("mrope_interleaved", False))


class Eagle3Head(Eagle2Head):
    """fc (3d -> d, no bias) + one decoder layer over [input_layernorm(embedding); hidden_norm(feature)] + final
    norm + draft LM head; d2t / t2d buffers."""

    config_class = Eagle3Config

    def __init__(self, cfg: Eagle3Config) -> None:
        nn.Module.__init__(self)
        self.cfg = cfg
        d = cfg.hidden_size
        vd = cfg.draft_vocab_size or cfg.target_vocab_size
        self.fc = nn.Linear(3 * d, d, bias=False)
        self.embed_norm = RMSNorm(d, cfg.rms_eps)
        self.hidden_norm = RMSNorm(d, cfg.rms_eps)
        self.layer = DecoderLayer(d, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.rope_theta,
                                  cfg.rms_eps, in_dim=2 * d, head_dim=cfg.head_dim, qkv_bias=cfg.qkv_bias,
                                  mrope=(cfg.mrope_section, cfg.mrope_interleaved) if cfg.mrope_section else None)
        self.norm = RMSNorm(d, cfg.rms_eps)
        self.lm_head = nn.Linear(d, vd, bias=False)
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.target_vocab_size, dtype=torch.bool) if vd == cfg.target_vocab_size
                             else torch.zeros(cfg.target_vocab_size, dtype=torch.bool))
        if cfg.draft_tokens:
            used = torch.tensor(sorted(cfg.draft_tokens), dtype=torch.long)
            if len(used) != vd:
                raise ValueError(f"EAGLE-3 config: {len(used)} draft tokens for a draft vocabulary of {vd}")
            self.d2t.copy_(used - torch.arange(vd))  # an offset: target id = i + d2t[i]
            self.t2d.zero_()
            self.t2d[used] = True

    def forward(self, embeds: torch.Tensor, feats: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None, at: int = 0,
                visual: torch.Tensor | None = None, step: torch.Tensor | None = None) -> torch.Tensor:
        """embeds [B, T, d]; feats [B, T, 3d] (the target's three layers) or [B, T, d] (a draft output fed back)
        -> the draft's pre-norm outputs [B, T, d] (what the next step reads back)."""
        h = self.fc(feats) if feats.shape[-1] != self.cfg.hidden_size else feats
        hn = self.hidden_norm(h)
        qkv_in = torch.cat([self.embed_norm(embeds), hn], dim=-1)
        return self.layer.block(hn if self.cfg.norm_before_residual else h, qkv_in, pos, mask, kv, at)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """[.., Vd] draft-vocabulary logits of pre-norm outputs."""
        return self.lm_head(self.norm(out))

    def target_ids(self) -> torch.Tensor:
        """[Vd] the target id of each draft id (i + d2t[i])."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t


def frequent_tokens(answers: list[torch.Tensor], vocab: int, size: int) -> list[int]:
    """The draft vocabulary of `size` ids: the most frequent tokens of the answers, then (where fewer were seen) the
    lowest unseen ids, ascending (SafeAILab's and SpecForge's construction)."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for a in answers:
        counts += torch.bincount(a.long().flatten(), minlength=vocab)[:vocab]
    order = sorted(range(vocab), key=lambda i: (-int(counts[i]), i))
    return sorted(order[:size])


def check_layers(cfg: Eagle3Config, target: "VLMTarget") -> list[int]:
    """The feature layers this head reads on `target`, refused by name when the target has too few layers."""
    n = int(getattr(target.text_config, "num_hidden_layers", 1))
    layers = list(cfg.feature_layers) or default_feature_layers(n)
    if len(layers) != 3 or any(not 0 <= k < n for k in layers):
        raise ValueError(f"EAGLE-3 drafter reads target layers {layers} (hidden_states indices: the input of each "
                         f"decoder layer), but this target has {n} decoder layers; it was trained for another target")
    return layers


@register_drafter("eagle3")
class Eagle3Drafter(Eagle2Drafter):
    """EAGLE-2's drafting state around an EAGLE-3 head; asks the target for its three feature layers."""

    head_class = Eagle3Head

    def __init__(self, head: Eagle3Head, target: "VLMTarget") -> None:
        super().__init__(head, target)
        self.layers = check_layers(head.cfg, target)
        target.feature_layers = tuple(sorted(set(target.feature_layers) | set(self.layers)))
        self.ids = self.head.target_ids().to(target.device)
        self.identity = self.head.lm_head.weight.shape[0] == target.vocab_size and bool((self.head.d2t == 0).all())
        self.mrope = bool(head.cfg.mrope_section)

    def begin(self, target: "VLMTarget", prefill: "TargetOutput", root: int) -> None:
        """An M-RoPE head: generated entries continue at the target's rope delta (its next position id minus its
        sequence length, fixed at prefill)."""
        self.pos_offset = target.next_pos - target.seq_len if self.mrope else 0
        super().begin(target, prefill, root)

    def prompt_positions(self, prefill: "TargetOutput") -> torch.Tensor | None:
        """[3, n] for an M-RoPE head on a prompt with media: entry j (token j+1) at token j+1's target ids minus
        one, the root (the first generated token) at the next position id minus one; None otherwise (slot ids)."""
        if not self.mrope or prefill.positions is None:
            return None
        root = prefill.positions.new_full((3, 1), prefill.input_ids.shape[1] + self.pos_offset)
        return torch.cat([prefill.positions[:, 0, 1:], root], 1) - 1

    def features(self, out: "TargetOutput") -> torch.Tensor:
        """[1, n, 3d]: hs[low], hs[mid], hs[high] concatenated."""
        return torch.cat([out.layers[k] for k in self.layers], dim=-1)

    def prompt_embeds(self, prefill: "TargetOutput") -> torch.Tensor:
        """The prompt's embeddings as the head was trained on them: the merged media embeddings, or (released heads)
        the token embeddings of the prompt ids, media positions their placeholder's."""
        if self.head.cfg.media_embeds == "token":
            return self.target.embed_tokens(prefill.input_ids)
        return prefill.inputs_embeds

    def logprobs(self, out: torch.Tensor) -> torch.Tensor:
        """[n, V]: the draft vocabulary's log-probabilities at their target ids, -inf at every other id."""
        lp = torch.log_softmax(self.head.logits(out).float(), -1)
        if self.identity:
            return lp
        full = lp.new_full((lp.shape[0], self.target.vocab_size), float("-inf"))
        full[:, self.ids] = lp
        return full
