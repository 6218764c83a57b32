"""Gemma3 family (`Gemma3ForConditionalGeneration`, model_type "gemma3"): SigLIP tower + pooled projector + Gemma3
decoder whose layers alternate sliding-window ("sliding_attention") and global ("full_attention") attention.

What differs from the generic adapter, and why:

* KV cache. `DynamicCache(config=...)` gives sliding layers a `DynamicSlidingWindowLayer` that keeps only the last
  `sliding_window - 1` keys. The generic verify mask ([n, seq_len + n]) and commit (slice / index_select at absolute
  cache indices) assume every layer holds all committed tokens, so here every layer keeps its full KV
  (`DynamicCache()` without a config) and the window is enforced by the mask instead. Same attention, more memory
  on the sliding layers.
* Tree mask. One 4D mask for all layers would let sliding layers see the whole prefix, unlike HF generate. Verify
  passes a mask per layer type (the model accepts the `{layer_type: mask}` dict as-is): global layers get
  "committed prefix + tree ancestors"; sliding layers additionally need `q_pos - k_pos < sliding_window`, with
  positions, not cache indices (tree node at depth d sits at `next_pos + d`, committed token j at position j).
  Each node's visible set depends only on its own position and ancestors, so tree verify == each root-to-leaf path.
* Image tokens attend bidirectionally (within each image, and within the window on sliding layers) in prefill:
  the processor's `token_type_ids` go into the prefill forward unchanged, and HF builds that mask. Generated tokens
  are text, so verify needs only the causal tree mask (HF generate also drops `token_type_ids` after prefill).
* Logit softcapping. `Gemma3ForConditionalGeneration.forward` returns `lm_head(norm(h))` without
  `final_logit_softcapping` (only `Gemma3ForCausalLM` caps). `lm_head` here caps only if the model does; each prefill
  checks that `lm_head(hidden[-1])` reproduces the model's last logits (plain or capped) and fails loudly otherwise.

A clip is sent as its frames, one image (and one bidirectional block of `mm_tokens_per_image` tokens) each.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import DynamicCache

from mmspec_ray.targets.base import Request, TargetError, VLMTarget

log = logging.getLogger(__name__)

SLIDING, FULL = "sliding_attention", "full_attention"


class Gemma3Target(VLMTarget):
    """Adapter for `Gemma3ForConditionalGeneration` (Gemma 3 4B/12B/27B and tiny test models)."""

    family = "gemma3"
    model_types = ("gemma3",)
    video_as_frames = True

    def __init__(self, model, processor, feature_layers: tuple[int, ...] = ()) -> None:
        super().__init__(model, processor, feature_layers)
        tc = self.text_config
        self.layer_types: tuple[str, ...] = tuple(getattr(tc, "layer_types", None) or [FULL] * tc.num_hidden_layers)
        unknown = set(self.layer_types) - {SLIDING, FULL}
        if unknown:
            raise TargetError(f"gemma3 layer types {sorted(unknown)} are not supported by this adapter")
        if getattr(tc, "use_bidirectional_attention", False):
            raise TargetError("this Gemma3 uses bidirectional text attention (an encoder); it cannot decode")
        window = getattr(tc, "sliding_window", None)
        self.sliding_window: int | None = int(window) if window and SLIDING in self.layer_types else None
        # Gemma3ForConditionalGeneration does not cap its logits; `_check_head` re-derives this on every prefill.
        self.logit_softcap: float | None = None

    # ---------- model pieces drafters share ----------
    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits exactly as the model computes them from `hidden` (softcapped iff the model softcaps)."""
        logits = self.model.get_output_embeddings()(hidden)
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    def _check_head(self, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        """Confirm `lm_head(hidden)` == model logits on the last position; pick up softcapping if the model does it."""
        raw = self.model.get_output_embeddings()(hidden[:, -1:]).float()
        ref = logits[:, -1:].float()
        # relative to the logit scale: float32 agrees to ~1e-6, half precision to a few ulps (eps 8e-3 for bf16)
        tol = (1e-4 if self.dtype == torch.float32 else 3e-2) * (float(ref.abs().max()) + 1e-6)
        errors: dict[float | None, float] = {None: float((raw - ref).abs().max())}
        cap = getattr(self.text_config, "final_logit_softcapping", None)
        if cap:
            errors[float(cap)] = float((torch.tanh(raw / cap) * cap - ref).abs().max())
        best = min(errors, key=errors.get)
        if errors[best] > tol:
            raise TargetError(
                f"gemma3: lm_head(hidden_states[-1]) does not reproduce the model's logits (max error {errors}); the "
                "installed transformers changed the output head, update the adapter")
        if best != self.logit_softcap:
            log.info("gemma3 output head: final logit softcap %s", best)
        self.logit_softcap = best

    # ---------- request -> model inputs ----------
    def processor_inputs(self, text: str, request: Request) -> dict[str, Any]:
        """The generic call (keeps `token_type_ids` for the bidirectional image mask); errors become TargetError."""
        try:
            inputs = super().processor_inputs(text, request)
        except TargetError:
            raise
        except ValueError as e:
            raise TargetError(f"the gemma3 processor rejected the request ({e}); give the messages exactly one image "
                              "part per image in `images` (a clip counts one per frame)") from e
        if "token_type_ids" not in inputs:  # without it image tokens would attend causally, unlike training / HF
            raise TargetError("the gemma3 processor returned no token_type_ids; use Gemma3Processor")
        return inputs

    # ---------- decoding primitives ----------
    def new_cache(self) -> DynamicCache:
        """A cache whose every layer keeps all committed tokens (sliding layers included; see module docstring)."""
        return DynamicCache()

    def check_prefill(self, out) -> None:
        self._check_head(out.hidden_states[-1], out.logits)

    def tree_mask(self, ancestors: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """{layer type: [1, 1, n, seq_len + n] additive float mask} for a tree with node positions [1, n]."""
        positions = positions[0]
        n, L = positions.shape[0], self.seq_len
        if self.next_pos != L:  # committed token j must sit at position j for the window test below
            raise RuntimeError(f"gemma3 positions out of step with the cache ({self.next_pos} != {L})")
        allowed = torch.ones((n, L + n), dtype=torch.bool, device=self.device)
        allowed[:, L:] = ancestors.to(self.device)
        masks = {FULL: allowed}
        if self.sliding_window is not None:
            kv_pos = torch.cat([torch.arange(L, device=self.device), positions])
            near = positions.unsqueeze(1) - kv_pos.unsqueeze(0) < self.sliding_window
            masks[SLIDING] = allowed & near
        else:
            masks[SLIDING] = allowed
        out = {}
        for kind in set(self.layer_types):
            m = torch.zeros((1, 1, n, L + n), dtype=self.dtype, device=self.device)
            out[kind] = m.masked_fill_(~masks[kind], torch.finfo(self.dtype).min)
        return out


ADAPTERS = (Gemma3Target,)
