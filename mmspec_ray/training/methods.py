"""Drafter training methods: what each drafter method tells the one shared trainer.

A method declares the target features its examples must carry (`needs`), builds its trainable head, collates
examples into a batch, computes its loss, says how many of the epochs its stage 1 (text only) takes by default,
and wraps a head as a ready drafter (for the trainer's held-out τ). The trainer owns everything else: the loop,
the stage schedule, the optimiser and LR schedule, checkpoints, resume and held-out τ.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from mmspec_ray.drafters.dream import DreamDrafter, DreamHead
from mmspec_ray.drafters.eagle import Eagle2Drafter, Eagle2Head
from mmspec_ray.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head, frequent_tokens
from mmspec_ray.drafters.layers import causal_pad_mask
from mmspec_ray.drafters.hivis import HiViSDrafter, HiViSHead
from mmspec_ray.drafters.msd import MSDDrafter, MSDHead
from mmspec_ray.drafters.specflash import SpecFlashDrafter, SpecFlashHead
from mmspec_ray.drafters.suffix import SuffixConfig, SuffixDrafter
from mmspec_ray.drafters.vispec import ViSpecDrafter, ViSpecHead, entry_spans
from mmspec_ray.training.dream import dream_collate, dream_loss
from mmspec_ray.training.shards import FeatureExample
from mmspec_ray.training.losses import eagle_loss
from mmspec_ray.training.specflash import expand_example, specflash_loss
from mmspec_ray.training.schedule import TrainConfig, stage_schedule
from mmspec_ray.training.vispec import OBJECTIVES, vispec_loss

if TYPE_CHECKING:
    from mmspec_ray.drafters.base import Drafter
    from mmspec_ray.targets.base import VLMTarget

log = logging.getLogger(__name__)


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


def example_pieces(ex: FeatureExample, target: "VLMTarget | None") -> list[tuple[int, int]]:
    """An example's images / frames / temporal groups, as stored at data generation (cut as the target cuts them
    when a drafter drafts); examples stored before they carried segments are cut from their ids by the target (a
    clip then stays one piece on families that cut clips by their frame grid)."""
    pieces = ex.pieces()
    if pieces is not None:
        return pieces
    if target is None:
        raise ValueError("these training features were stored without their media segments, which a media-aware "
                         "method needs when the target is not loaded (Ray Train workers); regenerate them (a new "
                         "--work) or train with --num-workers 0")
    return target.media_pieces(ex.input_ids)


class TrainingMethod:
    """EAGLE-2 (the base every feature-level method extends): fc + one layer, EAGLE losses, one stage."""

    name: ClassVar[str] = "eagle2"
    needs: ClassVar[tuple[str, ...]] = ("hidden", "embeds")  # FeatureExample fields the examples must carry
    answer_temperature: ClassVar[float] = 0.0  # how the target answers training prompts (0: greedy, the default)
    long_answers: ClassVar[bool] = False  # toy world: train on the prompts rewritten to ask for long answers (ViSpec)
    direct_stage2: ClassVar[bool] = False  # a two-stage run enters stage 2 at once, whatever TrainConfig.gradual
    selects: ClassVar[bool] = False  # `select` filters with the target: streamed training gets it per shard
    cuts_media: ClassVar[bool] = False  # collate cuts media into images / frames (`example_pieces`)
    head_class: ClassVar[type[Eagle2Head]] = Eagle2Head
    drafter_class: ClassVar[type[Eagle2Drafter]] = Eagle2Drafter
    mixes_text: ClassVar[bool] = False  # every epoch holds the text-only pool too (StageSchedule.mixed)
    corpus_only: ClassVar[bool] = False  # no weights to fit: training collects the target's answers (`build`)
    # bumped when what the method trains changes, so a toy world's cached drafter of the method is trained again
    revision: ClassVar[int] = 1

    def head(self, target: "VLMTarget", examples: list[FeatureExample] | None = None) -> nn.Module:
        """A fresh head for `target`; `examples` (the training pool) where the method fits its config to the data
        (EAGLE-3's draft vocabulary)."""
        return self.head_class(self.head_class.config_class.for_target(target))

    def head_needs_examples(self, target: "VLMTarget") -> bool:
        """Whether `head` needs the training examples for this target (Ray Train's driver then reads them)."""
        return False

    def head_from_config(self, config: dict) -> nn.Module:
        """A fresh head from a saved head config (`head.cfg.model_dump()`): how training workers that never load
        the target build it."""
        return self.head_class(self.head_class.config_class.model_validate(config))

    def drafter(self, head: nn.Module, target: "VLMTarget") -> "Drafter":
        return self.drafter_class(head, target)

    def default_text_epochs(self, epochs: int) -> int:
        """Stage-1 (text-only) epochs when the run does not say."""
        return 0

    def select(self, target: "VLMTarget", examples: list[FeatureExample],
               text_examples: list[FeatureExample]) -> tuple[list[FeatureExample], list[FeatureExample]]:
        """The (multimodal, text-only) examples this method trains on, once per run: all of them by default."""
        return examples, text_examples

    def shard_selection(self, target: "VLMTarget", pool: list[FeatureExample]) -> dict[str, Any]:
        """`select` on one shard's examples, as indices into it (`keep`, its `multimodal` count, and `marked`: the
        kept examples a later stage leaves out). Streamed training computes it where the target is loaded; workers,
        which never load the target, apply it with `apply_selection`."""
        kept_mm, kept_text = self.select(target, [e for e in pool if e.multimodal],
                                         [e for e in pool if not e.multimodal])
        kept = {id(e) for e in (*kept_mm, *kept_text)}
        keep = [i for i, e in enumerate(pool) if id(e) in kept]
        return {"keep": keep, "multimodal": sum(pool[i].multimodal for i in keep), "marked": self.marked(pool, keep)}

    def marked(self, pool: list[FeatureExample], keep: list[int]) -> list[int]:
        """Of the kept examples, those `select` marked for a later stage to leave out: none by default."""
        return []

    def apply_selection(self, pool: list[FeatureExample], selection: dict[str, Any]) -> list[FeatureExample]:
        """A shard's examples as `shard_selection` chose them (what `select` would have kept)."""
        return [pool[i] for i in selection["keep"]]

    def begin_epoch(self, head: nn.Module, epoch: int, cfg: "TrainConfig") -> None:
        """Called before each epoch (1-based, resumed runs too): a method with stages of its own (HiViS's
        single-step then multi-step) sets them here. Nothing by default."""

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
        pos = torch.arange(emb.shape[1], device=emb.device)[None].expand(emb.shape[0], -1)
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
    Options (the C/N ratio, the query bank, K, the placeholder inputs) override the head config's defaults, for
    ablations; `chain_groups` (inference only: chain groups of K up to the tree depth) is saved in its config."""

    name = "specflash"
    needs = ("hidden", "embeds", "media")
    head_class = SpecFlashHead
    drafter_class = SpecFlashDrafter
    cuts_media = True

    def __init__(self, ratio: float | None = None, group: int | None = None, max_queries: int | None = None,
                 placeholder: str | None = None, chain_groups: bool | None = None) -> None:
        self.options = {k: v for k, v in (("ratio", ratio), ("group", group), ("max_queries", max_queries),
                                          ("placeholder", placeholder), ("chain_groups", chain_groups))
                        if v is not None}
        self.target: "VLMTarget | None" = None
        self.cfg = None  # the head's config (set by head / head_from_config)

    def head(self, target: "VLMTarget", examples: list[FeatureExample] | None = None) -> nn.Module:
        """The head for `target`; also records the target, which cuts the media of examples stored without their
        segments (features generated before examples carried them)."""
        self.target = target
        base = self.head_class.config_class.for_target(target)
        head = self.head_class(base.model_validate({**base.model_dump(), **self.options}))  # options checked
        self.cfg = head.cfg
        return head

    def head_from_config(self, config: dict) -> nn.Module:
        head = super().head_from_config(config)
        self.cfg = head.cfg
        return head

    def collate(self, examples: list[FeatureExample], idx: list[int], noise: float,
                gen: torch.Generator) -> dict:
        if self.cfg is None:
            raise RuntimeError("specflash collate before its head was built")
        cfg = self.cfg
        return {"items": [expand_example(examples[i], example_pieces(examples[i], self.target), cfg.ratio,
                                         cfg.max_queries, cfg.group, noise, gen) for i in idx]}

    def loss(self, head: nn.Module, batch: dict, lm_head_weight: torch.Tensor,
             p_weight: float) -> tuple[torch.Tensor, dict[str, float]]:
        return specflash_loss(head, batch["items"], lm_head_weight, p_weight)


class ViSpecMethod(TrainingMethod):
    """ViSpec: stage 1 text-only EAGLE pre-training (the first `default_text_epochs`), then stage 2 on the target's
    long, sampled answers (`long_answers`, `answer_temperature`) entered at once, with the vision adaptor, the
    global feature and `mtp_steps` multi-token-prediction passes (training/vispec.py). Options: `objective` (paper:
    the soft CE of the paper's Eq. 6, the default; eagle: EAGLE's smooth-L1 + soft CE; l1_rank: the authors'
    released code), and n_c and the MTP depth, for ablations."""

    revision = 2  # the paper's objective by default

    name = "vispec"
    needs = ("hidden", "embeds", "media")
    head_class = ViSpecHead
    drafter_class = ViSpecDrafter
    cuts_media = True
    answer_temperature = 1.0  # spec §9.2: the paper's anti-shortcut argument needs sampled answers
    long_answers = True
    direct_stage2 = True
    mtp_default: ClassVar[int] = 1  # spec §9.9: the README's --mtp-steps=1 (two passes)

    def __init__(self, compressed: int | None = None, mtp_steps: int | None = None, objective: str = "paper") -> None:
        if objective not in OBJECTIVES:
            raise ValueError(f"vispec objective {objective!r}: choose one of {list(OBJECTIVES)}")
        self.objective = objective
        self.options = {"objective": objective} | ({} if compressed is None else {"compressed": compressed})
        self.mtp_steps = self.mtp_default if mtp_steps is None else mtp_steps
        self.target: "VLMTarget | None" = None
        self.stage2 = True  # set per epoch; no MTP in stage 1

    def head(self, target: "VLMTarget", examples: list[FeatureExample] | None = None) -> nn.Module:
        self.target = target
        return self.head_class(self.head_class.config_class.for_target(target).model_copy(update=self.options))

    def default_text_epochs(self, epochs: int) -> int:
        return epochs // 3

    def begin_epoch(self, head: nn.Module, epoch: int, cfg: "TrainConfig") -> None:
        self.stage2 = epoch > stage_schedule(self, cfg).text_epochs
        log.info("vispec epoch %d: stage %d, objective %s, %d MTP steps", epoch, 1 + self.stage2, self.objective,
                 self.mtp_steps if self.stage2 else 0)

    def collate(self, examples, idx, noise, gen):
        """EAGLE's collate plus each example's media entry spans (one per image / frame / temporal group)."""
        batch = eagle_collate(examples, idx, noise, gen)
        batch["spans"] = [entry_spans(example_pieces(examples[i], self.target)) for i in idx]
        return batch

    def loss(self, head, batch, lm_head_weight, p_weight):
        return vispec_loss(head, batch, lm_head_weight, p_weight, self.mtp_steps if self.stage2 else 0,
                           self.objective, self.stage2)


class DreamMethod(TrainingMethod):
    """DREAM: the three-block cross-attention drafter (`DreamHead`) in one multimodal stage, on examples that carry
    each position's entropy-selected intermediate target feature (`mid`) and each prompt's last-layer attention
    (`received`), both made at feature generation. The loss reads the draft stream as the drafter will, cut to the
    head's `vtc_keep` share of visual tokens. Loss weights (feature, intermediate, KL) default to the paper's (0.2,
    0.2, 1.0); `w_mid` 0 is the no-intermediate-distillation ablation (it still reads DREAM's feature set while VTC
    is on, for the attention stored with it). `vtc_keep` / `intermed_tap` / `gate_init` override the head config."""

    revision = 2  # compression in training, the block-1 intermediate target

    name = "dream"
    needs = ("hidden", "embeds", "media", "mid")
    head_class = DreamHead
    drafter_class = DreamDrafter

    def __init__(self, w_feat: float = 0.2, w_mid: float = 0.2, w_kl: float = 1.0, vtc_keep: float | None = None,
                 intermed_tap: str | None = None, gate_init: float | None = None) -> None:
        if intermed_tap is not None and intermed_tap not in ("block1", "ca_block"):
            raise ValueError(f"dream: intermed_tap {intermed_tap!r}: expected block1 (the paper) or ca_block (the "
                             "authors' code)")
        if vtc_keep is not None and not 0.0 < vtc_keep <= 1.0:
            raise ValueError(f"dream: vtc_keep {vtc_keep!r}: the share of visual tokens the draft stream keeps must "
                             "be in (0, 1] (1: no visual token compression)")
        self.weights = (w_feat, w_mid, w_kl)
        keep = DreamHead.config_class.model_fields["vtc_keep"].default if vtc_keep is None else vtc_keep
        if not w_mid and keep >= 1.0:
            self.needs = ("hidden", "embeds", "media")
        self.options = {k: v for k, v in (("vtc_keep", vtc_keep), ("intermed_tap", intermed_tap),
                                          ("gate_init", gate_init)) if v is not None}
        self.warned = False

    def head(self, target: "VLMTarget", examples: list[FeatureExample] | None = None) -> nn.Module:
        return self.head_class(self.head_class.config_class.for_target(target).model_copy(update=self.options))

    def check(self, examples: list[FeatureExample]) -> None:
        """The fields DREAM needs, and a warning when VTC will find no stored attention (features made before
        examples carried it: those sequences train uncompressed)."""
        super().check(examples)
        self.warn_unscored(examples)

    def warn_unscored(self, examples: list[FeatureExample]) -> None:
        """Log once when examples with media lack `received` while VTC is on: training then reads their whole
        prompt, unlike drafting (regenerate the features to train as the drafter drafts)."""
        keep = self.options.get("vtc_keep", DreamHead.config_class.model_fields["vtc_keep"].default)
        if self.warned or keep >= 1.0:
            return
        old = sum(1 for ex in examples if ex.received is None and ex.media is not None and bool(ex.media.any()))
        if old:
            self.warned = True
            log.warning("dream: %d of %d examples with media were stored without the prompt's last-layer attention "
                        "(`received`, made by feature generation since DREAM trains with visual token compression); "
                        "they train with every visual token while drafting keeps %g of them. Regenerate the features "
                        "(a new --work; a toy world's training makes its own again) to train as the drafter drafts",
                        old, sum(1 for ex in examples if ex.media is not None and bool(ex.media.any())), keep)

    def collate(self, examples, idx, noise, gen):
        self.warn_unscored([examples[i] for i in idx])
        return dream_collate(examples, idx, noise, gen)

    def loss(self, head, batch, lm_head_weight, p_weight):
        """The trainer's p_weight is EAGLE's; DREAM weighs its three terms itself."""
        return dream_loss(head, batch, lm_head_weight, *self.weights)


def text_only(ex: FeatureExample) -> FeatureExample:
    """The example with its media positions dropped (HiViS stores no visual tokens): ids, features and embeddings
    at the text positions, in order, and the prompt length less its media tokens (media only sit in prompts)."""
    if ex.media is None or not bool(ex.media.any()):
        return ex
    keep = ~ex.media
    return dataclasses.replace(ex, input_ids=ex.input_ids[keep], hidden=ex.hidden[keep], embeds=ex.embeds[keep],
                               n_prompt=ex.n_prompt - int(ex.media[:ex.n_prompt].sum()),
                               media=torch.zeros(int(keep.sum()), dtype=torch.bool))


CODE_SYMBOLS = set("{}[]();=<>#*/\\|&$_")
CODE_WORDS = re.compile(r"\b(def|class|import|return|function|const|var|let|public|private)\b|#include|=>")


def code_heavy(text: str, share: float = 0.05) -> bool:
    """HiViS's stage-2 filter of programming-heavy text entries (the paper gives no rule; spec A12): a code fence,
    or (code symbols + 5 x keyword hits) / characters above `share`."""
    if "```" in text:
        return True
    score = sum(c in CODE_SYMBOLS for c in text) + 5 * len(CODE_WORDS.findall(text))
    return score / max(1, len(text)) > share


def multi_step_mask(T: int, f: int, valid: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, (f+1)T] bool: pass f's queries over the key blocks of passes 0..f (HASS's parallel form of f
    self-fed drafting steps). Query t is step f of the chain that started after real features up to t - f:
    block 0 (target features) keys tau <= t - f, block m >= 1 the chain's own step-m entry tau = t - f + m (m = f:
    the query itself). Padding keys are never attended."""
    tq, tk = torch.arange(T, device=valid.device)[:, None], torch.arange(T, device=valid.device)[None, :]
    blocks = [(tk <= tq - f)[None] & valid[:, None, :]]
    blocks += [(tk == tq - f + m)[None].expand(valid.shape[0], T, T) for m in range(1, f + 1)]
    mask = torch.cat(blocks, -1)
    mask[:, :, f * T:] |= torch.eye(T, dtype=torch.bool)[None]  # every query sees itself (padding stays finite)
    return mask[:, None]


class HiViSMethod(TrainingMethod):
    """HiViS: the drafter reads text positions only (`text_only` examples, `HiViSHead`); stage 1 is EAGLE's
    single-step training with e_seq^0, stage 2 (the last `multistep_epochs`) HASS-style multi-step self-feedback
    over N passes with dynamic data selection: a simulated chain is cut after a step whose top-`filter_k` misses
    the target's greedy token (spec §3.5, variant A), and the top-K distillation term joins the loss. Text-only and
    multimodal prompts are mixed in every epoch; multimodal prompts whose answer has at most `min_answer_words`
    words are dropped (both stages), code-heavy text entries in stage 2 only (none in the toy corpus)."""

    name = "hivis"
    needs = ("hidden", "embeds", "media")
    head_class = HiViSHead
    drafter_class = HiViSDrafter
    selects = True  # `select` reads answers with the target's tokenizer
    mixes_text = True
    passes: ClassVar[int] = 4  # N forward passes in stage 2 (paper: N = 4)
    filter_k: ClassVar[int] = 5  # dynamic data selection: the target's token must be in the drafter's top-5
    topk_weight: ClassVar[float] = 1.0  # stage-2 weight of the top-K distillation term (HASS default)
    topk_k: ClassVar[int] = 10  # K of that term (spec A6)
    min_answer_words: ClassVar[int] = 5  # multimodal entries kept only when the answer exceeds five words

    def __init__(self, min_answer_words: int | None = None) -> None:
        if min_answer_words is not None:  # tests: tiny models answer in word-less token soup
            self.min_answer_words = min_answer_words
        self.n_passes = 1  # 1 in stage 1, `passes` in stage 2 (set per epoch)
        self.code_heavy: set[int] = set()  # id() of the text examples stage 2 leaves out

    def multistep_epochs(self, cfg: "TrainConfig") -> int:
        """Stage-2 epochs: the run's setting, else the last third (the spec's 20 + 10 epochs, scaled)."""
        n = max(1, round(cfg.epochs / 3)) if cfg.multistep_epochs is None else cfg.multistep_epochs
        if n > cfg.epochs:
            raise ValueError(f"multistep_epochs ({n}) exceeds epochs ({cfg.epochs})")
        return n

    def select(self, target, examples, text_examples):
        """Multimodal entries whose answer has more than `min_answer_words` words; every text entry (stage 1
        trains on all of them; the code-heavy ones are noted here and skipped in stage 2)."""
        def words(ex: FeatureExample) -> int:
            return len(target.tokenizer.decode(ex.input_ids[ex.n_prompt:].tolist(), skip_special_tokens=True).split())

        kept = [ex for ex in examples if words(ex) > self.min_answer_words]
        self.code_heavy = {id(ex) for ex in text_examples
                           if code_heavy(target.tokenizer.decode(ex.input_ids.tolist(), skip_special_tokens=True))}
        log.debug("hivis data: %d of %d multimodal entries answer in more than %d words; %d of %d text entries are "
                  "code-heavy (left out of stage 2)", len(kept), len(examples), self.min_answer_words,
                  len(self.code_heavy), len(text_examples))
        return kept, text_examples

    def marked(self, pool, keep):
        """The code-heavy text entries (stage 2 leaves them out)."""
        return [i for i in keep if id(pool[i]) in self.code_heavy]

    def apply_selection(self, pool, selection):
        self.code_heavy = {id(pool[i]) for i in selection["marked"]}
        return super().apply_selection(pool, selection)

    def begin_epoch(self, head: nn.Module, epoch: int, cfg: "TrainConfig") -> None:
        """Epochs before the last `multistep_epochs` are stage 1 (one row of e_seq in use); the first stage-2
        epoch copies e_seq^0 to every step's row (a resumed run mid stage 2 keeps its trained rows)."""
        first = cfg.epochs - self.multistep_epochs(cfg) + 1
        if epoch < first:
            self.n_passes = 1
            head.seq_rows.fill_(1)
        else:
            if epoch == first:
                head.start_multi_step()
            self.n_passes = self.passes

    def collate(self, examples, idx, noise, gen):
        """EAGLE's collate over the text-only examples; in stage 2 the code-heavy text entries carry no loss."""
        batch = eagle_collate([text_only(examples[i]) for i in idx], list(range(len(idx))), noise, gen)
        if self.n_passes > 1 and self.code_heavy:
            drop = torch.tensor([id(examples[i]) in self.code_heavy for i in idx])
            batch["loss_mask"] &= ~drop[:, None]
        return batch

    def loss(self, head, batch, lm_head_weight, p_weight):
        """Stage 1: EAGLE's loss (e_seq^0 everywhere). Stage 2: the sum over passes f = 0..N-1 of the EAGLE loss +
        the top-K term on `multi_step_forward`'s outputs, each pass masked by dynamic data selection."""
        if self.n_passes == 1:
            return super().loss(head, batch, lm_head_weight, p_weight)
        tgt, T = batch["tgt"], batch["tgt"].shape[1]
        outs = multi_step_forward(head, batch["emb"], batch["feat"], batch["valid"], self.n_passes)
        with torch.no_grad():
            y = (tgt @ lm_head_weight.T).argmax(-1)  # the target's greedy token at each position
            hits = [(torch.topk(o @ lm_head_weight.T, self.filter_k, dim=-1).indices == y[..., None]).any(-1)
                    for o in outs]
        total = torch.zeros((), device=tgt.device)
        parts: dict[str, float] = {}
        for f, (out, alive) in enumerate(zip(outs, chain_alive(hits))):
            reach = batch["loss_mask"] & (torch.arange(T, device=tgt.device) >= f)[None]  # f steps fit before t
            m = reach & alive
            loss, p = eagle_loss(out, tgt, lm_head_weight, m, p_weight=p_weight, k_weight=self.topk_weight,
                                 k=self.topk_k)
            total = total + loss
            for k, v in p.items():
                parts[k] = parts.get(k, 0.0) + v / self.n_passes
                parts[f"{k}_pass{f}"] = v
            parts[f"kept_pass{f}"] = float(m.sum() / reach.sum().clamp_min(1))  # share dynamic selection keeps
        return total, parts


def multi_step_forward(head: nn.Module, emb: torch.Tensor, feat: torch.Tensor, valid: torch.Tensor,
                       passes: int, run: "Callable[..., torch.Tensor] | None" = None,
                       pos: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Outputs [B, T, d] of passes f = 0..passes-1 (HASS's parallel self-feedback, HiViS spec §3.4; EAGLE-3's
    training-time test). Pass 0 is the teacher-forced forward; pass f feeds entry t the token embedding of pass 0
    with pass f-1's output at t-1 (detached: no gradient through the chain) and attends by `multi_step_mask`, so its
    output at t is what a drafter started after real features up to t - f predicts at its f-th self-fed step.
    `run(emb, feats, f, pos, mask, kv, at)` is one pass of the head (default: HiViS's, with e_seq^min(f, 3)).
    `pos`: the entries' position ids ([B, T], or [3, B, T] M-RoPE; default j), the same in every pass (a step-f guess
    at t sits where the drafter puts it: at entry t's position)."""
    B, T, _ = emb.shape
    pos = torch.arange(T, device=emb.device)[None].expand(B, -1) if pos is None else pos
    layer = head.layer
    if run is None:
        def run(emb, feats, f, pos, mask, kv, at):
            return layer(head.with_step(head.inputs(emb, feats, None), torch.full((B, T), f)), pos, mask, kv, at)
    blank = emb.new_zeros(B, layer.kv_heads, T, layer.head_dim)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    for f in range(passes):
        if f == 0:
            feats = feat
        else:  # entry 0 has no earlier output: it is never read by a loss-bearing entry of pass f (any value does)
            prev = outs[-1][:, :-1].detach()
            first = feat[:, :1] if feat.shape[-1] == prev.shape[-1] else prev.new_zeros(B, 1, prev.shape[-1])
            feats = torch.cat([first, prev], 1)
        kv = (torch.cat(keys + [blank], 2), torch.cat(values + [blank], 2))  # the layer writes block f in place
        outs.append(run(emb, feats, f, pos, multi_step_mask(T, f, valid), kv, f * T))
        keys.append(kv[0][:, :, f * T:])
        values.append(kv[1][:, :, f * T:])
    return outs


def chain_alive(hits: list[torch.Tensor]) -> list[torch.Tensor]:
    """Dynamic data selection (spec §3.5, variant A): alive[f][b, t] says every earlier step of the chain ending
    at (pass f, t) put the target's token in its top-K. A miss at step f still trains step f; the chain's later
    steps are cut. Pass 0 is never filtered. hits[f] [B, T] bool: pass f's top-K holds the target's token at t."""
    alive = [torch.ones_like(hits[0])]
    for hit in hits[:-1]:
        prev = alive[-1] & hit
        alive.append(torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], 1))
    return alive


def draft_targets(tgt: torch.Tensor, lm_head_weight: torch.Tensor, ids: torch.Tensor, t2d: torch.Tensor,
                  chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From target features tgt [B, T, d]: (the target's next-token distribution renormalised over the draft
    vocabulary [B, T, Vd]; its argmax there [B, T]; whether the target's top token over the whole vocabulary is a
    draft token [B, T], as SafeAILab and SpecForge mask). Full-vocabulary logits are made `chunk` rows at a time."""
    flat = tgt.reshape(-1, tgt.shape[-1]).float()
    W, Wd = lm_head_weight.float(), lm_head_weight.float()[ids]
    p = torch.softmax(flat @ Wd.T, -1)
    top = torch.cat([(flat[i:i + chunk] @ W.T).argmax(-1) for i in range(0, flat.shape[0], chunk)])
    shape = tgt.shape[:-1]
    return p.view(*shape, -1), p.argmax(-1).view(shape), t2d.to(top.device)[top].view(shape)


class Eagle3Method(TrainingMethod):
    """EAGLE-3: three target layers fused by fc; no feature regression, only the token distribution: soft
    cross-entropy against the target's next-token distribution over the draft vocabulary, at each of `ttt_steps`
    unrolled steps on the drafter's own outputs (training-time test), step i weighted `step_decay`^i; positions
    whose target token lies outside the draft vocabulary carry no loss. The draft vocabulary: the whole target
    vocabulary up to `draft_vocab_size` ids, else the most frequent answer tokens.
    No feature noise (the unrolled steps train on the drafter's own, noisier, features instead)."""

    name = "eagle3"
    needs = ("hidden", "embeds", "aux")
    head_class = Eagle3Head
    drafter_class = Eagle3Drafter

    def __init__(self, ttt_steps: int = 7, draft_vocab_size: int = 32000, step_decay: float = 0.8) -> None:
        if ttt_steps < 1 or draft_vocab_size < 1:
            raise ValueError(f"eagle3: ttt_steps {ttt_steps} and draft_vocab_size {draft_vocab_size} must be >= 1")
        self.ttt_steps, self.draft_vocab_size, self.step_decay = ttt_steps, draft_vocab_size, step_decay

    def head_needs_examples(self, target: "VLMTarget") -> bool:
        return target.vocab_size > self.draft_vocab_size

    def head(self, target: "VLMTarget", examples: list[FeatureExample] | None = None) -> nn.Module:
        cfg = Eagle3Config.for_target(target)
        if self.head_needs_examples(target):
            if not examples:
                raise ValueError("eagle3: the draft vocabulary is built from the training answers' token counts; "
                                 "give the examples (or draft_vocab_size >= the target's vocabulary)")
            tokens = frequent_tokens([ex.input_ids[ex.n_prompt:] for ex in examples], target.vocab_size,
                                     self.draft_vocab_size)
            cfg = cfg.model_copy(update={"draft_vocab_size": self.draft_vocab_size, "draft_tokens": tokens})
        return Eagle3Head(cfg)

    def collate(self, examples, idx, noise, gen):
        """EAGLE's pairing (entry j: token j+1 with the features at j, predicting the state at j+1), the features
        the three layers' states; `pos` [3, B, T]: entry j at token j+1's M-RoPE ids minus one, as the drafter
        places it (examples stored without positions: j on every axis, and `pos_missing` marks them)."""
        batch = eagle_collate(examples, idx, 0.0, gen)
        B, T = batch["valid"].shape
        feat = torch.zeros(B, T, examples[idx[0]].aux.shape[1])
        pos = torch.arange(T).expand(3, B, T).clone()
        missing = torch.zeros(B, dtype=torch.bool)
        for b, i in enumerate(idx):
            ex = examples[i]
            feat[b, :ex.aux.shape[0] - 1] = ex.aux[:-1].float()
            if ex.positions is not None:
                pos[:, b, :ex.positions.shape[1] - 1] = ex.positions[:, 1:].long() - 1
            missing[b] = ex.positions is None and ex.media is not None and bool(ex.media.any())
        batch.update(feat=feat, pos=pos, pos_missing=missing)
        return batch

    def loss(self, head, batch, lm_head_weight, p_weight):
        tgt, T = batch["tgt"], batch["tgt"].shape[1]
        pos = None
        if head.cfg.mrope_section:
            if bool(batch["pos_missing"].any()):
                raise ValueError("eagle3 on an M-RoPE target trains at the target's position ids, which these "
                                 "features were stored without; regenerate them (a new --work)")
            pos = batch["pos"]
        outs = multi_step_forward(head, batch["emb"], batch["feat"], batch["valid"], self.ttt_steps,
                                  run=lambda emb, feats, f, pos, mask, kv, at: head(emb, feats, pos, mask, kv, at),
                                  pos=pos)
        with torch.no_grad():
            p, y, inside = draft_targets(tgt, lm_head_weight, head.target_ids(), head.t2d)
        total = torch.zeros((), device=tgt.device)
        parts: dict[str, float] = {}
        for f, out in enumerate(outs):  # a position whose target token lies outside the draft vocabulary: no loss
            m = (batch["loss_mask"] & inside & (torch.arange(T, device=tgt.device) >= f)[None]).float()
            logq = torch.log_softmax(head.logits(out).float(), -1)
            step = (-(p * logq).sum(-1) * m).sum() / m.sum().clamp_min(1.0)
            total = total + self.step_decay ** f * step
            with torch.no_grad():
                acc = float(((logq.argmax(-1) == y).float() * m).sum() / m.sum().clamp_min(1.0))
            parts[f"ploss_step{f}"], parts[f"top1_step{f}"] = float(step.detach()), acc
        parts["ploss"], parts["top1"] = parts["ploss_step0"], parts["top1_step0"]
        return total, parts


class SuffixMethod(TrainingMethod):
    """The suffix drafter: nothing to fit; its corpus is the target's answers to the training prompts (token ids
    after each prompt), written as the drafter checkpoint. One process, one pass, no epochs."""

    name = "suffix"
    needs = ()
    corpus_only = True

    def __init__(self, max_context: int = 4, learn: bool = True, openings: bool = True,
                 opening_share: float = 0.2) -> None:
        self.cfg = SuffixConfig(max_context=max_context, learn=learn, openings=openings, opening_share=opening_share)

    def build(self, target: "VLMTarget", examples: list[FeatureExample], out: Path) -> Path:
        """Write the corpus of `examples`' answers for `target` into `out`."""
        answers = [a for a in (ex.input_ids[ex.n_prompt:].tolist() for ex in examples) if a]
        if not answers:
            raise ValueError("suffix: no answers to build the corpus from (no examples, or every answer empty); give "
                             "data the target answers")
        cfg = self.cfg.model_copy(update={"target_vocab_size": target.vocab_size, "target_id": target.identity or ""})
        return SuffixDrafter.save(out, answers, cfg)


METHODS: dict[str, type[TrainingMethod]] = {m.name: m for m in (TrainingMethod, MSDMethod, HiViSMethod)}
METHODS[SpecFlashMethod.name] = SpecFlashMethod
METHODS[DreamMethod.name] = DreamMethod
METHODS[ViSpecMethod.name] = ViSpecMethod
METHODS[Eagle3Method.name] = Eagle3Method
METHODS[SuffixMethod.name] = SuffixMethod


def training_method(name: str, options: dict[str, Any] | None = None) -> TrainingMethod:
    """The method `name`, built with its `options` (keyword arguments of its class, e.g. HiViS's
    min_answer_words, ViSpec's mtp_steps); an option the method does not take is refused by name."""
    if name not in METHODS:
        raise ValueError(f"no training for drafter method {name!r}; trainable methods: {sorted(METHODS)}")
    try:
        return METHODS[name](**(options or {}))
    except TypeError as e:
        raise ValueError(f"method {name!r} does not take the options {sorted(options or {})}: {e}") from e
