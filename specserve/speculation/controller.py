"""How many draft nodes each decoding request gets this step: chosen for the batch's goodput.

Goodput is the step's expected emitted tokens per second of step time. Every decoding request
emits one token whatever happens; a draft node adds the chance that it is accepted, and costs
what it adds to the step (one more token in the forward, and for the first node of a request the
per-request cost of drafting and verifying a tree). The controller keeps exactly the draft nodes
whose expected tokens pay for their cost at the batch's goodput, and none when nothing pays.

- `AcceptanceModel`: per drafter and per request, the measured chance that a node is accepted
  given that its parent was, by depth and by sibling rank; a request's estimate starts from its
  drafter's history across requests and moves with what its own steps show.
- `StepCostModel`: a step's seconds from its shape (tokens in the forward, requests carrying a
  tree, attended context), from short probes taken at start (forward time by token count, and
  by context attended), scaled and completed online from the engine's own steps: right where 16
  verified tokens cost 1.4x one (a 2-core CPU) and where 1 to 64 cost the same (a GPU).
- `GoodputController.select`: given every request's candidate nodes sorted by value, the
  selection that maximises (expected tokens) / (predicted seconds), by Dinkelbach's iteration:
  at goodput g a node is kept when its value exceeds g x (its marginal cost: one more token in
  the forward, attending to its request's context), a request drafts
  when its kept nodes together pay g x (its fixed cost); g is then recomputed, and the
  iteration ends when the selection stops changing. With a latency target (`latency_slo`,
  seconds per token), nodes are then taken back, least valuable per second first, until every
  request's expected time per token this step (the step's seconds over 1 + its expected accepted
  nodes; a request drafting nothing gets one token for the whole step) is within the target, or
  within the plain step's time where plain decoding itself misses it: drafts for some requests
  never slow the others beyond the bound. The pace bound (`pace_slack`) is the same cut for the
  requests behind plain decoding's pace only (the speculator keeps each request's pace).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from specserve.speculation.tree import DraftTree


@dataclass
class _Counts:
    accepted: float = 0.0
    tried: float = 0.0

    def add(self, accepted: bool, decay: float) -> None:
        self.accepted = self.accepted * decay + float(accepted)
        self.tried = self.tried * decay + 1.0


@dataclass
class _Stats:
    by_key: dict[tuple[int, int], _Counts] = field(default_factory=dict)
    proposals: _Counts = field(default_factory=_Counts)  # asked to draft: did it propose anything?
    version: int = 0  # bumped whenever `by_key` changes (the rates memoized from it are then stale)

    def get(self, key: tuple[int, int]) -> _Counts:
        c = self.by_key.get(key)
        if c is None:
            c = self.by_key[key] = _Counts()
        return c


class AcceptanceModel:
    """P(node accepted | parent accepted), per drafter and per request, by (depth, sibling rank),
    or, for nodes the drafter scored, by its score (in tenths): the drafter's claim, calibrated.

    A request's rate is (its own accepted + m x prior) / (its own tried + m), where the prior is
    the drafter's rate across requests (itself starting at `initial`, or at the score), and both
    forget old steps (`request_decay`, `drafter_decay` per observation): a moving estimate with a
    prior.
    """

    def __init__(
        self, initial: float = 0.5, prior_weight: float = 4.0, request_decay: float = 0.9,
        drafter_decay: float = 0.998, max_depth: int = 8, max_rank: int = 3,
    ) -> None:
        self.initial = initial
        self.prior_weight = prior_weight
        self.request_decay = request_decay
        self.drafter_decay = drafter_decay
        self.max_depth = max_depth
        self.max_rank = max_rank
        self._drafters: dict[str, _Stats] = {}
        self._requests: dict[tuple[str, str], _Stats] = {}
        # (drafter, request, rank) -> the stats and versions they came from, the rates at depths
        # 1..max_depth, and their running products (a chain's values): every step asks each
        # request's rates of every drafter several times, and they change only when observed
        self._memo: dict[tuple[str, str, int], tuple[_Stats | None, int, _Stats | None, int, list[float], list[float]]] = {}

    SCORE_BINS = 10

    def _key(self, depth: int, rank: int, score: float | None = None) -> tuple[int, int]:
        if score is not None:
            return -1, min(int(score * self.SCORE_BINS), self.SCORE_BINS - 1)
        return min(depth, self.max_depth), min(rank, self.max_rank)

    def rate(self, drafter: str, request_id: str, depth: int, rank: int = 0, score: float | None = None) -> float:
        if score is None:
            return self._rates(drafter, request_id, rank)[0][min(max(depth, 1), self.max_depth) - 1]
        g = self._drafters.get(drafter)
        r = self._requests.get((drafter, request_id))
        key = self._key(depth, rank, score)
        prior = score
        if g is not None and key in g.by_key:
            c = g.by_key[key]
            prior = (c.accepted + 2.0 * prior) / (c.tried + 2.0)
        if r is None or key not in r.by_key:
            return prior
        c = r.by_key[key]
        return (c.accepted + self.prior_weight * prior) / (c.tried + self.prior_weight)

    def _rates(self, drafter: str, request_id: str, rank: int) -> tuple[list[float], list[float]]:
        """The rates at depths 1..max_depth for `rank` (`_depth_rates`), and their running products,
        memoized until the drafter's or the request's counts change."""
        rank = min(rank, self.max_rank)
        g = self._drafters.get(drafter)
        r = self._requests.get((drafter, request_id))
        gv = -1 if g is None else g.version
        rv = -1 if r is None else r.version
        key = (drafter, request_id, rank)
        hit = self._memo.get(key)
        if hit is not None and hit[0] is g and hit[1] == gv and hit[2] is r and hit[3] == rv:
            return hit[4], hit[5]
        rates = self._depth_rates(g, r, self.max_depth, rank)
        products, p = [], 1.0
        for a in rates:
            p *= a
            products.append(p)
        self._memo[key] = (g, gv, r, rv, rates, products)
        return rates, products

    def _depth_rates(self, g: _Stats | None, r: _Stats | None, depth: int, rank: int) -> list[float]:
        """The rates at depths 1..depth for `rank`, each depth's estimate the prior of the next: the
        drafter's counts at a depth move its estimate from the shallower depth's, the request's own
        from the drafter's. A depth nobody has tried yet is estimated as the depth above it, not
        afresh at `initial`: else a drafter granted 4 nodes would never be tried at depth 5, which
        would stay at `initial` and never be worth granting (on code editing, where nodes are
        accepted ~95% of the time at every depth, grants stuck at 3-4 nodes where 8 paid more).
        Depths past `max_depth` share its estimate."""
        rank = min(rank, self.max_rank)
        drafter_rate, request_rate = self.initial, None
        out: list[float] = []
        for d in range(1, depth + 1):
            if d <= self.max_depth:
                gc = g.by_key.get((d, rank)) if g is not None else None
                rc = r.by_key.get((d, rank)) if r is not None else None
                if gc is not None:
                    drafter_rate = (gc.accepted + 2.0 * drafter_rate) / (gc.tried + 2.0)
                if rc is not None:
                    request_rate = (rc.accepted + self.prior_weight * drafter_rate) / (rc.tried + self.prior_weight)
                elif gc is not None:
                    request_rate = None  # the drafter has measured this depth, the request not: its word
            out.append(drafter_rate if request_rate is None else request_rate)
        return out

    def proposes(self, drafter: str, request_id: str) -> float:
        """The chance that `drafter`, asked to draft for the request, proposes anything."""
        g = self._drafters.get(drafter)
        prior = 1.0 if g is None else (g.proposals.accepted + 1.0) / (g.proposals.tried + 1.0)
        r = self._requests.get((drafter, request_id))
        if r is None:
            return prior
        return (r.proposals.accepted + self.prior_weight * prior) / (r.proposals.tried + self.prior_weight)

    def chain_values(self, drafter: str, request_id: str, n: int) -> list[float]:
        """The chance that each node of an n-node chain is accepted (rank-0 nodes, depth 1..n)."""
        rates, products = self._rates(drafter, request_id, 0)
        if n <= self.max_depth:
            return products[:max(n, 0)]
        out, p, last = products[:], products[-1], rates[-1]  # depths past max_depth share its rate
        for _ in range(n - self.max_depth):
            p *= last
            out.append(p)
        return out

    def node_values(self, drafter: str, request_id: str, tree: DraftTree) -> list[float]:
        """The chance that each node of `tree` is accepted: its parent is, its elder siblings are
        not, and it is."""
        values: list[float] = []
        left: dict[int, float] = {}  # parent -> chance that no child tried so far was accepted
        ranks: dict[int, int] = {}
        scores = tree.scores
        for i, (p, d) in enumerate(zip(tree.parents, tree.depths())):
            rank = ranks.get(p, 0)
            ranks[p] = rank + 1
            reach = (1.0 if p < 0 else values[p]) * left.get(p, 1.0)
            a = self.rate(drafter, request_id, d, rank, None if scores is None else scores[i])
            values.append(reach * a)
            left[p] = left.get(p, 1.0) * (1.0 - a)
        return values

    def observe(self, drafter: str, request_id: str, tree: DraftTree, accepted: list[int]) -> None:
        """Count every node tried (its parent was accepted, no elder sibling was) and whether it was."""
        g = self._drafters.setdefault(drafter, _Stats())
        r = self._requests.setdefault((drafter, request_id), _Stats())
        reached = {-1} | set(accepted)
        ranks: dict[int, int] = {}
        done: set[int] = set()  # parents whose accepted child has been seen
        depths = tree.depths()
        for i, p in enumerate(tree.parents):
            rank = ranks.get(p, 0)
            ranks[p] = rank + 1
            if p not in reached or p in done:
                continue
            ok = i in reached
            keys = [self._key(depths[i], rank)]
            if tree.scores is not None:
                keys.append(self._key(depths[i], rank, tree.scores[i]))
            for key in keys:
                g.get(key).add(ok, self.drafter_decay)
                r.get(key).add(ok, self.request_decay)
            if ok:
                done.add(p)
        g.version += 1
        r.version += 1

    def observe_proposal(self, drafter: str, request_id: str, proposed: bool) -> None:
        self._drafters.setdefault(drafter, _Stats()).proposals.add(proposed, self.drafter_decay)
        self._requests.setdefault((drafter, request_id), _Stats()).proposals.add(proposed, self.request_decay)

    def forget(self, request_id: str) -> None:
        for key in [k for k in self._requests if k[1] == request_id]:
            del self._requests[key]
        for memo in [k for k in self._memo if k[1] == request_id]:
            del self._memo[memo]


class Calibration:
    """What each drafter's acceptance values are multiplied by: its verified trees' accepted nodes
    over what the acceptance model predicted of them (decayed, from a prior of PRIOR predicted and as
    many accepted), at most 1. Under `auto` a request's tree is the one whose predicted value is
    highest among the drafters', so the tree verified is the one whose estimate is likeliest too
    high: on Spec-Bench at batch 1 on the bundled model, ngram's verified trees got 0.78 of the
    accepted nodes predicted of them, recycling's 0.59, suffix's 1.17 (BENCHMARKS.md, session 18).
    Only ever a discount: a drafter whose trees fare better than predicted keeps its values (its own
    estimates, not the choice, set how far it drafts)."""

    PRIOR = 8.0
    DECAY = 0.99  # each verified tree's weight against the next one's

    def __init__(self) -> None:
        self._seen: dict[str, tuple[float, float]] = {}  # drafter -> (accepted, predicted), decayed

    def factor(self, drafter: str) -> float:
        accepted, predicted = self._seen.get(drafter, (0.0, 0.0))
        return min(1.0, (accepted + self.PRIOR) / (predicted + self.PRIOR))

    def record(self, drafter: str, predicted: float, accepted: int) -> None:
        """A verified tree of `drafter`'s: what the acceptance model predicted of its nodes (before
        `factor`), and how many were accepted."""
        old_accepted, old_predicted = self._seen.get(drafter, (0.0, 0.0))
        self._seen[drafter] = (old_accepted * self.DECAY + accepted, old_predicted * self.DECAY + predicted)


class ForwardProfile:
    """Forward seconds by number of tokens, from a probe at start: piecewise linear between the
    probed sizes, extended past the largest along the last segment's slope."""

    def __init__(self, seconds_by_tokens: dict[int, float]) -> None:
        if not seconds_by_tokens:
            raise ValueError("forward profile: needs at least one probed size")
        pts = sorted(seconds_by_tokens.items())
        self.sizes = [n for n, _ in pts]
        # Forward time never falls with more tokens: smooth the probe's noise into a rising curve.
        self.seconds: list[float] = []
        for _, s in pts:
            self.seconds.append(max(s, self.seconds[-1]) if self.seconds else s)

    def __call__(self, tokens: float) -> float:
        xs, ys = self.sizes, self.seconds
        if len(xs) == 1:
            return ys[0] * max(tokens, 1.0) / xs[0]
        i = min(max(bisect_left(xs, tokens), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(0.0, y0 + (y1 - y0) * (tokens - x0) / (x1 - x0))


@dataclass(frozen=True)
class StepShape:
    """What a step's cost depends on: tokens in the forward, requests carrying a draft tree, and
    the attended context (sum over new tokens of the tokens each attends to), of which `hot` is
    draft nodes': they attend to their request's context after its root has read it this step,
    from the cache, where each request's first row reads it from memory."""

    tokens: int
    drafted: int = 0
    attended: int = 0
    hot: int = 0


Upper = tuple[float, float, float, float, float, float, float, float, float, float]


def _times(P: Upper, x: tuple[float, float, float, float]) -> tuple[float, float, float, float]:
    """P x, for the symmetric 4 x 4 matrix P given by its upper triangle (00 01 02 03 11 12 13 22 23 33)."""
    a00, a01, a02, a03, a11, a12, a13, a22, a23, a33 = P
    x0, x1, x2, x3 = x
    return (a00 * x0 + a01 * x1 + a02 * x2 + a03 * x3, a01 * x0 + a11 * x1 + a12 * x2 + a13 * x3,
            a02 * x0 + a12 * x1 + a22 * x2 + a23 * x3, a03 * x0 + a13 * x1 + a23 * x2 + a33 * x3)


def _downdate(P: Upper, g: tuple[float, float, float, float], p: tuple[float, float, float, float],
              scale: float) -> Upper:
    """(P - g p^T) x scale for symmetric P (upper triangle) and g = p over a number, so that the
    result is symmetric: written out over the ten entries. The cost model is updated on every step
    right after the forward, where the interpreter's data is cold: as lists of lists (three updates
    a step) it took 38-48 us a step in the engine, 14 us alone; written out, 4-5 us alone (and the
    same numbers to the last bit)."""
    a00, a01, a02, a03, a11, a12, a13, a22, a23, a33 = P
    g0, g1, g2, g3 = g
    p0, p1, p2, p3 = p
    return ((a00 - g0 * p0) * scale, (a01 - g0 * p1) * scale, (a02 - g0 * p2) * scale, (a03 - g0 * p3) * scale,
            (a11 - g1 * p1) * scale, (a12 - g1 * p2) * scale, (a13 - g1 * p3) * scale,
            (a22 - g2 * p2) * scale, (a23 - g2 * p3) * scale, (a33 - g3 * p3) * scale)


# Where each row's entries of a symmetric 4 x 4 matrix lie in its upper triangle (`Upper`).
_ROW = ((0, 1, 2, 3), (1, 4, 5, 6), (2, 5, 7, 8), (3, 6, 8, 9))
_DIAGONAL = (0, 4, 7, 9)


class StepCostModel:
    """seconds = w0 + w1 x forward(tokens) + w3 x (c x cold + a x hot) + w2 x drafted, by recursive
    least squares with forgetting, where hot is the context draft nodes attend to and cold the rest
    of the attended context (`StepShape`). The shape of a forward's cost comes from the probes
    taken at start (`forward` by token count; `c`, seconds per token of context a request's row
    reads from memory; `a`, per token a further row of the same request reads from the cache: on
    the bundled model at batch 8, 2.75-3.0 us and 1.27); the steps teach the model how each probe's
    shape scales on the machine as it runs (w1 the forward's, w3 the attention's, both starting at
    1), the per-step overhead (w0) and what a request carrying a draft tree adds (w2), both starting
    at 0. Drafting time is measured apart (per drafter) and is not part of this model.

    The attention has a scale of its own because its probe's is not the forward's: with one scale
    for both, on ShareGPT at batch 4 on the bundled model the fit shrank the shared scale to 0.40
    (the steps' context cost less than the attention probe said) and moved the rest into the
    overhead and the per-tree term, and it overpredicted the steps that verified drafts by 12% (mean
    absolute error 0.167); with two scales the forward's stays near 1 and those steps are predicted
    within +0.9% (0.105), at batch 8 +5.3% -> +1.3%, HumanEval batch 4 +3.4% -> +0.1% (replayed on
    the same logged steps: benchmarks/cost_model_replay.py, BENCHMARKS.md, session 31)."""

    def __init__(self, profile: ForwardProfile, forgetting: float = 0.99, per_attended: float = 0.0,
                 per_context: float | None = None) -> None:
        self.profile = profile
        self.forgetting = forgetting
        self.attention = max(per_attended, 0.0)  # a: hot context, per token (draft nodes)
        self.context = self.attention if per_context is None else max(per_context, 0.0)  # c: cold (every request's row)
        # Plain floats, not numpy: every step updates the model, and right after a forward numpy's
        # dozen calls on small vectors took ~80 us (the same arithmetic in floats, ~10).
        self.w = [0.0, 1.0, 0.0, 1.0]  # overhead, forward's scale, per tree, attention's scale
        one = profile(1)
        # Prior spreads in units of the measurement noise (about 5% of a one-token step): the
        # probes' scales are trusted to within half, the other terms may be up to a step's size.
        noise = 0.05 * one
        prior = [(s / noise) ** 2 for s in (one, self.SCALE_SPREAD, 0.2 * one, self.SCALE_SPREAD)]
        self._p0_trace = sum(prior)
        self.P: Upper = (prior[0], 0.0, 0.0, 0.0, prior[1], 0.0, 0.0, prior[2], 0.0, prior[3])  # the upper triangle
        # The prior on the probes' scales is not forgotten: each step gives back, as a pseudo-observation
        # of w1 = 1 +- SCALE_SPREAD (and of w3 alike), the share of it that forgetting took (`_anchor`),
        # weighed against the steps' own noise as measured (their prediction errors), not the probe's.
        # Without it a model whose step is mostly overhead (the tests' tiny model: a 0.14-0.18 ms
        # forward in a ~1 ms step) fitted w1 anywhere from -220 to 85 from the steps' noise, and the
        # guard, judging drafted steps in the model's units as they drifted, switched always-accepted
        # drafts off.
        self._noise2 = noise * noise  # the steps' squared prediction error, decayed; the probe's at first
        self._err2 = 0.0
        self.observations = 0

    SCALE_SPREAD = 0.5  # the probes' scales are trusted to within half (the prior's spread on w1 and w3)

    def _attention(self, attended: int, hot: int) -> float:
        return self.context * (attended - hot) + self.attention * hot

    def predict(self, shape: StepShape) -> float:
        # Every step asks (plain ones too): plain floats, not numpy's small-array calls (~10 us).
        return self.predict_parts(shape.tokens, shape.drafted, shape.attended, shape.hot)

    def predict_parts(self, tokens: int, drafted: int, attended: int, hot: int) -> float:
        """`predict` of the StepShape with these fields, without making one."""
        w0, w1, w2, w3 = self._clamped
        return max(w0 + w1 * self.profile(tokens) + w3 * self._attention(attended, hot) + w2 * drafted, 1e-6)

    @property
    def _clamped(self) -> tuple[float, float, float, float]:
        w0, w1, w2, w3 = self.w
        return w0, max(w1, 0.0), max(w2, 0.0), max(w3, 0.0)  # more tokens, trees or context never make a step faster

    def fixed_share(self, shape: StepShape, rows: int) -> float:
        """The share of a plain step of `rows` decoding requests (`shape`) that one request fewer
        would not save: predicted time less `rows` times the time one average request adds (its
        row and the context it reads), over the predicted time, within [0, 1]."""
        if rows < 2:
            return 1.0
        total = self.predict(shape)
        fewer = StepShape(shape.tokens - 1, 0, shape.attended * (rows - 1) // rows)
        per_row = total - self.predict(fewer)
        return min(max((total - rows * per_row) / total, 0.0), 1.0)

    def per_tree(self) -> float:
        """Seconds a request adds by carrying a draft tree at all (masks, verification)."""
        return max(self.w[2], 0.0)

    def per_attended(self) -> float:
        """Seconds one draft node adds per token of context it attends to (hot: its request's root
        has read that context this step)."""
        return max(self.w[3], 0.0) * self.attention

    def observe(self, shape: StepShape, seconds: float) -> None:
        x = (1.0, self.profile(shape.tokens), float(shape.drafted), self._attention(shape.attended, shape.hot))
        lam, w = self.forgetting, self.w
        px = _times(self.P, x)
        denom = lam + (x[0] * px[0] + x[1] * px[1] + x[2] * px[2] + x[3] * px[3])
        gain = (px[0] / denom, px[1] / denom, px[2] / denom, px[3] / denom)
        err = seconds - (x[0] * w[0] + x[1] * w[1] + x[2] * w[2] + x[3] * w[3])
        self._err2 = err * err if not self.observations else lam * self._err2 + (1.0 - lam) * err * err
        self.w = [w[0] + gain[0] * err, w[1] + gain[1] * err, w[2] + gain[2] * err, w[3] + gain[3] * err]
        self.P = _downdate(self.P, gain, px, 1.0 / lam)
        self._anchor(1)
        if x[3]:  # a model without the attention's probe (no context term) has nothing to anchor there
            self._anchor(3)
        # Forgetting inflates P along directions the steps never vary (no drafts for a while);
        # keep it within the prior's size so one odd step cannot swing the model.
        P = self.P
        ratio = (P[0] + P[4] + P[7] + P[9]) / self._p0_trace
        if ratio > 1.0:
            self.P = tuple(v / ratio for v in P)  # type: ignore[assignment]
        self.observations += 1

    def _anchor(self, k: int) -> None:
        """A pseudo-observation w_k = 1 (a probe's scale) worth what forgetting took of the prior
        this step. A step's observation enters P's inverse as x x^T, as if its noise were the
        probe's; the anchor enters it as (1 - forgetting) x noise^2 / SCALE_SPREAD^2 with the steps'
        measured noise, so that it weighs against them as the prior truly does."""
        P, w = self.P, self.w
        i0, i1, i2, i3 = _ROW[k]
        pk = (P[i0], P[i1], P[i2], P[i3])
        noise2 = max(self._err2, self._noise2)
        denom = self.SCALE_SPREAD ** 2 / (noise2 * (1.0 - self.forgetting)) + P[_DIAGONAL[k]]
        gain = (pk[0] / denom, pk[1] / denom, pk[2] / denom, pk[3] / denom)
        err = 1.0 - w[k]
        self.w = [w[0] + gain[0] * err, w[1] + gain[1] * err, w[2] + gain[2] * err, w[3] + gain[3] * err]
        self.P = _downdate(P, gain, pk, 1.0)


@dataclass(frozen=True)
class Candidate:
    """One decoding request's draft nodes, in an order where parents come first and values fall:
    values[j] = the chance node j is accepted; fixed_cost = seconds the request adds by drafting
    at all (verifying a tree, proposing), beyond its tokens."""

    values: tuple[float, ...]
    fixed_cost: float = 0.0
    node_cost: float = 0.0  # seconds each node adds beyond its forward token (a draft model's forward)
    context: int = 0  # tokens each node attends to (its request's context): its attention's cost
    behind: bool = False  # its request is behind plain decoding's pace so far: the pace bound protects it


class Controller(Protocol):
    """Chooses draft nodes across a step's batch, and learns from the step's measured time."""

    def select(self, base: StepShape, sampling_rows: int, candidates: list[Candidate],
               behind_plain: bool = False) -> "Selection": ...
    def predict(self, shape: StepShape) -> float | None: ...
    def fixed_share(self, shape: StepShape, rows: int) -> float | None: ...
    def learn(self, shape: StepShape, seconds: float) -> None: ...


@dataclass(frozen=True)
class Selection:
    counts: tuple[int, ...]  # nodes kept per candidate (a prefix of its values)
    expected_tokens: float  # the step's expected emitted tokens
    seconds: float  # its predicted time
    expected_accepted: float  # of which accepted draft nodes


class GoodputController:
    """Keeps, across the batch, the draft nodes that raise expected tokens per second.

    A node less likely than `min_value` to be accepted is never kept, whatever the cost model
    says: where the forward's measured cost is flat over a range of token counts (a small model's
    forward is its overhead; a noisy probe can time 8 tokens as long as 16), extra rows look free
    and every node with any chance at all would be verified, rows spent on drafts that are almost
    always rejected. At 5% such a node would add at most 0.05 expected tokens."""

    def __init__(self, cost: StepCostModel, max_iterations: int = 8, latency_slo: float | None = None,
                 min_value: float = 0.05, latency_slack: float | None = None,
                 pace_slack: float | None = None) -> None:
        if latency_slo is not None and latency_slo <= 0:
            raise ValueError(f"spec_latency_slo: must be > 0 seconds per token, got {latency_slo}")
        if latency_slack is not None and latency_slack < 0:
            raise ValueError(f"spec_latency_slack: must be >= 0, got {latency_slack}")
        self.latency_slack = latency_slack
        if pace_slack is not None and pace_slack < 0:
            raise ValueError(f"spec_pace_slack: must be >= 0, got {pace_slack}")
        self.pace_slack = pace_slack
        if not 0.0 <= min_value < 1.0:
            raise ValueError(f"controller min_value: must be in [0, 1), got {min_value}")
        self.min_value = min_value
        self.cost = cost
        self.max_iterations = max_iterations
        self.latency_slo = latency_slo

    def select(self, base: StepShape, sampling_rows: int, candidates: list[Candidate],
               behind_plain: bool = False) -> Selection:
        """base: the step without drafts; sampling_rows: requests that emit a token this step;
        behind_plain: a request behind plain decoding's pace emits a token this step without
        being a candidate (the pace bound then keeps the step within a plain one)."""
        best = self.evaluate(base, sampling_rows, candidates, [0] * len(candidates))
        per_tree = self.cost.per_tree()
        per_attended = self.cost.per_attended()
        base_seconds = self.cost.predict(base)
        for _ in range(self.max_iterations):
            g = best.expected_tokens / best.seconds
            # The forward's cost per draft token: a secant over the nodes selected so far (at least one).
            span = max(sum(best.counts), 1)
            wider = StepShape(base.tokens + span, base.drafted, base.attended, base.hot)
            per_token = (self.cost.predict(wider) - base_seconds) / span
            counts = []
            for c in candidates:
                gain, k = 0.0, 0
                cost = per_token + c.node_cost + per_attended * c.context
                for j, v in enumerate(c.values):
                    if v <= g * cost or v < self.min_value:
                        break
                    gain += v - g * cost
                    k = j + 1
                counts.append(k if gain > g * (per_tree + c.fixed_cost) else 0)
            if tuple(counts) == best.counts:
                break
            trial = self.evaluate(base, sampling_rows, candidates, counts)
            if trial.expected_tokens / trial.seconds <= g:
                break
            best = trial
        best = self._by_threshold(base, sampling_rows, candidates, best)
        if self.latency_slo is not None or self.latency_slack is not None:
            # every request protected: those outside the candidates get one token for the step
            bound = max(self.latency_slo or 0.0, base_seconds * (1.0 + (self.latency_slack or 0.0)))
            best = self._within(base, sampling_rows, candidates, best, bound, range(len(candidates)),
                                len(candidates) < sampling_rows)
        if self.pace_slack is not None and (behind_plain or any(c.behind for c in candidates)):
            # only the requests behind plain decoding's pace: the others keep their drafts
            best = self._within(base, sampling_rows, candidates, best, base_seconds * (1.0 + self.pace_slack),
                                [i for i, c in enumerate(candidates) if c.behind], behind_plain)
        return best

    def _by_threshold(self, base: StepShape, rows: int, candidates: list[Candidate], best: Selection) -> Selection:
        """`best`, or the first n of all candidates' nodes taken in falling order of value (each
        request's own nodes in their order) where some n gives more expected tokens per second.
        The loop above prices a node at the secant of the forward's cost over the nodes selected,
        exact where the cost is linear; a CPU's forward rises in steps (on the bundled model at
        batch 1, 1 to 5 rows cost about the same and the 6th adds 35%), and there the secant kept
        eight nodes where four gave more per second (on 43% of random chains, up to 20% less).
        One cost prediction a node, until the nodes left could not pay even at this step's time."""
        order = []
        left = 0.0  # the expected accepted nodes of them all
        for i, c in enumerate(candidates):
            floor = 1.0
            for j, v in enumerate(c.values):
                if v < self.min_value:
                    break
                floor = min(floor, v)  # a prefix's order even where a value rises after its parent's
                order.append((-floor, i, j))
                left += v
        if not order:
            return best
        order.sort()
        predict = self.cost.predict_parts
        tokens, drafted, attended, hot = base.tokens, base.drafted, base.attended, base.hot
        accepted, drafting = 0.0, 0.0
        top, found = best.expected_tokens / best.seconds, None
        for n, (_, i, j) in enumerate(order, start=1):
            c = candidates[i]
            if j == 0:
                drafted += 1
                drafting += c.fixed_cost
            tokens += 1
            attended += c.context
            hot += c.context
            accepted += c.values[j]
            drafting += c.node_cost
            seconds = predict(tokens, drafted, attended, hot) + drafting
            if (rows + accepted) / seconds > top * (1.0 + 1e-12):
                top, found = (rows + accepted) / seconds, (n, accepted, seconds)
            elif (rows + left) / seconds <= top:
                break  # more nodes only take longer: none past here can do better
        if found is None:
            return best
        n, accepted, seconds = found
        counts = [0] * len(candidates)
        for _, i, _ in order[:n]:
            counts[i] += 1
        return Selection(tuple(counts), rows + accepted, seconds, accepted)

    def _within(self, base: StepShape, rows: int, candidates: list[Candidate], sel: Selection, bound: float,
                protected: Sequence[int], outside: bool) -> Selection:
        """`sel` with nodes taken back (each time the last node of the request whose last node is
        worth least) until the slowest protected request expects its tokens within `bound` seconds
        each: the step's seconds over 1 + its expected accepted nodes, one token for a protected
        request drafting nothing (`outside`: one that is no candidate at all)."""
        counts = list(sel.counts)
        while sum(counts):
            if outside or any(counts[i] == 0 for i in protected):
                least = 1.0
            else:
                least = min((1.0 + sum(candidates[i].values[:counts[i]]) for i in protected), default=math.inf)
            if sel.seconds / least <= bound:
                break
            drafting = [i for i, k in enumerate(counts) if k]
            i = min(drafting, key=lambda i: candidates[i].values[counts[i] - 1])
            counts[i] -= 1
            sel = self.evaluate(base, rows, candidates, counts)
        return sel

    def predict(self, shape: StepShape) -> float:
        """The step's seconds (drafting excluded), as the cost model expects them."""
        return self.cost.predict(shape)

    def fixed_share(self, shape: StepShape, rows: int) -> float:
        """Of a plain step of `rows` decoding requests, the share that does not shrink with one
        request fewer (`StepCostModel.fixed_share`)."""
        return self.cost.fixed_share(shape, rows)

    def learn(self, shape: StepShape, seconds: float) -> None:
        """A step of `shape` took `seconds` (drafting excluded)."""
        self.cost.observe(shape, seconds)

    def evaluate(self, base: StepShape, rows: int, candidates: list[Candidate], counts: list[int]) -> Selection:
        """Expected tokens and predicted seconds of the step with `counts` nodes kept per candidate."""
        accepted = sum(sum(c.values[:k]) for c, k in zip(candidates, counts))
        drafted = sum(1 for k in counts if k)
        attended = sum(k * c.context for c, k in zip(candidates, counts))
        shape = StepShape(base.tokens + sum(counts), base.drafted + drafted, base.attended + attended, base.hot + attended)
        drafting = sum(c.fixed_cost + k * c.node_cost for c, k in zip(candidates, counts) if k)
        seconds = self.cost.predict(shape) + drafting
        return Selection(tuple(counts), rows + accepted, seconds, accepted)


class FixedController:
    """No selection: every request keeps all the nodes it was granted (the `--spec-controller
    fixed` baseline, and the reference the goodput controller is measured against)."""

    def select(self, base: StepShape, sampling_rows: int, candidates: list[Candidate],
               behind_plain: bool = False) -> Selection:
        counts = tuple(len(c.values) for c in candidates)
        accepted = sum(sum(c.values) for c in candidates)
        return Selection(counts, sampling_rows + accepted, math.nan, accepted)

    def predict(self, shape: StepShape) -> float | None:
        return None  # no cost model

    def fixed_share(self, shape: StepShape, rows: int) -> float | None:
        return None

    def learn(self, shape: StepShape, seconds: float) -> None:
        pass
