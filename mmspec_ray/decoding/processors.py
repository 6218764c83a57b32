"""The checkpoint's generation config, read as HF `generate` reads it, so our answer is the checkpoint's own answer.

- `resolve_sampling`: request parameters over the generation config's defaults (do_sample / temperature, top-k,
  top-p, min-p, repetition penalty), as HF merges `generate(**kwargs)` over `model.generation_config`.
- `HistoryProcessors`: HF's own logits processors that read the token history (repetition penalty, no-repeat
  n-grams, min length / min new tokens, suppressed tokens), applied to each tree node with that node's own history
  (prompt + committed answer + the node's ancestors), so a verified tree scores exactly what AR decoding would.
- `check_generation_config`: any other setting HF would apply (beam search, guidance, forced or banned sequences
  ...) is refused with the setting named: never silently ignored.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

from mmspec_ray.config import SamplingParams

# generation config settings this engine cannot apply losslessly, with the value at which HF leaves them off
# (None always means off)
_OFF: dict[str, Any] = {
    "num_beams": 1, "num_beam_groups": 1, "penalty_alpha": None, "dola_layers": None, "guidance_scale": 1.0,
    "sequence_bias": None, "encoder_repetition_penalty": 1.0, "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None, "forced_bos_token_id": None, "forced_eos_token_id": None, "remove_invalid_values": False,
    "exponential_decay_length_penalty": None, "begin_suppress_tokens": None, "watermarking_config": None,
    "top_h": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "diversity_penalty": 0.0,
}


def effective_generation_config(model) -> GenerationConfig:
    """What HF generate decodes with when called without generation arguments: the model's generation config
    (the checkpoint's generation_config.json) over HF's global defaults (top_k 50, temperature 1.0 ...). Uses
    transformers' own merge (`_prepare_generation_config`, transformers pinned to 5.23 in pyproject.toml)."""
    return model._prepare_generation_config(None)[0]


class UnsupportedGenerationConfig(ValueError):
    """The checkpoint's generation config asks for decoding this engine cannot reproduce exactly."""


def check_generation_config(gc: GenerationConfig) -> None:
    """Refuse settings HF generate would apply that this engine cannot (names each one and what to do)."""
    bad = [f"{name}={value!r}" for name, off in _OFF.items()
           if (value := getattr(gc, name, None)) is not None and value != off]
    if bad:
        raise UnsupportedGenerationConfig(
            f"the checkpoint's generation config sets {', '.join(bad)}, which speculative decoding cannot apply "
            "losslessly (it supports greedy and sampled decoding with temperature, top-k, top-p, min-p, repetition "
            "penalty, no-repeat n-grams, min length and suppressed tokens); remove these from generation_config.json "
            "to decode this checkpoint")


def resolve_sampling(request: SamplingParams, gc: GenerationConfig) -> SamplingParams:
    """Concrete sampling parameters: the request's where it sets them (None = not set), else the generation
    config's, as HF resolves them. Temperature 0 means greedy (HF: do_sample=False); unset temperature follows the
    config's do_sample. Top-k / top-p / min-p default to the config's (HF's own default top-k is 50)."""
    if request.temperature is not None:
        temperature = request.temperature
    else:
        temperature = float(gc.temperature if gc.temperature is not None else 1.0) if gc.do_sample else 0.0
    def pick(name: str, default: Any) -> Any:
        mine = getattr(request, name)
        theirs = getattr(gc, name, None)
        return mine if mine is not None else (theirs if theirs is not None else default)
    return SamplingParams(temperature=temperature, top_k=int(pick("top_k", 0)), top_p=float(pick("top_p", 1.0)),
                          min_p=pick("min_p", None), repetition_penalty=float(pick("repetition_penalty", 1.0)),
                          seed=request.seed)


class HistoryProcessors:
    """HF logits processors that depend on the tokens so far, for one request. Logits are processed in float32, as
    HF generate processes `next_token_logits`. Empty (and free) when the config and request set none of them."""

    def __init__(self, gc: GenerationConfig, sampling: SamplingParams, eos_ids: set[int],
                 prompt_ids: torch.Tensor) -> None:
        device = prompt_ids.device
        eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)
        n_prompt = int(prompt_ids.shape[-1])
        procs: list[LogitsProcessor] = []
        if sampling.repetition_penalty is not None and sampling.repetition_penalty != 1.0:
            procs.append(RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty))
        if gc.no_repeat_ngram_size:
            procs.append(NoRepeatNGramLogitsProcessor(gc.no_repeat_ngram_size))
        if gc.min_length and eos.numel():
            procs.append(MinLengthLogitsProcessor(gc.min_length, eos, device=device))
        if gc.min_new_tokens and eos.numel():
            procs.append(MinNewTokensLengthLogitsProcessor(n_prompt, gc.min_new_tokens, eos, device=device))
        if gc.suppress_tokens:
            procs.append(SuppressTokensLogitsProcessor(gc.suppress_tokens, device=device))
        self.procs = procs
        self.history = prompt_ids.reshape(-1).to(torch.long)  # [P + committed]: prompt, then the answer so far

    def __bool__(self) -> bool:
        return bool(self.procs)

    def commit(self, tokens: list[int]) -> None:
        """Append committed answer tokens (the root of the next tree is appended by the tree it roots)."""
        if self.procs and tokens:
            self.history = torch.cat([self.history, torch.tensor(tokens, device=self.history.device)])

    def reopen_last(self) -> None:
        """Hand the prompt's last token back as the root of a tree verified inside the prefill (a draft chain):
        `commit` then appends it again with the accepted path."""
        if self.procs:
            self.history = self.history[:-1]

    def _apply(self, ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        scores = logits.float().reshape(1, -1)
        for p in self.procs:
            scores = p(ids.reshape(1, -1), scores)
        return scores.reshape(-1)

    def next_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[V] logits after the committed history (the prefill's last position)."""
        return self._apply(self.history, logits) if self.procs else logits

    def tree_logits(self, logits: torch.Tensor, tokens: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
        """[n, V] logits of a verified tree (tokens [n], ancestors [n, n] bool: row i is i and its ancestors), node
        i processed with history + the path root..i (the root is the last committed token, not yet in `history`)."""
        if not self.procs:
            return logits
        out = logits.float().clone()
        tokens, ancestors = tokens.to(self.history.device), ancestors.to(self.history.device)
        for i in range(tokens.shape[0]):  # parents precede children: index order is path order
            out[i] = self._apply(torch.cat([self.history, tokens[ancestors[i]]]), logits[i])
        return out
