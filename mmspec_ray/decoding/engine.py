"""Decoding engines over the target primitives. SpecEngine: draft a tree, verify it in one forward, accept, commit.
AREngine is SpecEngine with the null drafter (one token per forward): the baseline shares every line of the loop.
"""

from __future__ import annotations

import time
from collections.abc import Generator

import torch

from mmspec_ray.config import SamplingParams
from mmspec_ray.drafters.base import Drafter, target_features
from mmspec_ray.drafters.none import NoDrafter
from mmspec_ray.decoding.accept import accept
from mmspec_ray.decoding.calibrate import TreeCalibrator
from mmspec_ray.decoding.output import Generation, GenerationStats, OutputTracker
from mmspec_ray.decoding.payoff import PLAIN, PayoffGuard, request_kind
from mmspec_ray.decoding.processors import (HistoryProcessors, check_generation_config, effective_generation_config,
                                        resolve_sampling)
from mmspec_ray.decoding.sampling import make_generator, pick
from mmspec_ray.decoding.tree import DraftTree, TreeConfig
from mmspec_ray.targets.base import Request, VLMTarget


# relative top-2 logit gap below which a greedy decision from a multi-node forward is re-made by a one-token
# forward: a few rounding steps of the dtype (docs/design.md, Precision: `python -m mmspec_ray.bench.precision
# --tie-margin M` measured 2^-7, 2^-5, 2^-3). Float32 is exact without it.
TIE_MARGIN = {torch.bfloat16: 2.0 ** -5, torch.float16: 2.0 ** -7}


class SpecEngine:
    """Lossless tree speculative decoding, batch size 1. Decodes as the checkpoint's generation config says (HF
    generate's defaults, penalties, stop ids), request parameters over it; refuses a config it cannot reproduce."""

    def __init__(self, target: VLMTarget, drafter: Drafter, tree: TreeConfig | TreeCalibrator | None = None,
                 tie_margin: float | None = None, guard: PayoffGuard | bool = False) -> None:
        self.target = target
        self.drafter = drafter
        # a TreeCalibrator: decode with its probe tree until it has picked one (decoding/calibrate.py)
        self.calibrator = tree if isinstance(tree, TreeCalibrator) else None
        self.tree = self.calibrator.probe if self.calibrator else (tree or TreeConfig())
        # greedy near-ties left to a one-token forward (decoding/accept.py); None: by the target's dtype
        self.tie_margin = TIE_MARGIN.get(target.dtype, 0.0) if tie_margin is None else tie_margin
        # the payoff guard (decoding/payoff.py): per request, the tree shrinks down to plain steps where drafting
        # does not pay; True: a fresh one; a PayoffGuard: one shared with other engines (what it learnt carries over)
        self.guard = PayoffGuard() if guard is True else (guard or None)
        # what HF generate decodes this checkpoint with, read once (a deep copy and merge: ~0.3 ms a request)
        self.generation_config = effective_generation_config(target.model)
        check_generation_config(self.generation_config)

    def generate(self, request: Request, sampling: SamplingParams | None = None, max_new_tokens: int = 128,
                 stop: tuple[str, ...] = ()) -> Generation:
        """Decode one request to the end: `stream` run to completion."""
        steps = self.stream(request, sampling, max_new_tokens, stop)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    @torch.inference_mode()
    def stream(self, request: Request, sampling: SamplingParams | None = None, max_new_tokens: int = 128,
               stop: tuple[str, ...] = ()) -> Generator[list[int], None, Generation]:
        """The decoding loop as a generator: yields the token ids each step commits (the prefill's first token,
        then each verify cycle's accepted tokens + bonus, cut where generation ends) and returns the Generation.
        Time spent by the consumer between steps is not counted in the stats. Closing it early stops decoding."""
        t, d = self.target, self.drafter
        t0 = time.perf_counter()
        gc = self.generation_config
        sampling = resolve_sampling(sampling or SamplingParams(), gc)
        inputs = t.encode(request)
        if self.calibrator is not None:
            self.calibrator.start_request(t, inputs)  # the cost curve once, on the first request, before its prefill
        n_prompt = inputs["input_ids"].shape[1]
        t.check_length(n_prompt, max_new_tokens)  # as HF: the answer must fit; the tree shrinks near the end
        gen = make_generator(sampling, t.device)  # acceptance runs where the logits are
        tracker = OutputTracker(t.tokenizer, t.eos_token_ids, max_new_tokens, stop)
        history = HistoryProcessors(gc, sampling, t.eos_token_ids, inputs["input_ids"])  # penalties etc., per node
        stats = GenerationStats(prompt_tokens=n_prompt)
        guard = (self.guard.request(self.tree, request_kind(request, n_prompt, sampling.greedy))
                 if self.guard is not None and self.calibrator is None else None)
        # the drafter hears of committed tokens just before it next drafts, not after every cycle: plain steps
        # (the payoff guard's, a 1-token pick's, a near-tie's) cost it nothing, and a drafter is begun only when a
        # cycle first drafts (a kind of request that does not pay never runs the drafter's prefill)
        pending: list[int] = []  # committed tokens (root first) the drafter has not observed yet
        pending_feats: list[torch.Tensor] = []  # their target features
        single = False  # the next cycle verifies the root alone (a near-tie left to a one-token forward)
        kw = {"logits_to_keep": getattr(d, "prefill_logits", 1),
              "attention": bool(getattr(d, "prefill_attention", False))}
        chain = self._prompt_draft(inputs, tracker.remaining, guard)
        out = t.prefill(inputs, draft=chain, **kw)
        if chain:  # the answer's first tokens guessed before the prefill, verified in its forward
            tree = DraftTree.chain(out.draft.input_ids[0].tolist())  # root: the prompt's last token
            history.reopen_last()
            path, bonus = accept(tree, history.tree_logits(out.draft.logits[0], tree.tokens, tree.ancestors),
                                 sampling, gen, self.tie_margin)
            stats.prefill_drafted, stats.prefill_accepted = len(chain), len(path) - 1
            if bonus is None and len(path) == 1:  # a near-tie on the first token: AR's own prefill decides it
                history.commit(tree.tokens[:1].tolist())
                out, chain = t.prefill(inputs, **kw), []
            else:
                single = bonus is None
                keep, root = (path[:-1], int(tree.tokens[path[-1]])) if single else (path, bonus)
                t.commit(keep)
                history.commit(tree.tokens[keep].tolist())
                first = tree.tokens[path[1:]].tolist() + ([] if single else [bonus])
                if len(keep) > 1:  # answer tokens now in the cache, for the drafter's first observe
                    pending = tree.tokens[keep[1:]].tolist()
                    pending_feats = [target_features(d, out.draft)[0][keep[1:]]]
        if not chain:
            root = pick(history.next_logits(out.logits[0, -1]), sampling, gen)
            first = [root]
        stats.prefill_s = time.perf_counter() - t0
        done = tracker.add(first)
        tp = time.perf_counter()
        yield tracker.ids[:]
        t0 += time.perf_counter() - tp
        if done:
            if guard is not None:  # an answer ended by its first token is still one of its kind's answers
                guard.finish(len(tracker.ids))
                stats.guard, stats.guard_plain_cycles = guard.outcome, dict(guard.plain)
            return self._finish(tracker, stats, t0, d)
        first_root, begun, passes0 = first[0], False, 0
        news = self.calibrator is not None or self.guard is not None or self.tree.total_tokens > 1
        drafted_before = False  # the previous cycle drafted: this cycle's observe is the steady per-cycle kind
        while True:
            room = t.max_context - t.seq_len  # cache slots left; >= remaining + 1 >= 2 by check_length
            probing = False
            if self.calibrator is not None:  # calibrating: a probe cycle to record, or the tree picked so far
                p = self.calibrator.probe  # recorded only when verified whole (nodes reach depth + 1)
                whole = not single and room >= p.total_tokens and tracker.remaining - 2 >= p.depth
                self.tree, probing = self.calibrator.next_cycle(whole)  # (its provisional pick is not draft time)
            cycle_tree = guard.next_tree(len(tracker.ids)) if guard is not None else self.tree
            drafting = not single and cycle_tree.total_tokens > 1  # a 1-token tree: a plain AR step
            td = time.perf_counter()
            begin_s = observe_s = 0.0
            if drafting:
                if not begun:
                    d.begin(t, out, first_root)
                    begin_s = stats.drafter_prefill_s = time.perf_counter() - td
                    stats.drafter_prefill_tokens = int(getattr(d, "prefill_tokens", 0))
                    passes0 = int(getattr(d, "passes", 0))  # the drafter's forward count (drafters that keep one)
                    begun = True
                to = time.perf_counter()
                if pending:
                    d.observe(pending, torch.cat(pending_feats), root)
                    pending, pending_feats = [], []
                observe_s = time.perf_counter() - to
            tprop = time.perf_counter()
            fitted = self._fit(room, tracker.remaining, cycle_tree, probing) if drafting else PLAIN
            tree = DraftTree.chain([root]) if not drafting else (
                d.propose(root, fitted).truncate(tracker.remaining - 1)  # deeper: never emitted
                .head(room))  # the verified tree must fit the context
            tv = time.perf_counter()
            cycle_passes = 0
            if begun:
                passes = int(getattr(d, "passes", 0)) - passes0
                cycle_passes, stats.draft_passes = passes - stats.draft_passes, passes
            ancestors = tree.ancestors  # [n, n] the tree mask, also each node's history for the processors
            v = t.verify(tree.tokens, ancestors, tree.depth)
            if v.logits.is_cuda:  # a GPU runs the forward asynchronously: its time is verify's, not bookkeeping's
                torch.cuda.synchronize(v.logits.device)
            ta = time.perf_counter()
            logits = history.tree_logits(v.logits[0], tree.tokens, ancestors)
            path, bonus = accept(tree, logits, sampling, gen, self.tie_margin)
            single = bonus is None  # near-tie after path[-1]: keep what precedes it, re-verify it alone
            keep, nxt = (path[:-1], int(tree.tokens[path[-1]])) if single else (path, bonus)
            t.commit(keep)
            history.commit(tree.tokens[keep].tolist())
            new = tree.tokens[path[1:]].tolist() + ([] if single else [bonus])
            stats.cycles += 1
            stats.tie_cycles += single
            stats.plain_cycles += not drafting
            stats.accepted_per_cycle.append(len(path) - 1)
            stats.draft_s += tv - td
            stats.verify_s += ta - tv
            n_before = len(tracker.ids)
            done = tracker.add(new)
            tb = time.perf_counter()
            catch_up = begin_s + (0.0 if drafted_before else observe_s)  # not this tree's steady cost
            if probing and not single:  # (a near-tie cut the path: not a record)
                picked = self.calibrator.observe(tree, path, tv - tprop, observe_s if drafted_before else 0.0,
                                                 tb - ta, cycle_passes)  # tb - ta: acceptance, processors, commit
                if picked is not None:
                    self.tree, self.calibrator = picked, None
            elif self.calibrator is not None and drafting:  # what a step of this tree's top_k costs
                self.calibrator.timed(fitted, tv - tprop, cycle_passes)
            if guard is not None:
                guard.record(cycle_tree if drafting else PLAIN, len(new), tb - td - catch_up, catch_up,
                             len(tracker.ids))
            drafted_before = drafting
            if new:
                tp = time.perf_counter()
                yield tracker.ids[n_before:]
                t0 += time.perf_counter() - tp
            if done:
                break
            if keep and news:  # what the drafter reads before its next proposal
                pending += tree.tokens[keep].tolist()
                feats = target_features(d, v)[0]
                prefix = keep == list(range(len(keep)))  # a chain's path (a plain step's root): a view, no copy
                pending_feats.append(feats[:len(keep)] if prefix else feats[keep])
            root = nxt
        if self.calibrator is not None:
            self.calibrator.end_request()
        if guard is not None:
            guard.finish(len(tracker.ids))
            stats.guard_moves, stats.guard, stats.guard_plain_cycles = guard.moves, guard.outcome, dict(guard.plain)
        return self._finish(tracker, stats, t0, d)

    def _prompt_draft(self, inputs: dict, remaining: int, guard: object) -> list[int]:
        """The answer's first tokens as the drafter guesses them from the prompt alone (a drafter with
        `prompt_draft`: one that needs no target features), to verify inside the prefill's forward: up to the
        tree's depth and the first media placeholder id (the prefill would count it as media), none where this
        engine or the payoff guard decodes the request plainly or the prompt's positions do not take it."""
        propose = getattr(self.drafter, "prompt_draft", None)
        plain = guard is not None and guard.level >= guard.plain_level
        depth = min(self.tree.depth, remaining - 1)
        if propose is None or self.tree.total_tokens <= 1 or plain or depth < 1:
            return []
        media = self.target.media_token_ids
        chain: list[int] = []
        for tok in list(propose(inputs["input_ids"][0].tolist(), depth))[:depth]:
            if tok in media:
                break
            chain.append(int(tok))
        return chain if chain and self.target.takes_draft(inputs) else []

    @staticmethod
    def _fit(room: int, remaining: int, tree: TreeConfig, probing: bool = False) -> TreeConfig:
        """`tree` shrunk to `room` cache slots (the verified tree must fit the target's context) and, except on a
        calibration probe (recorded whole), to the depth `remaining` answer tokens can use: nodes reach depth + 1
        and a path of j drafts emits j + 1 tokens, so drafter steps past remaining - 2 would be cut unverified."""
        depth = tree.depth if probing else max(1, min(tree.depth, remaining - 2))
        total = min(tree.total_tokens, room)
        if (depth, total) == (tree.depth, tree.total_tokens):
            return tree
        return TreeConfig(top_k=tree.top_k, depth=min(depth, max(1, total - 1)), total_tokens=total)

    @staticmethod
    def _finish(tracker: OutputTracker, stats: GenerationStats, t0: float, drafter: object = None) -> Generation:
        """The Generation; a drafter with a `finish` hook hears the whole answer first (begun or not)."""
        if hasattr(drafter, "finish"):
            drafter.finish(list(tracker.ids))
        stats.total_s = time.perf_counter() - t0
        stats.overhead_s = stats.total_s - stats.prefill_s - stats.draft_s - stats.verify_s
        return tracker.result(stats)


class AREngine(SpecEngine):
    """The autoregressive baseline: the same loop, one token per target forward."""

    def __init__(self, target: VLMTarget) -> None:
        super().__init__(target, NoDrafter(), TreeConfig(top_k=1, depth=1, total_tokens=1))  # 1 token: no drafting
