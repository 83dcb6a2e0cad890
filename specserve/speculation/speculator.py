"""The one object between the engine and speculation.

Each step the engine calls, in order:

    propose(decodes, base, sampling_rows, waiting) -> draft trees for some decodes
    verify(items, drafts, logits)         -> a verdict per sampling item (plain rows too)
    features(committed)                   -> (if wants_hidden) hidden states of committed tokens
    observe(seconds)                      -> the step's outcome and its measured time
and finish(request_id, view) when a request leaves.

`propose` asks the controller twice. Before drafting, from each request's measured acceptance
(and, with several drafters, for the drafter that pays best for it), how many nodes are worth
drafting at all, since drafting costs time of its own; after drafting, from the trees actually
proposed, which nodes are worth verifying. A request with a structured-output grammar has its
trees pruned of what the grammar forbids before the second question, and the text its grammar
forces next appended as draft nodes after it (`speculation.grammar`). Drafting is optional: a
drafter that fails costs its drafts, never a request; after MAX_FAILURES drafter failures in a
row speculation is switched off.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from specserve.speculation.controller import AcceptanceModel, Calibration, Candidate, Controller, StepShape
from specserve.speculation.drafter import Drafter, DraftRequest, Observation, RequestView
from specserve.speculation.grammar import extend_forced, prune
from specserve.speculation.guard import GoodputGuard, Mode
from specserve.speculation.sampler import Sampler, SamplingRow, argmax_only, greedy_choice, row_topk_ids
from specserve.speculation.tree import EMPTY_TREE, DraftTree, replay
from specserve.speculation.verifier import Verdict, Verifier, failed
from specserve.structured import TokenGrammar

logger = logging.getLogger("specserve.speculation")


@dataclass(frozen=True)
class Decode:
    """A decoding request that may draft this step: its place in the batch, and what its drafter
    may read (`request.budget` is the most nodes the scheduler reserved room for)."""

    index: int
    request: DraftRequest
    grammar: TokenGrammar | None = None  # the request's structured-output position, if it has one


@dataclass(frozen=True)
class SampleItem:
    """A batch item that emits tokens this step: its place, the request, its logits rows."""

    index: int
    row: SamplingRow
    rows: tuple[int, int]  # (first row, count): 1 for a plain step, 1 + len(tree) with a draft


@dataclass(frozen=True)
class SpeculationStats:
    """Totals since start, for /metrics and benchmarks."""

    steps: int = 0
    grants: tuple[tuple[int, int], ...] = ()  # (draft nodes a decoding request was given, how often)
    predicted_accepted: float = 0.0  # what the acceptance model expected of the verified nodes
    accepted: int = 0  # what verification accepted of them
    cost_predicted_seconds: float = 0.0  # the cost model's step times, where it predicted one
    cost_actual_seconds: float = 0.0  # the same steps, measured
    cost_abs_error_seconds: float = 0.0
    cost_steps: int = 0
    drafted_with: tuple[tuple[str, int], ...] = ()  # (drafter, request-steps verified with its tree)
    forced_drafted: int = 0  # draft nodes a grammar forced (structured outputs)
    forced_accepted: int = 0
    guard_plain_steps: int = 0  # decode steps the goodput guard kept plain (drafts lost there, or a control)
    guard_probes: int = 0  # steps it drafted on to see whether drafts pay again
    guard_turned_off: int = 0  # times a drafter was switched off at a batch shape because its drafts delivered less

    @property
    def cost_relative_error(self) -> float:
        """Mean |predicted - measured| / measured step time."""
        return self.cost_abs_error_seconds / self.cost_actual_seconds if self.cost_actual_seconds else 0.0


@dataclass(slots=True)
class _Drafted:
    name: str
    view: RequestView
    tree: DraftTree  # what is verified
    predicted: float  # expected accepted nodes


@dataclass(eq=False, slots=True)
class _Offer:
    """A decode on its way through propose: the drafter chosen for it, the nodes granted, the tree
    proposed (pruned by its grammar, then extended by what the grammar forces next)."""

    decode: Decode
    name: str  # the drafter: chosen before drafting, then the one whose tree was kept
    grant: int = 0
    min_value: float = 0.0  # a model drafter's chain ends below this confidence (DraftRequest.min_value)
    model_net: float = 0.0  # a model drafter's expected accepted nodes less their cost, in tokens
    tree: DraftTree = EMPTY_TREE
    forced_from: int | None = None  # the first grammar-forced node of `tree`, if any
    rank: int | None = None  # when its drafter's tree came back (the controller is asked in that order)
    others: list[tuple[str, DraftTree]] = field(default_factory=list)  # the other drafters' trees (auto)

    @property
    def request(self) -> DraftRequest:
        return self.decode.request

    @property
    def rid(self) -> str:
        return self.decode.request.view.request_id

    @property
    def first_forced(self) -> int:
        return len(self.tree) if self.forced_from is None else self.forced_from

    def constrain(self) -> None:
        """Without the nodes the request's grammar forbids; then, within the room the scheduler
        reserved, extended after its main path by what the grammar forces next. A forced node is
        the grammar's spelling of text the output must contain: verified like any draft (the model
        may spell the text otherwise), valued at the measured rate forced nodes are accepted."""
        grammar = self.decode.grammar
        if grammar is None:
            return
        self.tree = prune(self.tree, grammar)
        if not len(self.tree):
            self.rank = None  # nothing of its drafter's left: a grammar-only tree, asked after those
        extended, count = extend_forced(self.tree, grammar, self.request.budget)
        if count:
            self.forced_from = len(self.tree)
            self.tree = extended


@dataclass(eq=False, slots=True)
class _Row:
    """What speculation knows of one batch item this step."""

    view: RequestView | None = None  # a decode offered to the drafters
    drafted: _Drafted | None = None  # the drafter's share of the tree verified for it
    others: list[tuple[str, DraftTree]] = field(default_factory=list)  # trees proposed but not verified
    forced: tuple[int, int, int] | None = None  # grammar-forced nodes verified: (first, how many, its parent)
    verdict: Verdict | None = None
    plain_id: str | None = None  # decoded without a draft: its request id
    plain_view: RequestView | None = None  # no drafter's tree: what the learning drafters are told
    top_ids: torch.Tensor | None = None  # the target's top tokens at its rows, for learning drafters

    @property
    def ok(self) -> bool:
        return self.verdict is not None and self.verdict.error is None


@dataclass(slots=True)
class _Pace:
    """A request's steps so far against plain decoding's: their measured seconds, the plain step
    time predicted for each, how many, and the tokens they emitted; and its tokens a step while
    drafting is on (`drafting_rate`)."""

    seconds: float = 0.0
    plain_seconds: float = 0.0
    steps: int = 0
    tokens: int = 0
    rate_sum: float = 0.0  # tokens of the steps with drafting on, each weighed RATE_DECAY ** its age
    rate_weight: float = 0.0
    rate_step: int = 0  # the step number of the latest

    # Per step of age, also of steps without drafting: a probe of the guard's, many steps after
    # the last, is judged by what drafting gives the request now.
    RATE_DECAY = 0.9

    def drafting_step(self, step_no: int, tokens: int) -> None:
        fade = self.RATE_DECAY ** (step_no - self.rate_step)
        self.rate_sum = self.rate_sum * fade + tokens
        self.rate_weight = self.rate_weight * fade + 1.0
        self.rate_step = step_no

    @property
    def drafting_rate(self) -> float:
        """Its tokens a step while drafting is on, recent steps weighing most."""
        return self.rate_sum / self.rate_weight if self.rate_weight else 1.0

    @property
    def behind(self) -> bool:
        """Its seconds per token above the plain seconds per step (after two steps: one slow step
        that also carries its prefill's end says little)."""
        return self.steps >= 2 and self.seconds * self.steps > self.plain_seconds * self.tokens


@dataclass(slots=True)
class _Step:
    """The speculator's record of a step: a row per batch item it saw, by the item's batch index
    (the engine's index space), and the step's totals."""

    rows: dict[int, _Row] = field(default_factory=dict)
    asked: list[tuple[str, str, bool]] = field(default_factory=list)  # (drafter, request, proposed anything)
    grants: list[int] = field(default_factory=list)
    shape: StepShape | None = None
    predicted_seconds: float | None = None
    plain_seconds: float | None = None  # the step's predicted time without drafts (the pace's yardstick)
    token_seconds: float | None = None  # a decoding request's token at the plain rate: drafts' costs are valued in it
    propose_seconds: float = 0.0
    catch_up_seconds: float = 0.0  # of propose_seconds, a model drafter's catching up (Drafter.catch_up_seconds)
    learners: frozenset[str] = frozenset()  # drafters that learn from the target's rows this step
    guard: tuple[tuple[int, int], dict[str, Mode]] | None = None  # on decode-only steps: the shape, the guard's say per drafter
    probing: frozenset[str] = frozenset()  # the drafters the guard probes this step (asked first)
    fixed_share: float | None = None  # none waiting, several decoding: the plain step's share not per request
    finished: list[tuple[str, RequestView]] = field(default_factory=list)  # left during the step

    def row(self, index: int) -> _Row:
        return self.rows.setdefault(index, _Row())


class Speculator:
    # After this many drafter failures in a row, speculation is switched off for good.
    MAX_FAILURES = 20
    # A drafter that learns from the target (top-k of its logits at every row: a cost on every step)
    # and has not drafted for a while learns from every LEARN_EVERY-th step only.
    LEARN_EVERY = 4
    # At shapes of at least this many requests decoding (none waiting), the guard values a step with
    # drafting on as if every request got the tokens of the request drafting speeds least
    # (`_valued_tokens`): drafts are kept only where they slow nobody. Valued by throughput there, 24
    # ShareGPT requests at once on the bundled model got 1.10x `none`'s tokens a second but a p99
    # TPOT 1.25x `none`'s (two rounds each; the pace bound at slack 0 still 1.13x; BENCHMARKS.md,
    # session 37): the requests drafts did not help paid for the others' verified rows.
    LATENCY_ROWS = 16

    def __init__(
        self,
        drafters: dict[str, Drafter],
        sampler: Sampler,
        verifier: Verifier,
        max_tokens: int,
        controller: Controller,
        acceptance: AcceptanceModel | None = None,
        explore_every: int = 16,
        guard: GoodputGuard | None = None,
    ) -> None:
        self.drafters = dict(drafters)
        self.sampler = sampler
        self.verifier = verifier
        self.max_tokens = max_tokens
        self.controller = controller
        self.acceptance = acceptance or AcceptanceModel()
        self.explore_every = explore_every
        self.guard = guard  # None: the controller's word is final (fixed grants, tests)
        self._propose_cost: dict[str, float] = {}  # seconds per request (lookups) or per depth (models)
        self._since_draft: dict[str, int] = {}  # request -> steps since its last verified draft
        self._pace: dict[str, _Pace] = {}
        self._step = _Step()
        self._open = False  # between propose and observe
        self._active: dict[str, Drafter] = {}
        self._failures = 0
        self._sums: Counter[str] = Counter()  # SpeculationStats' running sums by field (grants and drafters kept apart)
        self._grants: Counter[int] = Counter()
        self._drafted_with: Counter[str] = Counter()
        self._step_no = 0
        self._used_at: dict[str, int] = {}  # drafter -> the last step that verified one of its trees
        self._forced = (9.0, 10.0)  # grammar-forced nodes accepted, tried (decayed; a prior of 9 in 10)
        self._calibration = Calibration()  # each drafter's values discounted by how its verified trees fared
        self._quiet = False  # the next step is sure to be plain (`cap`): no drafts to make room for

    @property
    def enabled(self) -> bool:
        return bool(self.drafters) and self.max_tokens > 0

    def cap(self, tokens_left: int) -> int:
        """The most draft nodes a decoding request with `tokens_left` to generate may be given:
        the bonus token comes on top of the drafts, so at most tokens_left - 1."""
        if not self.enabled or self._quiet:
            return 0
        return max(0, min(self.max_tokens, tokens_left - 1))

    # -- propose -------------------------------------------------------------------------------
    def propose(self, decodes: list[Decode], base: StepShape, sampling_rows: int,
                waiting: int = 0) -> dict[int, DraftTree]:
        """Draft trees for the decodes worth drafting for, keyed by batch index. `base` is the
        step's shape without drafts; `sampling_rows` the items that emit a token; `waiting` the
        requests waiting for room in the batch (the guard values a step's tokens by it)."""
        self._step = _Step(shape=base, rows={d.index: _Row(view=d.request.view) for d in decodes})
        self._open = True
        if self.enabled and (decodes or self._quiet):  # quiet: no decodes offered, but the step is measured as any
            self._step.plain_seconds = self.controller.predict(base)
            self._step.token_seconds = self._token_seconds(decodes, base, sampling_rows) if decodes else None
        self._active = dict(self.drafters)  # a switch-off mid-step takes effect next step
        if self.enabled and self.guard is not None:
            if base.tokens == sampling_rows:  # decode-only
                self._ask_guard(decodes, base, sampling_rows)
            elif decodes:  # a prefill chunk too: not judged, but what is off at the decodes' shape stays off
                # The shape of the decode-only steps to come: every request emitting a token (those
                # offered drafts are the ones the token budget left draft slots for: with 20
                # decoding while prompts were admitted, 2 were offered and read the 2-request
                # bucket), at the offered ones' mean context.
                context = sum(d.request.num_computed + 1 for d in decodes) // len(decodes)
                shape = self.guard.key(sampling_rows, context * sampling_rows)
                off = self.guard.off(shape, list(self._active))
                self._active = {n: d for n, d in self._active.items() if n not in off}
        decodes = [d for d in decodes if d.request.budget > 0]
        if not self.enabled or not decodes or not self._active:  # the guard keeps every drafter off
            self._step.grants = [0] * len(decodes)
            return {}
        if not waiting and len(self._step.rows) >= 2:  # read only where the step drafts (`_valued_tokens`)
            self._step.fixed_share = self.controller.fixed_share(base, sampling_rows)
        try:
            offers = [_Offer(d, self._choose(d.request, base, sampling_rows)) for d in decodes]
            self._grant(offers, base, sampling_rows)
            self._run_drafters(offers, base, sampling_rows)
            for o in offers:
                o.constrain()
            return self._select(offers, base, sampling_rows)
        except Exception:  # noqa: BLE001 - drafts are optional: this step decodes plainly
            logger.exception("speculation failed while proposing; the step decodes plainly")
            self._step = _Step(shape=base, rows={i: _Row(view=r.view) for i, r in self._step.rows.items()})
            return {}

    def _token_seconds(self, decodes: list[Decode], base: StepShape, sampling_rows: int) -> float | None:
        """What a decoding request's token costs at the plain rate, the yardstick a draft's costs
        (a model's forwards and catching up, verified rows) are weighed in: a decode-only step's
        predicted time over its rows; with a prompt chunk in the step, a decode-only step's for
        these decodes over their number. An accepted token saves a row of a later decode step, not
        a share of this step's chunk: valued at the mixed step's time a token looked worth 50 ms
        where it saves 8, and on ShareGPT at batch 8 on the 1.5B the 0.5B caught up and drafted
        in the steps with a prompt chunk (1.3-3.9 s of catching up a run, for a few hundred
        tokens; BENCHMARKS.md, session 28)."""
        plain = self._step.plain_seconds
        if plain is None:
            return None
        if base.tokens == sampling_rows:
            return plain / max(sampling_rows, 1)
        decode = self.controller.predict(StepShape(len(decodes), 0, sum(d.request.num_computed + 1 for d in decodes)))
        return None if decode is None else decode / len(decodes)

    def _ask_guard(self, decodes: list[Decode], base: StepShape, sampling_rows: int) -> None:
        """The guard's say on each drafter at this step's shape: the step drafts with the drafters
        it has not switched off and those whose probe is due, or decodes plainly if none (so under
        `auto` a drafter whose drafts lose here stops being asked, while one that pays goes on). A
        probing drafter is asked first and its tree is verified wherever it proposes one (at least
        a node), unless a tree of a drafter that is on is worth PROBE_DISPLACES tokens more; where
        it proposes nothing, the drafters that are on draft as on any step."""
        assert self.guard is not None
        shape = self.guard.key(sampling_rows, base.attended)
        requests = frozenset(d.request.view.request_id for d in decodes)
        modes = self.guard.modes(shape, list(self._active), self._step_no, requests)
        self._step.guard = (shape, modes)
        self._active = {n: self._active[n] for n, m in modes.items() if m is not Mode.PLAIN}
        self._step.probing = frozenset(n for n, m in modes.items() if m is Mode.PROBE)

    def _choose(self, request: DraftRequest, base: StepShape, rows: int) -> str:
        """The drafter expected to give this request the most accepted tokens net of what its nodes
        cost: a model drafter's, its forwards and rows (`_model_worth`); a lookup's (its own time is
        microseconds), its rows in the verifying forward. Counted gross, a lookup's long chain of
        unlikely nodes (eight at 0.15-0.25 each, 1.4 tokens) beat the 0.5B's chain worth 0.75 net
        (0.8, 0.6, 0.5, 0.4 at 0.4 a node) on the 1.5B's Spec-Bench at batch 1, and then proposed
        nothing on most of those steps (humanities: 64 plain steps of 108). Only at batch 1, where it
        was measured: at batch 8 (ShareGPT, the same models, where the model's drafts lose to plain
        decoding) one run gave 0.84x `none` counted net and 0.97x gross, within that workload's
        spread between runs (0.84-0.98x; BENCHMARKS.md, session 27)."""
        if len(self._active) == 1:
            return next(iter(self._active))
        rid = request.view.request_id
        probing = self._step.probing
        node = self._node_cost(base, request.num_computed + 1) if rows <= 1 else 0.0

        def worth(name: str) -> float:
            if self._active[name].runs_a_model:
                return self._model_worth(name, request, base, rows)
            return self._worth(name, rid, request.budget, node)

        return max(self._active, key=lambda name: (name in probing, worth(name)))

    def _model_worth(self, name: str, request: DraftRequest, base: StepShape, rows: int) -> float:
        """A model drafter's expected accepted nodes for the request less what they cost, in tokens
        at the plain step's rate (each depth's forward, here all of it charged to this request, and
        its row in the verifying forward). Counted gross, the draft model was `auto`'s choice for
        every request at batch 8, where its forward costs more than a node is worth, and each of
        them then drafted with the lookups on a full grant (ShareGPT, 8 in flight: 0.83x `none`)."""
        rid = request.view.request_id
        gross = [self.acceptance.proposes(name, rid) * self._calibration.factor(name) * v
                 for v in self.acceptance.chain_values(name, rid, request.budget)]
        if not self._step.token_seconds:
            return sum(gross)
        per_node = self._model_node_cost(self._propose_cost.get(name, 0.0), base, request.num_computed + 1)
        return sum(max(0.0, v - per_node) for v in gross)

    def _model_node_cost(self, depth_seconds: float, base: StepShape, context: int) -> float:
        """What a model drafter's node costs, in tokens at the plain rate (`token_seconds`): its
        depth's forward (`depth_seconds`) and its row in the verifying forward (`_node_cost`)."""
        token = self._step.token_seconds
        return depth_seconds / token + self._node_cost(base, context) if token else 0.0

    def _worth(self, name: str, request_id: str, nodes: int, cost: float = 0.0) -> float:
        """Expected accepted tokens of `name` drafting `nodes` for the request: the chance it
        proposes anything times its chain's expected accepted nodes, by measured acceptance, each
        net of `cost` (a node's, in tokens: the chain ends where a node is worth less)."""
        a = self.acceptance
        f = self._calibration.factor(name)
        chain = sum(max(0.0, f * v - cost) for v in a.chain_values(name, request_id, nodes))
        return a.proposes(name, request_id) * chain

    def _grant(self, offers: list[_Offer], base: StepShape, rows: int) -> None:
        """Nodes each request may draft: what its expected acceptance pays for, counting the
        drafter's own time; now and then one node for a request given none, to keep measuring."""
        a = self.acceptance
        asking_all = sum(self._propose_cost.get(n, 0.0) for n in self._lookups())  # see _run_drafters
        candidates = []
        for o in offers:
            chance = a.proposes(o.name, o.rid) * self._calibration.factor(o.name)
            values = tuple(chance * v for v in a.chain_values(o.name, o.rid, o.request.budget))
            cost = asking_all if self._asks_all(o.name) else self._propose_cost.get(o.name, 0.0)
            context = o.request.num_computed + 1
            behind = self._behind(o.rid)
            if self._active[o.name].runs_a_model:
                candidates.append(Candidate(values, node_cost=cost, context=context, behind=behind))
            else:
                candidates.append(Candidate(values, fixed_cost=cost, context=context, behind=behind))
        asked = {o.decode.index for o in offers}
        token = self._step.token_seconds
        for o, c, count in zip(offers, candidates,
                               self.controller.select(base, rows, candidates, self._behind_outside(asked)).counts):
            model = self._active[o.name].runs_a_model
            # a model's node: its depth's measured forward, charged to the request, and its row; at a
            # token or more no acceptance pays for it (at batch 8 on the 1.5B the 0.5B's cost that,
            # and drafting with it there lost to plain decoding; BENCHMARKS.md, session 22)
            per_node = self._model_node_cost(c.node_cost, base, c.context) if model else 0.0
            unpaid = model and (per_node >= 1.0 or self._catch_up_unpaid(o, c.values, per_node, rows))
            if unpaid:
                count = 0
            # A model drafter the guard probes is run whatever the estimates say (they are what a
            # probe checks): given none by them and sent to the lookups instead, its probes under
            # `auto` never ran it, and once off it stayed off (BENCHMARKS.md, session 22).
            # Only at batch 1: a probe of several requests runs the model, and catches it up, for each
            # of them; there the estimates decide, as for any step.
            probed = (model and not unpaid and rows <= 1 and o.name in self._step.probing
                      and self._active[o.name].stops_by_value)
            o.grant = count
            if (count or probed) and model and token and self._active[o.name].stops_by_value:
                # How far a model's chain pays is told best by the model itself as it drafts: its
                # confidence in the chain so far against what a node costs (its depth's forward,
                # its row in the verifying forward), in tokens at the plain step's rate. The
                # acceptance model cannot know it in advance: granted by depth, the 0.5B drafting for
                # the 1.5B got one node a step, its depth 2 never tried (BENCHMARKS.md, session 21).
                o.grant = o.request.budget
                o.min_value = per_node / self._calibration.factor(o.name)
                o.model_net = sum(max(0.0, v - per_node) for v in c.values)
            elif count == 0 and model and self._lookups():
                # The model's chain does not pay for the request now; the lookups (microseconds)
                # may still find text to copy, and the second selection judges what they propose.
                # (Not the model's one-node exploration, as without lookups: under `auto` at batch 4
                # those forwards and their catching up cost 15% of HumanEval's plain rate.)
                o.name = max(self._lookups(), key=lambda n: self._worth(n, o.rid, o.request.budget))
                o.grant = o.request.budget
            elif count == 0 and not unpaid and self._exploring(o.rid, o.name):
                # A lookup is cheap: ask it for everything and let the second selection judge the
                # tree. A model drafter explores with one node.
                o.grant = 1 if model else o.request.budget

    # A model drafter is not run for a request whose catching up (its prompt's window, or the tokens
    # since it last drafted for it) would cost more than both MAX_CATCH_UP_SHARE of the request's
    # remaining plain decoding and CATCH_UP_SHARE of what its drafts are expected to save over the
    # request's next CATCH_UP_HORIZON tokens beyond what the lookups' would (`_catch_up_unpaid`).
    # The first bound alone (session 22: on the 1.5B's Spec-Bench at batch 1 the 0.5B's catch-up on a
    # 256-token window took 6-8% of a long-prompt request's time, and the model then drafted on one
    # step of 70-90 while the lookups copied the rest) also held the model off where nothing else
    # drafted: with the guard keeping the lookups off, its ~0.3 s catch-up (7% of 128 tokens) kept it
    # off for the whole of the extraction, summarization and RAG prompts (~250 plain steps of ~700,
    # where its drafts gave 2.8 tokens a step elsewhere). The second alone keeps it off wherever its
    # estimates, its prior from other requests, say it does not pay, so it is never tried for the
    # request (nor probed) and the estimates never learn otherwise: a cheap catch-up stays allowed.
    MAX_CATCH_UP_SHARE = 0.05
    CATCH_UP_SHARE = 0.5
    CATCH_UP_HORIZON = 256

    def _catch_up_unpaid(self, o: _Offer, values: Sequence[float], per_node: float, rows: int) -> bool:
        """Whether running the offer's model drafter would first cost a catch-up above both
        MAX_CATCH_UP_SHARE of the request's remaining tokens at the plain step's time and
        CATCH_UP_SHARE of its drafts' expected saving: `values`, its chain's expected acceptance,
        each node costing `per_node` tokens at the plain step's rate, against the best lookup
        drafter's expected accepted tokens net of their rows, both as the share of a token's plain
        time they save, over the request's next CATCH_UP_HORIZON tokens (or fewer left). The
        catch-up holds up every one of the step's `rows` requests: it counts `rows` times, and at
        more than one the first bound alone decides (the second was measured at batch 1; at batch 8
        on ShareGPT, where drafting with the model loses, runs with it and without it gave
        0.84-0.87x `none` alike)."""
        token = self._step.token_seconds
        if not token:
            return False
        view = o.request.view
        cost = self._active[o.name].catch_up_cost(view) * max(rows, 1)
        remaining = view.params.max_tokens - len(view.output_token_ids)
        plain = token * max(rows, 1)  # a decode step's, of `rows` requests
        if cost <= self.MAX_CATCH_UP_SHARE * remaining * plain:
            return False
        if rows > 1:  # measured at batch 1 only: at more, the first bound alone (see the docstring)
            return True
        kept = [v for v in values if v > per_node]
        accepted = sum(kept)
        model = (accepted - per_node * len(kept)) / (1.0 + accepted)
        node = self._node_cost(self._step.shape, o.request.num_computed + 1)
        lookup = max((self._worth(n, o.rid, o.request.budget, node) for n in self._lookups()), default=0.0)
        saving = min(remaining, self.CATCH_UP_HORIZON) * plain * (model - lookup / (1.0 + lookup))
        return cost > self.CATCH_UP_SHARE * saving

    def _behind(self, request_id: str) -> bool:
        """Whether the request's tokens so far came slower than plain decoding's pace: its steps'
        seconds per token emitted above their predicted plain seconds per step."""
        pace = self._pace.get(request_id)
        return pace is not None and pace.behind

    def _behind_outside(self, indices: set[int]) -> bool:
        """Whether a decode of this step outside `indices` (no candidate of the selection) is behind."""
        return any(r.view is not None and i not in indices and self._behind(r.view.request_id)
                   for i, r in self._step.rows.items())

    # A node verified only to keep measuring a request (`_select`) is verified where it costs less than
    # this, in tokens at the plain rate. The CPU kernels take rows in passes of 8: at batch 8 on the
    # 1.5B the ninth row cost 20 ms, 1.6 tokens, and with every request exploring every 16th step
    # half the steps paid it for a node accepted two times in five (ShareGPT, `auto`; BENCHMARKS.md,
    # session 28). At batch 1 and 4 the node costs 0.0-0.2 tokens and exploring goes on as before.
    EXPLORE_MAX_COST = 0.5

    def _exploring(self, request_id: str, name: str) -> bool:
        """Whether this step drafts for the request although the estimates say it does not pay:
        a request given nothing is never measured again, so now and then it is (and every request
        on the guard's probe steps)."""
        if name in self._step.probing:
            return True
        every = self.explore_every if self._active[name].runs_a_model else max(1, self.explore_every // 4)
        return (self._since_draft.get(request_id, 0) + 1) % every == 0

    def _lookups(self) -> list[str]:
        return [n for n, d in self._active.items() if not d.runs_a_model]

    def _asks_all(self, name: str) -> bool:
        """Whether a request granted nodes by `name` is asked of every lookup drafter (`auto`)."""
        return not self._active[name].runs_a_model and len(self._lookups()) > 1

    def _run_drafters(self, offers: list[_Offer], base: StepShape, rows: int) -> None:
        """Each drafter proposes for the requests it was chosen for and granted nodes. With several
        lookup drafters (`auto`), a request granted nodes by a lookup is asked of every lookup (each
        costs tens of microseconds) and keeps the tree its drafters' measured acceptance values most
        net of what verifying its nodes costs (`_net_value`);
        the offer's drafter becomes the one whose tree is kept."""
        asked: dict[str, list[_Offer]] = {}
        for o in offers:
            if o.grant <= 0:
                continue
            if self._asks_all(o.name):
                names = self._worth_asking(o)
            elif self._active[o.name].runs_a_model and self._lookups():
                names = self._worth_asking(o) + [o.name]  # the lookups first: see `_copy_beats_model`
            else:
                names = [o.name]
            for n in names:
                asked.setdefault(n, []).append(o)
        trees: dict[int, list[tuple[str, DraftTree]]] = {}  # by id of the offer
        for name, group in sorted(asked.items(), key=lambda item: self._active[item[0]].runs_a_model):
            drafter = self._active[name]
            if drafter.runs_a_model:
                group = [o for o in group if not self._copy_beats_model(o, trees.get(id(o), []), base)]
                if not group:
                    continue
            requests = [replace(o.request, budget=o.grant, min_value=o.min_value) for o in group]
            start = time.perf_counter()
            try:
                proposed = drafter.propose(requests)
            except Exception:  # noqa: BLE001 - drafts are optional: these requests decode plainly
                self._failed("propose")
                for o in group:  # so that `auto` stops choosing a drafter that cannot propose
                    self._step.asked.append((name, o.rid, False))
                continue
            seconds = time.perf_counter() - start
            self._step.propose_seconds += seconds
            catch_up = min(drafter.catch_up_seconds, seconds)
            self._step.catch_up_seconds += catch_up
            self._failures = 0
            # a model drafter's time is per depth: its chains' longest (each may stop before its grant)
            units = max(max((len(t) for t in proposed), default=0), 1) if drafter.runs_a_model else len(group)
            old = self._propose_cost.get(name)
            per = (seconds - catch_up) / units
            self._propose_cost[name] = per if old is None else 0.8 * old + 0.2 * per
            for o, tree in zip(group, proposed):
                tree = tree.truncated(o.grant)
                self._step.asked.append((name, o.rid, len(tree) > 0))
                if len(tree) > 0:
                    trees.setdefault(id(o), []).append((name, tree))
        by_id = {id(o): o for o in offers}
        for rank, (key, options) in enumerate(trees.items()):
            o = by_id[key]
            cost = self._node_cost(base, o.request.num_computed + 1) if len(options) > 1 else 0.0
            nets = [self._net_value(name, o.rid, tree, cost) for name, tree in options]
            best = max(range(len(options)), key=lambda i: (self._probe_first(options, nets, i), nets[i]))
            o.name, o.tree = options[best]
            o.others = options[:best] + options[best + 1:]
            o.rank = rank

    # A probe's tree is verified before the others' (it is what the probe judges) unless a tree of a
    # drafter that is on is expected to give this many tokens more: then the probe waits for a step
    # where it costs less (at batch 1 on the 1.5B's Spec-Bench translation, one-node probes of ngram
    # and recycling took the place of suffix's long accepted chains; BENCHMARKS.md, session 22).
    PROBE_DISPLACES = 1.0

    def _probe_first(self, options: list[tuple[str, DraftTree]], nets: list[float], i: int) -> bool:
        """Whether option `i` is a probe's tree to verify ahead of the others (`nets`: their values)."""
        probing = self._step.probing
        if options[i][0] not in probing:
            return False
        on = [v for (name, _), v in zip(options, nets) if name not in probing]
        return not on or max(on) - nets[i] < self.PROBE_DISPLACES

    def _copy_beats_model(self, o: _Offer, options: list[tuple[str, DraftTree]], base: StepShape) -> bool:
        """Whether a lookup's tree for the request (`options`, proposed already) is worth at least
        what the model drafter's chain is expected to be, net of costs: then the model is not run for
        it. Under `auto` the model's chain is the likelier choice for most requests (its worth is
        counted before its cost), and run regardless it took the text suffix copies (Spec-Bench's
        extraction and translation) from the lookups. A model chain not expected to pay at all
        (`model_net` 0: exploring, or a fixed controller's) gives way to any lookup's tree."""
        if not options:
            return False
        cost = self._node_cost(base, o.request.num_computed + 1)
        if o.name in self._step.probing:  # a probe runs the model unless a lookup's tree would displace it
            return max(self._net_value(n, o.rid, t, cost) for n, t in options) >= self.PROBE_DISPLACES
        if o.model_net <= 0.0:
            return True
        return max(self._net_value(n, o.rid, t, cost) for n, t in options) >= o.model_net

    def _node_cost(self, base: StepShape, context: int, nodes: int = 0) -> float:
        """What verifying one more node (attending to `context`) adds to this step's predicted time
        (the step's without drafts, or with `nodes` kept already), in tokens at the plain rate
        (`token_seconds`); 0 where no cost model predicts (fixed grants)."""
        plain, token = self._step.plain_seconds, self._step.token_seconds
        if not plain or not token:
            return 0.0
        if nodes:
            plain = self.controller.predict(StepShape(base.tokens + nodes, base.drafted, base.attended, base.hot))
        more = self.controller.predict(StepShape(base.tokens + nodes + 1, base.drafted, base.attended + context,
                                                 base.hot + context))
        return 0.0 if more is None or plain is None else max(0.0, (more - plain) / token)

    def _net_value(self, name: str, request_id: str, tree: DraftTree, cost: float) -> float:
        """A tree's expected accepted nodes less what verifying them costs, counting only the nodes
        worth their cost (`cost`: a node's, in tokens; the second selection drops the rest). The
        trees of `auto`'s drafters are compared by it: by expected accepted nodes alone a long chain
        of unlikely nodes beat a short tree of likely ones and then cost its rows (on Spec-Bench at
        batch 1 on the bundled model `auto` verified 3.4 nodes a drafted step for 2.11 tokens where
        `suffix` alone verified 2.1 for 2.2; BENCHMARKS.md, session 18)."""
        f = self._calibration.factor(name)
        return sum(max(0.0, f * v - cost) for v in self.acceptance.node_values(name, request_id, tree))

    # A lookup drafter whose measured worth for a request is below this share of the best one's is
    # asked for it only on every ASK_ANYWAY-th step (so that its record can still recover).
    WORTH_SHARE = 0.2
    ASK_ANYWAY = 8

    def _worth_asking(self, o: _Offer) -> list[str]:
        """The lookup drafters to ask for the request (`auto`): those whose measured worth for it
        (the chance they propose, times their chain's expected accepted tokens, learnt also from
        the trees that lost, see `_learn`) is within WORTH_SHARE of the best; now and then all."""
        names = self._lookups()
        if self._step_no % self.ASK_ANYWAY == 0:
            return names
        worth = {n: self._worth(n, o.rid, o.grant) for n in names}
        top = max(worth.values())
        return [n for n in names if worth[n] >= self.WORTH_SHARE * top or n == o.name or n in self._step.probing]

    def _values(self, o: _Offer) -> list[float]:
        """The chance each node is accepted: the drafter's nodes by its measured acceptance
        (`Calibration`), forced nodes (from `forced_from` on: a chain off the main path's end) by
        the forced-node rate."""
        first = o.first_forced
        f = self._calibration.factor(o.name)
        v = [f * x for x in self.acceptance.node_values(o.name, o.rid, o.tree.truncated(first))] if first else []
        for n in range(first, len(o.tree)):
            parent = o.tree.parents[n]
            v.append((1.0 if parent < 0 else v[parent]) * self._forced_rate)
        return v

    @property
    def _forced_rate(self) -> float:
        hits, trials = self._forced
        return hits / trials

    def _select(self, offered: list[_Offer], base: StepShape, rows: int) -> dict[int, DraftTree]:
        """Of the proposed nodes (the drafters' and, from `first_forced` on, grammar-forced ones),
        the ones worth verifying (drafting time is spent by now)."""
        # Drafters' trees in the order they came back, then trees of grammar-forced nodes only, in
        # batch order: the controller's selection may depend on the order it is asked in.
        offers = sorted((o for o in offered if len(o.tree)), key=lambda o: (o.rank is None, o.rank or 0))
        values = [self._values(o) for o in offers]
        # Highest value first; a child never beats its parent, so parents stay first.
        orders = [sorted(range(len(o.tree)), key=lambda n, v=v: (-v[n], n)) for o, v in zip(offers, values)]
        sel = self.controller.select(base, rows, [
            Candidate(tuple(v[n] for n in order), context=o.request.num_computed + 1, behind=self._behind(o.rid))
            for o, v, order in zip(offers, values, orders)
        ], self._behind_outside({o.decode.index for o in offers}))
        drafts: dict[int, DraftTree] = {}
        kept_tokens = 0
        attended = 0
        step = self._step
        selected = sum(sel.counts)
        for o, v, order, k in zip(offers, values, orders, sel.counts):
            if k == 0 and (o.name in self._step.probing or ((self._since_draft.get(o.rid, 0) + 1) % self.explore_every == 0
                           and self._node_cost(base, o.request.num_computed + 1, selected) < self.EXPLORE_MAX_COST)):
                k = 1  # now and then one node is verified whatever the estimate, so it can recover
                selected += 1
            if k == 0:
                continue
            kept = order[:k]
            tree = o.tree.keep(kept)
            index = o.decode.index
            drafts[index] = tree
            kept_tokens += k
            attended += k * (o.request.num_computed + 1 + k)
            mine = sum(1 for n in kept if n < o.first_forced)  # kept in index order: the drafter's nodes come first
            if mine:  # what the acceptance model predicted of the drafter's nodes, before `Calibration`
                raw = sum(v[n] for n in kept if n < o.first_forced) / self._calibration.factor(o.name)
                step.row(index).drafted = _Drafted(o.name, o.request.view, tree.truncated(mine), raw)
                step.row(index).others = o.others
            if mine < k:
                step.row(index).forced = (mine, k - mine, tree.parents[mine])
        step.grants = [len(drafts.get(o.decode.index, EMPTY_TREE)) for o in offered]
        step.shape = StepShape(base.tokens + kept_tokens, base.drafted + len(drafts), base.attended + attended,
                               base.hot + attended)
        step.predicted_seconds = self.controller.predict(step.shape)
        return drafts

    # -- verify --------------------------------------------------------------------------------
    def verify(self, items: list[SampleItem], drafts: dict[int, DraftTree], logits: torch.Tensor) -> dict[int, Verdict]:
        """Per item, the tokens it emits: a plain draw, or its draft tree's verdict."""
        verdicts = self._argmax_verdicts(items, drafts, logits)
        plain = [it for it in items if it.index not in drafts and it.index not in verdicts]
        if plain:
            first = [it.rows[0] for it in plain]
            # rows in one run (a batch of decodes without drafts): a view; else a copy of those rows
            plain_logits = (logits[first[0] : first[0] + len(first)] if first == list(range(first[0], first[0] + len(first)))
                            else logits.index_select(0, torch.tensor(first, device=logits.device)))
            verdicts.update(zip((it.index for it in plain), self._sample(plain_logits, [it.row for it in plain])))
        for it in items:
            tree = drafts.get(it.index)
            if tree is None or it.index in verdicts:
                continue
            start, count = it.rows
            try:
                verdicts[it.index] = self.verifier.verify(it.row, tree, logits[start : start + count])
            except Exception as e:  # noqa: BLE001 - this request's failure, not the batch's
                logger.exception("verification failed for request %s", it.row.request_id)
                verdicts[it.index] = failed(f"internal error: {type(e).__name__}: {e}")
        for index, verdict in verdicts.items():
            self._step.row(index).verdict = verdict
        for it in items:
            if it.index not in drafts:
                self._step.row(it.index).plain_id = it.row.request_id
        self._keep_top_ids(items, logits)
        return verdicts

    @staticmethod
    def _argmax_verdicts(items: list[SampleItem], drafts: dict[int, DraftTree], logits: torch.Tensor) -> dict[int, Verdict]:
        """Where every item's token is its raw logits' argmax (`argmax_only`: greedy, nothing that
        changes the logits, no logprobs) and the items' rows are the logits' rows in order, the
        verdicts of all of them, plain and drafted, from one argmax pass over the logits; else none.
        Sampling the plain rows and verifying each tree apart made a pass over the fresh logits
        each: ~120 us a tree on ShareGPT at batch 4 on the bundled model, where drafted steps
        verified two or three trees."""
        if not items or not all(argmax_only(it.row) for it in items):
            return {}
        expected = 0
        for it in items:
            if it.rows[0] != expected:
                return {}
            expected += it.rows[1]
        if expected != logits.shape[0]:
            return {}
        try:
            picks, errors = greedy_choice(logits, [it.row.params for it in items for _ in range(it.rows[1])])
        except Exception:  # noqa: BLE001 - the row-by-row paths below find which request fails
            logger.exception("one argmax pass over the step's logits failed; verifying row by row")
            return {}
        verdicts: dict[int, Verdict] = {}
        for it in items:
            start, count = it.rows
            error = next((e for e in errors[start : start + count] if e is not None), None)
            tree = drafts.get(it.index)
            if error is not None:
                verdicts[it.index] = failed(error)
            elif tree is None:
                verdicts[it.index] = Verdict([], [picks[start]], [None])
            else:
                verdicts[it.index] = Verifier.greedy_verdict(tree, picks[start : start + count])
        return verdicts

    @property
    def wants_hidden(self) -> bool:
        """Whether a drafter learns from the target's hidden states (the runner then keeps them)."""
        return self.enabled and any(d.wants_hidden for d in self.drafters.values())

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The layers whose states the hidden-state drafter reads besides the last (a speculator
        builds at most one such drafter: the EAGLE head)."""
        if not self.wants_hidden:
            return ()
        return next((d.feature_layers for d in self.drafters.values() if d.wants_hidden), ())

    def features(self, committed: list[tuple[str, int, torch.Tensor]]) -> None:
        """The target's hidden states of the tokens this step commits, per request: (request id,
        position of the first, [n, hidden], or [n, (len(feature_layers) + 1) * hidden]); handed to
        the drafters that draft from them."""
        if not committed:
            return
        for drafter in list(self.drafters.values()):
            if not drafter.wants_hidden:
                continue
            try:
                drafter.features(committed)
            except Exception:  # noqa: BLE001 - a drafter that cannot learn still leaves the step whole
                self._failed("features")

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[Verdict]:
        """Plain decoding's draw for each row; if the batched draw raises, row by row, so that only
        the rows that fail alone fail."""
        try:
            out = self.sampler(logits, rows)
        except Exception as e:  # noqa: BLE001
            if len(rows) == 1:
                logger.exception("sampling failed for request %s", rows[0].request_id)
                return [failed(f"internal error: {type(e).__name__}: {e}")]
            return [v for i, row in enumerate(rows) for v in self._sample(logits[i : i + 1], [row])]
        return [
            failed(err) if err is not None else Verdict([], [tok], [lp])
            for tok, lp, err in zip(out.token_ids, out.logprobs, out.errors)
        ]

    def _learning(self) -> frozenset[str]:
        """The drafters that learn from the target's rows this step: those that drafted this step
        or lately, and now and then the others (learning costs a top-k over every row's logits).
        None on a step the guard keeps plain, and none that the guard has switched off at this
        shape: where drafts do not pay, speculation costs nothing it can avoid (the learners learn
        again once the guard's probes find drafts paying)."""
        step = self._step
        now = {r.drafted.name for r in step.rows.values() if r.drafted is not None}
        return frozenset(
            name for name, d in self._active.items() if d.target_topk > 0 and (
                name in now or self._step_no - self._used_at.get(name, -(1 << 30)) < self.explore_every
                or self._step_no % self.LEARN_EVERY == 0
            )
        )

    def _keep_top_ids(self, items: list[SampleItem], logits: torch.Tensor) -> None:
        """For drafters that learn from the target: its top tokens at every verified row."""
        self._step.learners = learners = self._learning()
        k = max((self.drafters[name].target_topk for name in learners), default=0)
        if k <= 0 or not items:
            return
        top = row_topk_ids(logits, k).cpu()
        for it in items:
            start, count = it.rows
            r = self._step.row(it.index)
            r.top_ids = top[start : start + count]
            if r.drafted is None:  # no drafter's tree (maybe a grammar's forced nodes)
                row = it.row
                r.plain_view = r.view or RequestView(  # else not a decode offered to drafters (a prefill's first token)
                    row.request_id, tuple(row.prompt_token_ids), tuple(row.output_token_ids), row.params
                )

    # -- observe -------------------------------------------------------------------------------
    def observe(self, seconds: float) -> None:
        """The step is done and took `seconds`: every model learns what it showed; then the
        requests that finished during the step are forgotten (after, so nothing recreates them)."""
        step = self._step
        self._step = _Step()
        self._open = False
        try:
            if self.enabled:
                self._learn(step, seconds)
        except Exception:  # noqa: BLE001 - the step's tokens are out already; learning is optional
            logger.exception("speculation failed while learning from a step")
        self._step_no += 1
        self._quiet = self._next_quiet(step)
        for request_id, view in step.finished:
            self._finish_now(request_id, view)

    def _next_quiet(self, step: _Step) -> bool:
        """Whether the next step is sure to be plain: this one decoded only, and at its shape the
        guard has every drafter off with no probe due (`GoodputGuard.quiet`). Then the scheduler
        reserves no draft slots and the engine offers no decodes: where drafts lose, a plain step
        under `auto` cost ~220 us more than under `--spec none` at batch 8 on the bundled model
        (reserving and trimming slots, the decodes' views, their rows here: ~80 us of it; BENCHMARKS.md,
        session 33). A request joining comes with a prefill chunk, a step after which this says no:
        the guard sees the new requests (its probes come sooner when the requests drafts lost with
        have left). If the next step's shape differs (a request finished), it may lose one step's
        drafts."""
        if not self.enabled or self.guard is None or step.guard is None:
            return False
        return self.guard.quiet(step.guard[0], list(self.drafters), self._step_no)

    def _learn(self, step: _Step, seconds: float) -> None:
        """What the step teaches: the acceptance records and the drafters (from the trees verified),
        each request's pace, the guard (from the step's time and tokens), the cost model. Every
        step comes here, most of them plain under `auto` where drafts do not pay: one pass over the
        rows does what a plain step needs (on ShareGPT at batch 4 on the bundled model, a plain
        step's learning was ~100 us against a 7 ms step)."""
        learning, step_seconds = time.perf_counter(), seconds
        a = self.acceptance
        for name, rid, proposed in step.asked:
            a.observe_proposal(name, rid, proposed)
        predicted = 0.0
        accepted = forced_accepted = forced_drafted = 0
        notes: dict[str, list[Observation]] = {}
        done: list[_Row] = []  # the rows that emitted tokens
        drafted_by: set[str] = set()
        since = self._since_draft
        for r in step.rows.values():
            ok = r.ok
            if ok:
                done.append(r)
            if r.plain_id is not None:
                since[r.plain_id] = since.get(r.plain_id, 0) + 1
            d = r.drafted
            if d is None and r.forced is None and r.plain_view is None:
                continue  # a plain row: nothing more to learn from it
            if d is not None:
                drafted_by.add(d.name)
            if d is not None and ok:
                rid = d.view.request_id
                mine = [n for n in r.verdict.accepted if n < len(d.tree)]  # type: ignore[union-attr]  # forced nodes follow
                a.observe(d.name, rid, d.tree, mine)
                self._calibration.record(d.name, d.predicted, len(mine))
                for name, other in r.others:  # what the trees that lost would have had accepted
                    a.observe(name, rid, *replay(other, r.verdict.tokens))  # type: ignore[union-attr]
                predicted += d.predicted
                accepted += len(mine)
                since[rid] = 0
                self._drafted_with[d.name] += 1
                self._used_at[d.name] = self._step_no
                self._note(notes, d.view, d.name, d.tree, r.top_ids, step.learners)
            if r.plain_view is not None and ok:
                self._note(notes, r.plain_view, None, EMPTY_TREE, r.top_ids, step.learners)
            if r.forced is not None:
                first, count, parent = r.forced
                forced_drafted += count
                if ok and (parent < 0 or parent in r.verdict.accepted):  # type: ignore[union-attr]
                    hits = sum(1 for n in r.verdict.accepted if n >= first)  # type: ignore[union-attr]
                    forced_accepted += hits
                    self._learn_forced(hits, hits + (hits < count))
                if d is None and r.view is not None:  # forced nodes only: no drafter's
                    since[r.view.request_id] = since.get(r.view.request_id, 0) + 1
        if notes:
            self._tell_drafters(notes)
        # What the step cost is also what learning from it did (the acceptance records, the drafters'
        # observations: at batch 8 on the bundled model ~0.3 ms more after a drafted step than after
        # a plain one, a few percent of a step): the pace and the guard count it, the cost model not.
        seconds += time.perf_counter() - learning
        drafting = step.guard is not None and any(m is not Mode.PLAIN for m in step.guard[1].values())
        rates: list[float] = []  # with drafting on: each emitting request's tokens a step while it is
        if step.plain_seconds is not None:
            for r in done:
                rid = r.view.request_id if r.view is not None else r.plain_id
                if rid is not None:
                    emitted = len(r.verdict.tokens)  # type: ignore[union-attr]
                    pace = self._pace.get(rid)
                    if pace is None:
                        pace = self._pace[rid] = _Pace()
                    pace.seconds += seconds
                    pace.plain_seconds += step.plain_seconds
                    pace.steps += 1
                    pace.tokens += emitted
                    if drafting:
                        pace.drafting_step(self._step_no, emitted)
                        rates.append(pace.drafting_rate)
        grants = self._grants
        for g in step.grants:
            grants[g] += 1
        if step.guard is not None and self.guard is not None:
            shape, modes = step.guard
            forced_only = not drafted_by and forced_drafted > 0  # a grammar's
            tokens = self._valued_tokens(step, done, rates)
            # A draft model catching up after plain steps is not what its drafts cost: judged with
            # it, the probe that turns drafting back on looks slow (Drafter.catch_up_seconds). With
            # several requests decoding, though, requests keep arriving and falling behind, and their
            # catching up is what drafting with the model costs there: it counts.
            catch_up = step.catch_up_seconds if len(step.rows) <= 1 else 0.0
            self.guard.record_step(shape, modes, self._step_no, drafted_by, seconds - catch_up,
                                   tokens, len(done),
                                   judged=not forced_only, expected=step.plain_seconds)
        sums = self._sums
        sums["steps"] += 1
        if predicted or accepted or forced_accepted:
            sums["predicted_accepted"] += predicted
            sums["accepted"] += accepted
            sums["forced_accepted"] += forced_accepted
        if forced_drafted:
            sums["forced_drafted"] += forced_drafted
        # Every step teaches the cost model, the ones kept plain too (their predicted time is the plain
        # one): taught only where the drafters were asked, its plain time followed what drafted steps
        # taught it, and the guard, which judges steps in its units, read plain steps at a median 0.89
        # of their prediction on ShareGPT at batch 4 on the bundled model (0.94 taught by every step;
        # BENCHMARKS.md, session 31). Throughput moved within noise.
        expected = step.predicted_seconds if step.predicted_seconds is not None else step.plain_seconds
        if step.shape is not None and expected is not None:
            forward_seconds = max(step_seconds - step.propose_seconds, 1e-6)
            self.controller.learn(step.shape, forward_seconds)
            sums["cost_predicted_seconds"] += expected
            sums["cost_actual_seconds"] += forward_seconds
            sums["cost_abs_error_seconds"] += abs(expected - forward_seconds)
            sums["cost_steps"] += 1

    def _valued_tokens(self, step: _Step, done: list[_Row], rates: list[float]) -> float:
        """The step's emitted tokens as the guard weighs them (`rates`: with drafting on, each
        emitting request's tokens a step while drafting is on, recent steps weighing most). Where
        requests wait for room, every token counts (a request that ends sooner lets the next one
        in). Where none waits and several decode, the batch runs until its slowest request ends: a
        request's extra tokens save its own rows of later steps (the per-request part of a step's
        time), but the part of a step that is not per request is paid until the request that
        drafting speeds least is done. So a step with drafting on counts, for that share of a plain
        step (the cost model's `fixed_share`), as many tokens a request as the least of the rates,
        and for the rest every token. (On ShareGPT at batch 8 on the bundled model, `auto` saved
        2-5% of the steps while its steps cost 3-9% more forward and 0.6-1 ms more outside it, and
        the sum of tokens read as a gain: BENCHMARKS.md, session 17.) At LATENCY_ROWS requests or
        more, the whole step counts so: drafting pays there only where it slows no request."""
        total = float(sum(len(r.verdict.tokens) for r in done))  # type: ignore[union-attr]
        share = step.fixed_share
        if share is None or not rates or len(done) < 2 or len(rates) < len(done):
            return total
        if len(done) >= self.LATENCY_ROWS:
            share = 1.0
        return share * len(done) * min(rates) + (1.0 - share) * total

    def _learn_forced(self, hits: int, trials: int) -> None:
        """Forced nodes reached this step: `hits` accepted of `trials` tried (the first rejected one
        counts, those after it were never tried). Older steps weigh less."""
        old_hits, old_trials = self._forced
        decay = 0.99 ** trials
        self._forced = (old_hits * decay + hits, old_trials * decay + trials)

    def _note(self, notes: dict[str, list[Observation]], view: RequestView,
              verified_by: str | None, tree: DraftTree, top: torch.Tensor | None, learners: frozenset[str]) -> None:
        """What each drafter is told of a request's step (`Drafter.observe`): the drafter whose tree
        was verified, its tree; the drafters learning from the target this step, the empty tree."""
        for name, drafter in self.drafters.items():
            mine = name == verified_by
            if not mine and name not in learners:
                continue
            rows = None
            if top is not None and drafter.target_topk > 0:
                rows = top[: (len(tree) + 1) if mine else 1, : drafter.target_topk]
            notes.setdefault(name, []).append((view, tree if mine else EMPTY_TREE, rows))

    def _tell_drafters(self, notes: dict[str, list[Observation]]) -> None:
        for name, observations in notes.items():
            drafter = self.drafters.get(name)
            if drafter is None:
                continue
            try:
                drafter.observe_many(observations)
            except Exception:  # noqa: BLE001 - a drafter that cannot learn still drafts
                self._failed("observe")

    def finish(self, request_id: str, view: RequestView) -> None:
        """The request left the engine (finished, aborted or failed). During a step (between
        propose and observe) its state is dropped when the step is observed."""
        if self._open:
            self._step.finished.append((request_id, view))
            return
        self._finish_now(request_id, view)

    def _finish_now(self, request_id: str, view: RequestView) -> None:
        self.acceptance.forget(request_id)
        self._since_draft.pop(request_id, None)
        self._pace.pop(request_id, None)
        for drafter in list(self.drafters.values()):
            try:
                drafter.finish(request_id, view)
            except Exception:  # noqa: BLE001 - the request is done either way
                self._failed("finish")

    def stats(self) -> SpeculationStats:
        guard = self.guard.stats() if self.guard is not None else None
        return SpeculationStats(**self._sums, grants=tuple(sorted(self._grants.items())),
                                drafted_with=tuple(sorted(self._drafted_with.items())),
                                guard_plain_steps=guard.plain_steps if guard else 0,
                                guard_probes=guard.probes if guard else 0,
                                guard_turned_off=guard.turned_off if guard else 0)

    def _failed(self, stage: str) -> None:
        """The first failure is logged with its traceback, later ones counted; a drafter failing
        every time is switched off."""
        self._failures += 1
        if self._failures == 1:
            logger.exception("drafter failed in %s; the step goes on without it", stage)
        if self._failures >= self.MAX_FAILURES:
            logger.error("drafter failed %d times in a row; speculation is off from now on", self._failures)
            self.drafters = {}
