"""Within noise of plain decoding where drafting does not pay: the engine's online payoff guard.

A calibrated tree is right on average, not for every request: a short video caption, a prompt the drafter has not
seen the like of, or a stretch of an answer the drafter cannot guess can cost more in drafting and wider verifies
than its accepted tokens save. The guard measures, per request, what each drafted cycle paid (tokens committed x the
measured seconds of a plain one-token step, against the cycle's own seconds) and moves down a short ladder of trees
when a running mean of that ratio drops below 1: the calibrated tree, a half-size one, then plain one-token steps
(the AR baseline's own forward, with no drafter work at all). From plain steps it retries drafting after a backoff
that doubles after each failed retry, and a half-size tree that pays well grows back. What it learns is kept per
kind of request (media kind and prompt length): how long its answers run, and what drafting paid on each of its last
requests once the drafter's own prefill is counted. A kind is held plain at the start of a request only when
drafting lost on every one of its last requests (at least `KIND_MIN` of them). A held request drafts once its answer
outgrows the kind's usual length, and one in `PROBE_EVERY`, drawn at random (so the probes cannot all land on the
rows a drafter cannot guess), measures drafting again within the first half of the usual answer: a drafter that
pays on some rows of a kind is never silenced by the rows it cannot guess. A wait before a retry is never longer
than the answers it holds plain. Lossless as ever: the guard only chooses which tree is proposed.
"""

from __future__ import annotations

import random
import statistics
from collections import Counter, deque
from dataclasses import dataclass, field

from mmspec_ray.decoding.tree import TreeConfig
from mmspec_ray.targets.request import Request

PLAIN = TreeConfig(top_k=1, depth=1, total_tokens=1)  # one token per forward: no drafting
MIN_CYCLES = 3  # drafted cycles at one tree before the guard judges it (twice as many where it pays on the kind) ...
RETRY_CYCLES = 2  # ... and on a retry after plain steps (each failed retry costs these cycles)
GAIN_ALPHA = 0.3  # weight of the newest cycle in the running gain
YARDSTICK = 3  # plain steps timed before anything is drafted (once per engine): their median is the yardstick ...
STEPS_KEPT = 16  # ... and then the median of the latest this many plain steps (a cold first forward, e.g. a GPU's
# library start-up, must not set the yardstick for good: a yardstick too long makes any drafting look paying)
GROW = 1.3  # a running gain at which a shrunk tree grows back one size
BACKOFF = (8, 64)  # plain steps before drafting is retried: the first wait, and the cap it doubles up to
KIND_MIN = 4  # drafted requests of a kind, every one a loss, before its requests start plain ...
KIND_KEPT = 16  # ... judged over the latest this many drafted requests (any one that paid keeps the kind drafting)
RUNG_ALPHA = 0.2  # weight of the newest drafted cycle in a kind's gain at that rung
EXPLORE_EVERY = 8  # every this many requests of a kind, one starts on a rung other than the best one so far
ANSWERS_KEPT = 16  # answer lengths remembered per kind (their median: how long the kind's answers run)
PROBE_EVERY = 8  # a held kind's requests that probe drafting within the first half of the usual answer: one in this
PROBE_SEED = 0  # ... drawn by a seeded generator per kind (a decoder's choices repeat from run to run)
# why a cycle was decoded plainly by the guard (a row's `guard` outcome names the commonest, "drafted" when none);
# ONE_TOKEN: the tree itself is one token (calibration measured that drafting does not pay on this machine)
WARM_UP, HELD, FELL_BACK, ONE_TOKEN = "warm_up", "held", "fell_back", "one_token_tree"


def ladder(tree: TreeConfig) -> list[TreeConfig]:
    """The trees the guard moves between, largest first: `tree`, a half-size tree where `tree` has more than two
    tokens, then plain one-token steps."""
    if tree.total_tokens <= 1:
        return [PLAIN]
    out = [tree]
    if tree.total_tokens > 2:
        out.append(TreeConfig(top_k=max(1, tree.top_k // 2), depth=max(1, tree.depth // 2),
                              total_tokens=max(2, tree.total_tokens // 2)))
    return out + [PLAIN]


def request_kind(request: Request, prompt_tokens: int, greedy: bool = True) -> str:
    """The kind of request the guard keeps apart: its media kind, its prompt length (short / medium / long / very
    long) and whether it samples, since each changes what a drafter is worth (a clip's drafter prefill, a long
    context's verify, acceptance under sampling)."""
    media = "video" if request.videos else "image" if request.images else "text"
    size = next((name for name, top in (("short", 256), ("medium", 1024), ("long", 4096)) if prompt_tokens <= top),
                "very-long")
    return f"{media}/{size}/{'greedy' if greedy else 'sampled'}"


@dataclass
class KindMemory:
    """What the guard learnt about one kind of request, carried to the next request of that kind."""

    level: int = 0  # the ladder rung the last request of this kind ended on
    backoff: int = BACKOFF[0]  # plain steps before the next retry
    gains: dict[int, float] = field(default_factory=dict)  # drafting rung -> running gain of its cycles on this kind
    requests: int = 0  # requests of this kind started
    # seconds drafting saved on each of the latest drafted requests (negative: lost), the drafter's prefill included
    payoffs: deque = field(default_factory=lambda: deque(maxlen=KIND_KEPT))
    answers: deque = field(default_factory=lambda: deque(maxlen=ANSWERS_KEPT))  # recent answer lengths in tokens
    draws: random.Random = field(default_factory=lambda: random.Random(PROBE_SEED))  # which held requests probe

    @property
    def pay_s(self) -> float | None:
        """Mean seconds drafting saved per drafted request of this kind lately (None: none drafted yet)."""
        return statistics.fmean(self.payoffs) if self.payoffs else None

    @property
    def held(self) -> bool:
        """Drafting lost on each of this kind's latest drafted requests, at least `KIND_MIN` of them: its requests
        start plain (and probe). One request that paid among them keeps the kind drafting from the start."""
        return len(self.payoffs) >= KIND_MIN and max(self.payoffs) < 0

    def start_level(self, plain_level: int) -> int:
        """The rung a request of this kind starts on: plain where the kind is `held`; else the drafting rung with
        the best gain on this kind so far, trying a rung not yet tried while the best is below `GROW`, and another
        rung than the best every `EXPLORE_EVERY` requests (so a rung that lost once on a few cycles is measured
        again)."""
        self.requests += 1
        if plain_level == 0 or self.held:
            return plain_level
        rungs = range(plain_level)
        known = {r: g for r, g in self.gains.items() if r < plain_level}
        if not known:
            return min(self.level, plain_level - 1)
        best = max(known, key=lambda r: (known[r], -r))
        untried = [r for r in rungs if r not in known]
        if untried and known[best] < GROW:
            return untried[0]
        if len(rungs) > 1 and self.requests % EXPLORE_EVERY == 0:
            return next(r for r in rungs if r != best)
        return best

    def usual(self) -> int | None:
        """How long this kind's answers run: the median of the latest ones (None before any)."""
        return int(statistics.median(self.answers)) if self.answers else None

    def first_wait(self, held: bool) -> int:
        """Plain steps before a request's first retry: the backoff, never past half the kind's usual answer (a wait
        as long as the answers it holds plain would silence the drafter for good); for a held kind, the usual
        answer length itself except on one request in `PROBE_EVERY`, drawn at random."""
        usual = self.usual()
        if usual is None:
            return self.backoff
        if held and self.draws.randrange(PROBE_EVERY):
            return max(1, usual)
        return max(1, min(self.backoff, usual // 2))


class PayoffGuard:
    """What the guard knows across requests (one per engine): the seconds of a plain step, and each kind's memory."""

    def __init__(self) -> None:
        self.steps: deque = deque(maxlen=STEPS_KEPT)  # seconds of the latest plain one-token cycles
        self.kinds: dict[str, KindMemory] = {}

    @property
    def step_s(self) -> float | None:
        """Seconds of a plain one-token cycle (forward + bookkeeping): the median of the latest ones, once
        `YARDSTICK` are timed."""
        return statistics.median(self.steps) if len(self.steps) >= YARDSTICK else None

    def request(self, tree: TreeConfig, kind: str) -> "RequestGuard":
        """The guard of one request decoded with `tree` as its largest tree."""
        return RequestGuard(self, tree, self.kinds.setdefault(kind, KindMemory()))

    def plain_step(self, seconds: float) -> None:
        self.steps.append(seconds)


class RequestGuard:
    """The guard during one request: which tree each cycle uses, from what the cycles so far paid."""

    def __init__(self, guard: PayoffGuard, tree: TreeConfig, memory: KindMemory) -> None:
        self.guard, self.memory = guard, memory
        self.ladder = ladder(tree)
        self.plain_level = len(self.ladder) - 1
        held = memory.held
        self.level = memory.start_level(self.plain_level)
        self.wait = memory.first_wait(held)  # plain steps before the next retry
        self.gain: float | None = None  # running mean of (tokens x plain-step seconds / cycle seconds) at this rung
        self.judged = 0  # drafted cycles at this rung since it was entered
        self.plain_run = 0  # plain steps since drafting last stopped
        self.retry = False  # this drafting stretch is a retry after plain steps
        self.pay_s = 0.0  # seconds drafting saved on this request so far (negative: lost)
        self.drafted = False
        self.moves: list[tuple[int, int]] = []  # (answer tokens so far, new rung) at each move: the stats' record
        # why the guard's plain steps are plain, while they are: the kind held, a fall back, or a one-token tree
        self.why = ONE_TOKEN if self.plain_level == 0 else HELD
        self.plain: Counter[str] = Counter()  # cycles this guard decoded plainly, by why

    @property
    def outcome(self) -> str:
        """What the guard did on this request: `drafted` (it never held a cycle plain), else why most of its plain
        cycles were plain: `held` (the kind lost on its latest requests), `fell_back` (drafting did not pay on
        this request), `warm_up` (a plain step's time was still being measured), `one_token_tree` (the tree
        itself is one token)."""
        return self.plain.most_common(1)[0][0] if self.plain else "drafted"

    def next_tree(self, generated: int) -> TreeConfig:
        """The tree of the coming cycle, `generated` answer tokens in."""
        if len(self.guard.steps) < YARDSTICK:  # the yardstick first
            self.plain[WARM_UP] += 1
            return PLAIN
        if self.level == self.plain_level and self.plain_level > 0 and self.plain_run >= self.wait:
            self._move(self.plain_level - 1, generated)
            self.retry = True
        if self.level == self.plain_level:
            self.plain[self.why] += 1
        return self.ladder[self.level]

    def record(self, tree: TreeConfig, tokens: int, seconds: float, extra_s: float = 0.0, generated: int = 0) -> None:
        """One cycle done with `tree`: `tokens` committed in `seconds` (its drafting, forward and bookkeeping).
        `extra_s`: the drafter's catch-up before it (its prefill, or observing the plain steps it missed), charged to
        this request's payoff but not to the running gain, which judges the tree's steady state."""
        if tree.total_tokens <= 1:
            self.guard.plain_step(seconds)
            self.plain_run += 1
            return
        step = self.guard.step_s or seconds
        self.drafted = True
        self.pay_s += tokens * step - seconds - extra_s
        ratio = tokens * step / max(seconds, 1e-9)
        self.gain = ratio if self.gain is None else GAIN_ALPHA * ratio + (1 - GAIN_ALPHA) * self.gain
        known = self.memory.gains.get(self.level)
        self.memory.gains[self.level] = ratio if known is None else RUNG_ALPHA * ratio + (1 - RUNG_ALPHA) * known
        self.judged += 1
        need = RETRY_CYCLES if self.retry else MIN_CYCLES
        if self.judged < need:
            return
        if self.gain < 1.0:
            if self.memory.gains[self.level] >= 1.0 and self.judged < 2 * need:  # the tree pays on this kind: a stretch
                return  # of hard tokens (a caption's first content words) gets as many cycles again
            if self.retry and self.level + 1 == self.plain_level:  # a retry that failed: wait longer next time
                self.memory.backoff = min(2 * self.memory.backoff, BACKOFF[1])
                self.wait = self.memory.backoff  # (within this request the half-answer cap has had its probe)
            if self.level + 1 == self.plain_level and not self.retry:
                self.why = FELL_BACK  # (a failed retry keeps the stretch's why: a held kind stays held)
            self._move(self.level + 1, generated)
        elif self.retry:  # a retry that paid: back to the first wait
            self.retry, self.memory.backoff = False, BACKOFF[0]
            self.wait, self.why = self.memory.backoff, FELL_BACK
        elif self.gain >= GROW and self.level > 0:
            self._move(self.level - 1, generated)

    def finish(self, answer_tokens: int) -> None:
        """The request ended: what the kind remembers for its next request."""
        self.memory.level = self.level
        self.memory.answers.append(answer_tokens)
        if self.drafted:
            self.memory.payoffs.append(self.pay_s)

    def _move(self, level: int, generated: int) -> None:
        self.level, self.gain, self.judged, self.plain_run = level, None, 0, 0
        self.retry = False
        self.moves.append((generated, level))
