"""A draft tree sized to the hardware and the drafter: measure, once per (target, drafter, device), what a verify
forward of n tokens costs and how many tokens the drafter gets accepted, then pick the tree with the most tokens
per second.

Why: a verify forward of n tokens is almost free on a big GPU and costs 2-3x a one-token step on a CPU, so no fixed
tree is right everywhere (docs/design.md, "Tree calibration"; measured in docs/benchmarks.md).

How, without decoding work of its own: while calibrating, the engine decodes one cycle in `PROBE_EVERY` with a
large probe tree and records the proposed tree and the accepted path. The tree EAGLE-2 growth would build with a
smaller `total_tokens` and `depth` is the best-scoring subset of the probe's candidates, so what it would have
accepted is read off the record: exact at T = 0 while the probe kept enough nodes, an estimate when sampling and
for a smaller `top_k` (the growth is replayed on the recorded candidates). A verify-cost curve measured before the
first request's prefill gives each tree's cycle time; the pick maximises tokens per forward / cycle time. It is
cached under $MMSPEC_HOME/calibration/ and reused by every later engine with the same key.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from mmspec_ray.config import mmspec_home
from mmspec_ray.decoding.tree import DraftTree, TreeConfig, depths

log = logging.getLogger(__name__)

PROBE = TreeConfig(top_k=8, depth=8, total_tokens=64)
COST_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
COST_BUDGET_S = 10.0  # the cost curve's measured rounds fit this (3 at least): a 7B model on a CPU is not held up
PROBE_CYCLES = 64  # whole probe cycles recorded before the final pick ...
PROBE_PER_REQUEST = 12  # ... at most this many from one request (the rest of it decodes with the pick so far) ...
PROBE_EVERY = 3  # ... one cycle in this many, so that they span the answer (its start is the easiest part), at a
# phase that rotates from request to request: with a fixed phase every answer's first cycle would be probed, and on
# toy-m's short answers those starts were 39 % of the records (against 11-16 % of the cycles) and inflated the
# prediction
FALLBACK = TreeConfig(top_k=4, depth=4, total_tokens=12)  # before the first record (e.g. answers too short to probe)
MIN_GAIN = 1.02  # a tree must beat a plain one-token step by this much (predicted) to be drafted at all
TIE = 0.01  # predicted speedups this close count as equal: the smaller tree wins
MIN_STEPS = 8  # drafter steps of one top_k timed before its mean counts (while none has: every timed mean counts)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def verify_seconds(target: Any, inputs: dict, sizes: tuple[int, ...] = COST_SIZES, repeats: int = 9,
                   warmup: int = 2, budget_s: float | None = None) -> dict[int, float]:
    """Seconds of one verify forward of a chain of n random tokens after the encoded prompt `inputs`, for each n in
    sizes: sizes interleaved round by round (so drift hits them alike), the median per size, then made
    non-decreasing in n (a bigger forward never costs less; a noisy dip must not pick a tree). `budget_s`: fewer
    rounds (at least 3 measured) where forwards are slow, e.g. a large model on a CPU. Leaves the target's cache
    holding the prompt (the caller prefills again)."""
    vocab = target.model.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    target.prefill(inputs)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    rounds, done, t_start = warmup + repeats, 0, time.perf_counter()
    while done < rounds:
        for n in sizes:
            tokens = torch.randint(0, vocab, (n,), generator=g)
            ancestors = torch.tril(torch.ones(n, n, dtype=torch.bool))
            _sync(target.device)
            t0 = time.perf_counter()
            target.verify(tokens, ancestors, torch.arange(n))
            _sync(target.device)
            times[n].append(time.perf_counter() - t0)
            target.commit([])  # drop the chain: the cache holds the prompt again
        done += 1
        if budget_s is not None and done == warmup:  # a warm round's cost sets how many fit in the budget
            per_round = (time.perf_counter() - t_start) / warmup
            rounds = warmup + max(3, min(repeats, int(budget_s / per_round)))
    return monotone({n: statistics.median(ts[warmup:]) for n, ts in times.items()})


def monotone(costs: dict[int, float]) -> dict[int, float]:
    """The closest non-decreasing curve (least squares, pool-adjacent-violators) to costs by size."""
    blocks: list[list[float]] = []  # [mean, count]
    for n in sorted(costs):
        blocks.append([costs[n], 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, c2 = blocks.pop()
            m1, c1 = blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    out = [m for m, c in blocks for _ in range(int(c))]
    return dict(zip(sorted(costs), out))


def interpolate(costs: dict[int, float], n: int) -> float:
    """Verify seconds for n tokens: the cost of the smallest measured size >= n (beyond the largest, in proportion
    to it). Not linear between sizes: on a CPU the cost rises in steps (matrix kernels work on blocks of rows), and
    on toy-m a 5-token verify cost what an 8-token one does (82.8 against 83.9 ms; 4 tokens: 72.5 ms), so a 5-token
    tree priced between 4 and 8 was picked for a speed it did not have (docs/design.md, "Tree calibration"). Where
    the cost grows smoothly, sizes between the measured ones are overcharged and picks land on measured sizes."""
    xs = sorted(costs)
    for x in xs:
        if n <= x:
            return costs[x]
    return costs[xs[-1]] * n / xs[-1]


def grown_subset(tree: DraftTree, top_k: int, depth: int, kids: list[list[int]] | None = None) -> list[int]:
    """The probe tree's nodes that EAGLE-2 growth with this top_k and depth would create, best score first:
    each level takes the top_k children of the previous level's top_k best nodes (replayed on what was recorded,
    so a node the probe did not keep is missing: the estimate errs low). As in growth, the root's children come
    from the target and each of `depth` drafter steps adds a level: nodes reach depth + 1. `kids`: the tree's
    `children()`, when the caller already has them."""
    kids = kids if kids is not None else tree.children()  # best score first
    scores = tree.scores.tolist()
    frontier, cand = [0], []
    for _ in range(depth + 1):
        level = [c for p in frontier for c in kids[p][:top_k]]
        if not level:
            break
        cand += level
        frontier = sorted(level, key=lambda c: -scores[c])[:top_k]
    cand.sort(key=lambda c: (-scores[c], c))
    return cand


def accepted_by_size(tree: DraftTree, path: list[int], top_k: int, depth: int, max_tokens: int,
                     kids: list[list[int]] | None = None) -> list[int]:
    """acc[n] for n in 0..max_tokens: draft tokens of `path` (accepted in the probe tree, root first) that a tree
    of n tokens (root included) grown with top_k / depth would also hold as a prefix of the path."""
    rank = {c: i for i, c in enumerate(grown_subset(tree, top_k, depth, kids))}
    acc = [0] * (max_tokens + 1)
    worst = -1
    for j, node in enumerate(path[1:], start=1):
        if node not in rank:
            break
        worst = max(worst, rank[node])
        for n in range(worst + 2, max_tokens + 1):  # a tree of n tokens keeps the n - 1 best candidates
            acc[n] = j
    return acc


def level_seconds(steps: dict[int, list[float]], top_k: int) -> float:
    """Seconds of one drafter step that expands `top_k` nodes, from the steps timed while calibrating
    ({top_k: [seconds, steps]}): a step's cost grows with the nodes it expands (toy-m's EAGLE-2: 3.5 ms at top-k 1,
    4.5 ms at 2, 5.1 ms at 8), and the probe's steps alone (top-k 8) overcharged narrow trees. The means of the top_k
    values timed over at least `MIN_STEPS` steps (all of them where none was), made non-decreasing in top_k, linear
    between them and flat beyond them."""
    pts = {k: sec / n for k, (sec, n) in steps.items() if n >= MIN_STEPS} or {
        k: sec / n for k, (sec, n) in steps.items() if n > 0}
    if not pts:
        return 0.0
    pts = monotone(pts)
    xs = sorted(pts)
    if top_k <= xs[0]:
        return pts[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if top_k <= b:
            return pts[a] + (pts[b] - pts[a]) * (top_k - a) / (b - a)
    return pts[xs[-1]]


class TreePick(BaseModel):
    """A calibration's result, as cached: the tree, and the evidence for it."""

    tree: TreeConfig
    predicted_speedup: float  # over a one-token step, from the measured costs and the recorded acceptance
    tokens_per_forward: float
    verify_ms: dict[int, float]
    draft_ms_per_level: float  # one drafter step of the pick's top_k
    draft_ms_per_cycle: float  # the drafter's observe of the accepted tokens, whatever the tree
    book_ms_per_cycle: float = 0.0  # the engine's own work per cycle (acceptance, processors, KV commit)
    probe: TreeConfig
    probe_cycles: int
    key: dict[str, Any]
    created: float


def _table(records, kids, costs, draft_s_per_level: float, draft_s_per_cycle, book_s_per_cycle, k, d,
           max_tokens) -> dict[int, tuple[float, float]]:
    """{n: (predicted speedup, tokens per forward)} of the trees of n = 2..max_tokens with this top_k and depth."""
    acc = [0.0] * (max_tokens + 1)
    for (tree, path), tree_kids in zip(records, kids):
        for n, a in enumerate(accepted_by_size(tree, path, k, d, max_tokens, tree_kids)):
            acc[n] += a
    one = costs[min(costs)]
    out = {}
    for n in range(2, max_tokens + 1):
        tpf = 1.0 + acc[n] / max(1, len(records))
        # the bookkeeping is the probe's (the biggest trees) and is charged to drafting only: both err towards
        # drafting less, which matters where a forward costs little next to the engine's Python (a tiny target)
        out[n] = (tpf * one / (interpolate(costs, n) + draft_s_per_level * d + draft_s_per_cycle + book_s_per_cycle),
                  tpf)
    return out


def pick_tree(records: list[tuple[DraftTree, list[int]]], costs: dict[int, float],
              draft_s_per_level: float | Callable[[int], float], probe: TreeConfig = PROBE,
              draft_s_per_cycle: float = 0.0, book_s_per_cycle: float = 0.0, min_gain: float = MIN_GAIN,
              tie: float = TIE) -> TreePick:
    """The tree with the highest predicted tokens per second, where trees within `tie` of the best go to the
    smallest (total_tokens, then depth, then top_k): the prediction is not finer than that. Where no tree beats a
    plain one-token step by `min_gain`, the pick is the 1-token tree: no drafting. `draft_s_per_level`: one
    drafter step's seconds, or a function of the step's top_k."""
    level = draft_s_per_level if callable(draft_s_per_level) else (lambda k: draft_s_per_level)
    kids = [tree.children() for tree, _ in records]  # once per record, not per (top_k, depth)
    table = [(speedup, tpf, TreeConfig(top_k=k, depth=d, total_tokens=n))
             for k in range(1, probe.top_k + 1) for d in range(1, probe.depth + 1)
             for n, (speedup, tpf) in _table(records, kids, costs, level(k), draft_s_per_cycle,
                                             book_s_per_cycle, k, d, probe.total_tokens).items()]
    top = max(s for s, _, _ in table)
    if top < min_gain:
        speedup, tpf, tree = 1.0, 1.0, TreeConfig(top_k=1, depth=1, total_tokens=1)
    else:
        speedup, tpf, tree = min((row for row in table if row[0] >= top / (1 + tie)),
                                 key=lambda r: (r[2].total_tokens, r[2].depth, r[2].top_k))
    return TreePick(tree=tree, predicted_speedup=speedup, tokens_per_forward=tpf,
                    verify_ms={n: 1e3 * s for n, s in costs.items()}, draft_ms_per_level=1e3 * level(tree.top_k),
                    draft_ms_per_cycle=1e3 * draft_s_per_cycle, book_ms_per_cycle=1e3 * book_s_per_cycle,
                    probe=probe, probe_cycles=len(records), key={}, created=time.time())


def device_name(device: torch.device) -> str:
    """What the costs depend on: the accelerator, or the CPU model and the torch thread count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {torch.get_num_threads()} threads"


def calibration_dir() -> Path:
    """$MMSPEC_CALIBRATION_DIR, else $MMSPEC_HOME/calibration (the test suite keeps its own)."""
    if os.environ.get("MMSPEC_CALIBRATION_DIR"):
        return Path(os.environ["MMSPEC_CALIBRATION_DIR"])
    return mmspec_home() / "calibration"


def weights_stamp(path: str) -> str:
    """Size and modification time of a local checkpoint's weights ("" for anything else): a checkpoint trained
    again in the same folder (e.g. a toy world's drafter under a new recipe) gets a tree calibrated for it. A
    draft-model spec (`draft-model:PATH`) stamps PATH; a sharded checkpoint, its shard index."""
    path = path.removeprefix("draft-model:")
    for name in ("model.safetensors", "model.safetensors.index.json"):
        try:
            st = (Path(path) / name).stat()
        except (OSError, ValueError):
            continue
        return f"{st.st_size}:{st.st_mtime_ns}"
    return ""


def calibration_key(target: Any, drafter: str) -> dict[str, str]:
    name = str(getattr(target.model, "name_or_path", "") or type(target.model).__name__)
    key = {"target": name, "drafter": drafter, "device": device_name(target.device), "dtype": str(target.dtype),
           "torch": torch.__version__}
    stamps = {k: weights_stamp(v) for k, v in (("target_weights", name), ("drafter_weights", drafter))}
    return key | {k: v for k, v in stamps.items() if v}  # keys without weights on disk stay as they were


def _cache_path(key: dict[str, str], suffix: str = ".json") -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return calibration_dir() / f"{digest}{suffix}"


def cached_pick(key: dict[str, str]) -> TreePick | None:
    p = _cache_path(key)
    try:
        pick = TreePick.model_validate_json(p.read_text())
    except (OSError, ValueError):
        return None
    return pick if pick.key == key else None


@dataclass
class TreeCalibrator:
    """The engine's tree while calibrating. One cycle in `every` uses the probe and is recorded, up to
    `per_request` per request (so the records span the answers and several requests); the other cycles use the
    pick from the records so far. Once `cycles` are in, the pick is final and cached; until then the records outlive the process (a
    `.partial.json` beside the cache), so one-request runs such as `mmspec generate` calibrate over several runs."""

    key: dict[str, str]
    probe: TreeConfig = PROBE
    cycles: int = PROBE_CYCLES
    per_request: int = PROBE_PER_REQUEST
    every: int = PROBE_EVERY
    fallback: TreeConfig = FALLBACK
    costs: dict[int, float] | None = None
    records: list[tuple[DraftTree, list[int]]] = field(default_factory=list)
    steps: dict[int, list[float]] = field(default_factory=dict)  # {top_k: [seconds, drafter steps]} timed so far
    observe_s: float = 0.0
    book_s: float = 0.0
    this_request: int = 0
    requests: int = 0  # requests started while calibrating: sets each one's probe phase
    phase: int = 0  # this request probes the cycles c with c % every == phase
    cycle: int = 0  # cycles of this request so far
    provisional: TreeConfig | None = None
    result: TreePick | None = None

    def start_request(self, target: Any, inputs: dict) -> None:
        """Before the engine's prefill: the verify-cost curve (first request only, on its prompt)."""
        if self.costs is None:
            sizes = tuple(n for n in COST_SIZES if n <= self.probe.total_tokens)
            self.costs = verify_seconds(target, inputs, sizes, budget_s=COST_BUDGET_S)
        self.this_request, self.cycle, self.provisional = 0, 0, None
        self.phase, self.requests = self.requests % self.every, self.requests + 1

    def next_cycle(self, whole: bool) -> tuple[TreeConfig, bool]:
        """The tree of the coming cycle, and whether it is a probe cycle to record. `whole`: a probe tree would be
        verified whole (enough tokens and cache left). One such cycle in `every` probes; the others use the pick
        from the records so far (made once per request), or `fallback` before any record."""
        probe = whole and self.this_request < self.per_request and self.cycle % self.every == self.phase
        self.cycle += 1
        if probe:
            return self.probe, True
        if not self.records:
            return self.fallback, False
        if self.provisional is None:
            self.provisional = self._pick().tree
        return self.provisional, False

    def observe(self, tree: DraftTree, path: list[int], propose_s: float, observe_s: float, book_s: float,
                passes: int) -> TreeConfig | None:
        """Record one whole probe cycle with its times: the proposal (per drafter step), the drafter's observe of the
        previous cycle and the engine's bookkeeping (both per cycle); returns the final tree once `cycles` are in."""
        self.records.append((tree, path))
        self.this_request += 1
        self.timed(self.probe, propose_s, passes)
        self.observe_s += observe_s
        self.book_s += book_s
        return self.pick() if len(self.records) >= self.cycles else None

    def timed(self, tree: TreeConfig, propose_s: float, passes: int) -> None:
        """A drafted cycle's proposal time (`passes` drafter steps; 0: a drafter that does not count them, taken as
        `tree.depth`), per top_k: what a step costs depends on the nodes it expands."""
        acc = self.steps.setdefault(tree.top_k, [0.0, 0])
        acc[0] += propose_s
        acc[1] += passes if passes else tree.depth

    def end_request(self) -> None:
        """After a request, while not done: keep the records for the next process."""
        _write(_cache_path(self.key, ".partial.json"), json.dumps({
            "key": self.key, "probe": self.probe.model_dump(), "costs": self.costs, "steps": self.steps,
            "observe_s": self.observe_s, "book_s": self.book_s, "requests": self.requests,
            "records": [[t.tokens.tolist(), t.parents.tolist(), t.scores.tolist(), p] for t, p in self.records]}))

    @classmethod
    def resume(cls, key: dict[str, str], probe: TreeConfig = PROBE) -> "TreeCalibrator":
        """A calibrator holding what earlier processes recorded for this key (a fresh one when there is none)."""
        try:
            saved = json.loads(_cache_path(key, ".partial.json").read_text())
            if saved["key"] != key or TreeConfig(**saved["probe"]) != probe:
                return cls(key, probe=probe)
            records = [(DraftTree(torch.tensor(tok), torch.tensor(par), depths(torch.tensor(par)),
                                  torch.tensor(sc)), path) for tok, par, sc, path in saved["records"]]
            costs = {int(n): c for n, c in saved["costs"].items()} if saved["costs"] else None
            steps = ({int(k): v for k, v in saved["steps"].items()} if "steps" in saved else  # an older file:
                     {PROBE.top_k: [saved["propose_s"], saved["levels"]]})  # its probe cycles' steps
            return cls(key, probe=probe, costs=costs, records=records, steps=steps, observe_s=saved["observe_s"],
                       book_s=saved.get("book_s", 0.0), requests=saved.get("requests", 0))
        except (OSError, ValueError, KeyError, TypeError):
            return cls(key, probe=probe)

    def _pick(self) -> TreePick:
        assert self.costs is not None and self.records
        n = len(self.records)
        pick = pick_tree(self.records, self.costs, lambda k: level_seconds(self.steps, k), self.probe,
                         self.observe_s / n, self.book_s / n)
        return pick.model_copy(update={"key": self.key})

    def pick(self) -> TreeConfig:
        """The final pick: cached, logged, the partial records dropped."""
        self.result = pick = self._pick()
        path = _cache_path(self.key)
        _write(path, pick.model_dump_json(indent=1))
        _cache_path(self.key, ".partial.json").unlink(missing_ok=True)
        log.info("tree calibrated for %s: top_k %d, depth %d, %d tokens; predicted %.2fx over a one-token step "
                 "(%.2f tokens per forward; verify of %d tokens = %.2fx a one-token forward; %d probe cycles); "
                 "cached in %s", self.key["drafter"], pick.tree.top_k, pick.tree.depth, pick.tree.total_tokens,
                 pick.predicted_speedup, pick.tokens_per_forward, pick.tree.total_tokens,
                 interpolate(self.costs, pick.tree.total_tokens) / self.costs[min(self.costs)], len(self.records),
                 path)
        return pick.tree


def _write(path: Path, text: str) -> None:
    """Atomic: a reader (another actor on this node) sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def auto_tree(target: Any, drafter: str, recalibrate: bool = False,
              probe: TreeConfig | None = None) -> TreeConfig | TreeCalibrator:
    """The calibrated tree for (target, drafter, this device) from the cache, or a calibrator that finds it while
    the engine decodes its first requests. `drafter` is the drafter's spec (method name or checkpoint path).
    `probe`: the largest tree calibration considers, where a drafter asks for another than `PROBE` (its
    `probe_tree`, e.g. a draft model deep chains of which are accepted whole); part of the cache key."""
    if not drafter or drafter == "none":
        return TreeConfig(top_k=1, depth=1, total_tokens=1)
    probe = probe or PROBE
    key = calibration_key(target, drafter)
    if probe != PROBE:
        key["probe"] = f"k{probe.top_k}d{probe.depth}n{probe.total_tokens}"
    if recalibrate:
        _cache_path(key, ".partial.json").unlink(missing_ok=True)
        return TreeCalibrator(key, probe=probe)
    pick = cached_pick(key)
    if pick is not None:
        log.info("tree for %s from the calibration cache: top_k %d, depth %d, %d tokens (predicted %.2fx)", drafter,
                 pick.tree.top_k, pick.tree.depth, pick.tree.total_tokens, pick.predicted_speedup)
        return pick.tree
    return TreeCalibrator.resume(key, probe)
