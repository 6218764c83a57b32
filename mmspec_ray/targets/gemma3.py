"""Gemma3 family (`Gemma3ForConditionalGeneration`, model_type "gemma3"): SigLIP tower + pooled projector + Gemma3
decoder whose layers alternate sliding-window ("sliding_attention") and global ("full_attention") attention.

What differs from the generic adapter, and why:

* KV cache and tree mask: the generic ones (`VLMTarget.new_cache` / `tree_mask`). Every layer keeps its full KV and
  the window is enforced by the mask: global layers see "committed prefix + tree ancestors", sliding layers
  additionally only keys less than `sliding_window` slots back, passed as the `{layer_type: mask}` dict the model
  accepts as-is. Each node's visible set depends only on its own depth and ancestors, so tree verify == each
  root-to-leaf path.
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

from mmspec_ray.targets.base import Request, TargetError, VLMTarget

log = logging.getLogger(__name__)


class Gemma3Target(VLMTarget):
    """Adapter for `Gemma3ForConditionalGeneration` (Gemma 3 4B/12B/27B and tiny test models)."""

    family = "gemma3"
    model_types = ("gemma3",)
    video_as_frames = True

    def __init__(self, model, processor, feature_layers: tuple[int, ...] = ()) -> None:
        super().__init__(model, processor, feature_layers)
        if getattr(self.text_config, "use_bidirectional_attention", False):
            raise TargetError("this Gemma3 uses bidirectional text attention (an encoder); it cannot decode")
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
        """The generic call, which must keep `token_type_ids` (the bidirectional image mask)."""
        inputs = super().processor_inputs(text, request)
        if "token_type_ids" not in inputs:  # without it image tokens would attend causally, unlike training / HF
            raise TargetError("the gemma3 processor returned no token_type_ids; use Gemma3Processor")
        return inputs

    # ---------- decoding primitives ----------
    def check_prefill(self, out) -> None:
        self._check_head(out.hidden_states[-1], out.logits)


ADAPTERS = (Gemma3Target,)
