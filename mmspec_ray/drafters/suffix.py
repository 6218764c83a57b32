"""Suffix drafter (training-free, after SuffixDecoding, Oliaro et al. 2024): propose the continuations that followed
the current context's longest matching suffix in earlier answers of the target, as a tree, at no model cost.

Two token stores, both counts of the next token after every context of 1..`max_context` tokens:
- the **corpus**: the target's own answers. A checkpoint (`mmspec train-drafter --method suffix`) brings the answers
  the target gave to the training prompts; with `learn` (the default) every answer decoded with this drafter joins
  it when its request ends (the engine's `finish` hook), so a batch job's later rows draft from its earlier ones;
- the **request**: the prompt's text tokens and what this request generated so far (what prompt lookup reads).
Each corpus answer's first tokens are also counted after start markers (any prompt's, and, for answers decoded
here, their prompt's), so the drafter guesses an answer's first tokens from the prompt alone (`prompt_draft`): the
engine verifies that chain inside the prefill's own forward, where a short answer (a caption of ~9 tokens) gains a
cycle.
A tree node's children are the top_k next tokens after the longest suffix of (context + the node's path) that either
store holds (their counts summed at that length), scored by the product of count shares along the path; the tree is
grown best-first to `total_tokens - 1` nodes and `depth`. Drafting costs dictionary look-ups and no prefill, so it
pays on short answers a model drafter cannot (a toy-s caption: ~9 tokens). Lossless as every drafter: the target
verifies every proposal (sampling: proposals are deterministic, q = 1).
"""

from __future__ import annotations

import heapq
import json
import math
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from pydantic import BaseModel, Field

from mmspec_ray.decoding.tree import DraftTree, TreeConfig
from mmspec_ray.drafters.base import check_device, register_drafter

if TYPE_CHECKING:
    from mmspec_ray.targets.base import TargetOutput, VLMTarget


START = -1  # the context before any answer's first token in the corpus (no token id is negative)


def prompt_marker(prompt: list[int]) -> int:
    """The start marker of answers to this exact prompt (its ids, media placeholders included): negative, not
    START, the same in every process (a hash of ints is not salted)."""
    return -2 - hash(tuple(prompt)) % (1 << 40)


class SuffixConfig(BaseModel):
    """Saved as the drafter's config.json (the corpus in model.safetensors beside it)."""

    method: str = "suffix"
    max_context: int = Field(4, ge=1, le=16, description="longest context (tokens) whose continuations are counted")
    learn: bool = True  # add each decoded answer to the corpus
    # learning stops at this many corpus tokens: an index costs up to ~1.35 KB per token (random runs; ~270 MB here)
    max_corpus_tokens: int = Field(200_000, ge=0)
    openings: bool = True  # draft an answer's opening from the prompt, for the engine to verify in the prefill
    # an opening drafted from the prompt ends where its share of the counted openings (the product of each token's
    # share after the one before) falls below this: each further token costs the prefill a position
    opening_share: float = Field(0.2, ge=0.0, le=1.0)
    target_vocab_size: int = 0
    target_id: str = ""  # the checkpoint whose answers the corpus holds ("": unknown)


class SuffixIndex:
    """Next-token counts after every context of 1..max_context tokens of the sequences added."""

    def __init__(self, max_context: int) -> None:
        self.max_context = max_context
        self.counts: dict[tuple[int, ...], Counter[int]] = {}
        self.tokens = 0

    def add(self, seq: list[int], start: int = 0) -> None:
        """Count the continuations of positions start..len(seq)-1 (each after its 1..max_context preceding tokens)."""
        for i in range(max(start, 1), len(seq)):
            nxt = seq[i]
            for m in range(1, min(self.max_context, i) + 1):
                self.counts.setdefault(tuple(seq[i - m:i]), Counter())[nxt] += 1
        self.tokens += max(0, len(seq) - max(start, 1))

    def add_opening(self, marker: int, answer: list[int]) -> None:
        """Count an answer's first tokens after a start marker: contexts (marker, a1 .. a_i-1), up to max_context
        tokens long (they never match a context of real tokens)."""
        ctx: tuple[int, ...] = (marker,)
        for tok in answer[: self.max_context]:
            self.counts.setdefault(ctx, Counter())[tok] += 1
            ctx += (tok,)

    def longest(self, context: list[int], other: "SuffixIndex | None" = None) -> Counter[int] | None:
        """The next-token counts after the longest suffix of `context` this index (or `other`) holds, both indexes'
        counts summed at that length; None when not even the last token was seen."""
        for m in range(min(self.max_context, len(context)), 0, -1):
            key = tuple(context[-m:])
            mine = self.counts.get(key)
            theirs = other.counts.get(key) if other is not None else None
            if mine or theirs:
                return (mine or Counter()) + (theirs or Counter()) if mine and theirs else (mine or theirs)
        return None


@register_drafter("suffix")
class SuffixDrafter:
    """Per-request state around a shared corpus index (see the module docstring)."""

    def __init__(self, cfg: SuffixConfig | None = None, corpus: Iterable[list[int]] = ()) -> None:
        self.cfg = cfg or SuffixConfig()
        self.corpus = SuffixIndex(self.cfg.max_context)
        for seq in corpus:
            self.learn(list(seq))
        self.marker: int | None = None  # the current request's prompt marker (set by `prompt_draft`)
        self.request = SuffixIndex(self.cfg.max_context)
        self.context: list[int] = []

    # ---------- checkpoint ----------
    @classmethod
    def load(cls, path: str | Path, target: "VLMTarget", device: str | None = None) -> "SuffixDrafter":
        """A corpus saved by `save`, checked against `target` (vocabulary, and the checkpoint identity when both are
        known)."""
        from safetensors.torch import load_file

        check_device(device, target)
        path = Path(path)
        cfg = SuffixConfig(**json.loads((path / "config.json").read_text()))
        other = bool(cfg.target_id) and target.identity is not None and cfg.target_id != target.identity
        if (cfg.target_vocab_size and cfg.target_vocab_size != target.vocab_size) or other:
            raise ValueError(f"suffix drafter {path} holds answers of another target (checkpoint "
                             f"{cfg.target_id or 'unknown'}, vocabulary {cfg.target_vocab_size}) than this one "
                             f"({target.identity or 'unknown'}, {target.vocab_size}); build it for this target with "
                             "`mmspec train-drafter --method suffix`")
        flat = load_file(str(path / "model.safetensors"))
        tokens, offsets = flat["tokens"].tolist(), flat["offsets"].tolist()
        corpus = (tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:]))
        return cls(cfg, corpus)

    @staticmethod
    def save(path: str | Path, answers: list[list[int]], cfg: SuffixConfig) -> Path:
        """Write a corpus of answers (token ids) as a drafter checkpoint: config.json + model.safetensors (the
        answers back to back, and their offsets)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        offsets = [0]
        for a in answers:
            offsets.append(offsets[-1] + len(a))
        flat = [t for a in answers for t in a]
        save_file({"tokens": torch.tensor(flat, dtype=torch.int32), "offsets": torch.tensor(offsets)},
                  str(path / "model.safetensors"))
        (path / "config.json").write_text(cfg.model_dump_json(indent=2))
        return path

    # ---------- lifecycle ----------
    def begin(self, target: "VLMTarget", prefill: "TargetOutput", root: int) -> None:
        """Index this prompt's text tokens (the request's own store)."""
        media = target.media_token_ids
        prompt = [t for t in prefill.input_ids[0].tolist() if t not in media]
        self.request = SuffixIndex(self.cfg.max_context)
        self.request.add(prompt)
        self.context = prompt + [root]
        self.request.add(self.context, start=len(prompt))

    def observe(self, tokens: list[int], hidden: torch.Tensor, bonus: int) -> None:
        n = len(self.context)
        self.context += tokens[1:] + [bonus]
        self.request.add(self.context, start=n)

    def learn(self, answer: list[int], marker: int | None = None) -> None:
        """Add one answer to the corpus: its continuations, and its opening after START (and `marker`)."""
        self.corpus.add(answer)
        for m in (START, marker) if marker is not None else (START,):
            self.corpus.add_opening(m, answer)

    def prompt_draft(self, prompt: list[int], depth: int) -> list[int]:
        """The most counted opening of answers to this exact prompt (else of any answer in the corpus), followed
        while its context was seen, up to `depth` tokens: for the engine to verify inside the prefill."""
        self.marker = prompt_marker(prompt)
        start = self.marker if (self.marker,) in self.corpus.counts else START
        chain: list[int] = []
        if not self.cfg.openings:
            return chain
        share = 1.0
        while len(chain) < depth:
            counts = self.corpus.longest([start, *chain])
            if not counts:
                break
            tok, c = counts.most_common(1)[0]
            share *= c / sum(counts.values())
            if share < self.cfg.opening_share:
                break
            chain.append(tok)
        return chain

    def propose(self, root: int, cfg: TreeConfig) -> DraftTree:
        """Best-first: expand the highest-scoring node (product of count shares from the root) until the tree holds
        `total_tokens` nodes; a node at `depth` is not expanded, nor one whose context was never seen."""
        budget = max(0, cfg.total_tokens - 1)
        tokens, parents, depths, scores = [root], [-1], [0], [0.0]
        paths: list[list[int]] = [[]]
        heap: list[tuple[float, int, int, int]] = []  # (-score, tie order, parent node, token)
        order = 0
        tail = self.context[-self.cfg.max_context:]

        def push_children(node: int) -> None:
            nonlocal order
            if depths[node] >= cfg.depth:
                return
            counts = self.request.longest(tail + paths[node], self.corpus)
            if not counts:
                return
            total = sum(counts.values())
            for tok, c in counts.most_common(cfg.top_k):
                heapq.heappush(heap, (-(scores[node] + math.log(c / total)), order, node, tok))
                order += 1

        push_children(0)
        while heap and len(tokens) - 1 < budget:
            neg, _, parent, tok = heapq.heappop(heap)
            tokens.append(tok)
            parents.append(parent)
            depths.append(depths[parent] + 1)
            scores.append(-neg)
            paths.append(paths[parent] + [tok])
            push_children(len(tokens) - 1)
        return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long),
                         torch.tensor(depths, dtype=torch.long), torch.tensor(scores))

    def finish(self, answer: list[int]) -> None:
        """The request's whole answer: added to the corpus (when `learn`, within `max_corpus_tokens`)."""
        marker, self.marker = self.marker, None
        if self.cfg.learn and len(answer) > 1 and self.corpus.tokens + len(answer) <= self.cfg.max_corpus_tokens:
            self.learn(answer, marker)
