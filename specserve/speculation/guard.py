"""A measured check that speculation pays: realized tokens per second with drafts against the same
engine's rate without them, per batch shape and drafter.

The controller decides from models (acceptance rates, a step-cost fit), and models are wrong on
inputs they have not seen. The guard looks only at what happened: for decode-only steps, bucketed by
how many requests decode and how much context they attend to, it keeps a moving average of the
seconds per emitted token of the steps it makes plain (a shape's first, a control step when none
came for a while: 64 steps where drafts clearly pay, 8 while their gain is within 25% of plain's,
unless, at batch 1, another drafter's at the shape clearly pays: the reference is the shape's;
every step while the shape is off) and of the steps taken while drafting is on (their whole time
over every token they emitted, accepted and bonus; where no request waits for room and several
decode, the part of a step that is not per request counts only as many tokens a request as
drafting gives the request it speeds least: the batch ends with its slowest request): those that
verified drafts, and those whose drafters were asked and nothing was verified (the controller found nothing worth
verifying, or the drafters proposed nothing), since being on cost them the asking and the
learning (at batch 8 on a small model 211 of 508 steps, ~0.8 ms each over a plain one, in
BENCHMARKS.md), and counted as plain they made the reference slower and drafting look even. Where the
speculator gives each step's predicted plain time (the step-cost model's for that step's own
requests and context), steps are measured in it: a step with drafting on against what it would
have taken plain, and the plain steps by how far the model misses them (their time over their
prediction). A raw plain reference goes stale as a batch's context grows (at batch 8 on a small
model a step took 30% longer at the end of a group's 128 tokens than at its start, and drafts at
the next group's short contexts, judged against the last group's long ones, looked 1.5x as fast
as plain while they lost), and a bucket holds steps of 5 to 8 requests, whose cost per token
differs. While
steps with drafting on deliver a token for fewer seconds than plain ones the controller decides as before;
once they deliver fewer tokens per second (beyond `margin`, over at least `min_steps` drafted
steps or four times as many that only asked), or emit no more tokens than requests (every draft rejected, whatever the clock says under
load), the bucket is off: its steps decode plainly, drafting nothing and exploring nothing, but
for a probe now and then (after `probe_after` steps, doubling after every probe that loses, up to
`probe_max`), a step on which every decode drafts with the drafters that are off (the controller's
choice, at least one node each); a probe that pays turns the bucket back on. A probe that verified
none of a drafter's trees (it proposed nothing, or another's tree was valued more) did not lose (see
`record_step`). A probe comes at once when every request the drafts lost with has left the
bucket's steps: their loss says nothing of the requests that came after (at batch 1, the next
request, and there the waits start short again too; at a shape of several requests they keep
their length, as the loss may be the shape's). A shape of more requests than `start_off_rows`
starts off, its plain reference first, and a probe decides whether it drafts (there drafts are
kept only where they slow no request, which nothing has judged of a new shape).

Each drafter has its own bucket at each shape (`modes`, `record_step`): a drafted step is judged in
the buckets of the drafters whose trees it verified, a plain step is every drafter's reference. So
under `auto`, where a step verifies whichever drafter's tree is valued most, a drafter whose drafts
lose at a shape is switched off there while one whose drafts pay goes on drafting (one shared
bucket averaged the two, and at batch 1 switched both off where suffix alone paid). Drafters not
yet judged at a shape go off with the first that loses there, and the drafters that are off at a
shape probe together, so drafts that always lose cost about what one drafter's would; both only
among drafters judged by the same config (a draft model's probes last several steps, and the
lookups probing on each of them were judged, and lost, on every one). A step whose
only verified nodes are a grammar's forced text judges no drafter.

Why this never changes what a request outputs: the guard chooses whether a step drafts from the
seconds and token counts of steps already taken, before the step's drafts are drawn or verified;
it never reads the step's own draws. For any draft tree chosen from the past (none included),
verification emits tokens drawn exactly from the target's distribution given the output so far
(greedy: its argmax; seeded: its draw at that position), so which tree each step verifies moves
speed, never the output's distribution. Steps with prefill chunks are not judged (their time is
mostly the prompt's) and are never probes or controls, but their decodes draft only with the drafters
not off at the decodes' own shape (`off`).
"""

from __future__ import annotations

import enum
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field


class Mode(enum.Enum):
    DRAFT = "draft"  # the drafter may draft: the controller decides
    PLAIN = "plain"  # not this step (its bucket is off, or a control step for the shape)
    PROBE = "probe"  # its bucket is off, and this step tries it for every decode


@dataclass(frozen=True)
class GuardConfig:
    margin: float = 0.02  # drafted steps may be this much slower per token before the bucket goes off
    min_steps: int = 3  # drafted steps measured before a bucket can be judged
    decay: float = 0.8  # weight of the old average per new step
    control_every: int = 64  # a plain step when none came at the bucket in this many steps
    control_close: int = 8  # ... in this many, while drafting's gain is within `close` of plain's
    close: float = 0.25
    # plain references taken every `control_close` steps however drafting's gain reads, the reference
    # their median, before it is a moving average (see `_reference_every`)
    first_references: int = 4
    share_decay: float = 0.95  # weight of the old share of drafted steps among steps with drafting on, per step
    probe_after: int = 16  # steps off before the first probe
    probe_max: int = 512  # the longest wait between probes
    probe_steps: int = 1  # drafted steps a probe lasts before it is judged (on their average)
    # the waits between probes start short again once every request the drafts lost with has left,
    # at shapes of at most this many requests (a loss at batch 1 is the request's; at larger shapes
    # it may be the shape's cost, which new requests do not change)
    fresh_requests_rows: int = 1 << 30
    # ... and there the waits also start short again only at shapes of at most this many requests;
    # at larger ones the probe comes at once but the wait keeps its length (see `_say`)
    fresh_short_rows: int = 1
    # a bucket whose steps all have more requests than this starts off, its drafts tried by a probe
    # after `probe_after` steps (see `_bucket`); the speculator's builder sets it to the size from
    # which drafts are kept only where they slow nobody (`Speculator.LATENCY_ROWS`)
    start_off_rows: int = 1 << 30

    def __post_init__(self) -> None:
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"guard margin: must be in [0, 1), got {self.margin}")
        for name in ("min_steps", "control_every", "control_close", "first_references", "probe_after", "probe_max", "probe_steps",
                     "fresh_requests_rows", "fresh_short_rows", "start_off_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"guard {name}: must be >= 1, got {getattr(self, name)}")
        if self.close < 0:
            raise ValueError(f"guard close: must be >= 0, got {self.close}")
        for name in ("decay", "share_decay"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"guard {name}: must be in [0, 1), got {getattr(self, name)}")


@dataclass(slots=True)
class _Average:
    value: float = 0.0
    steps: int = 0

    def add(self, x: float, decay: float) -> None:
        self.value = x if self.steps == 0 else decay * self.value + (1.0 - decay) * x
        self.steps += 1


@dataclass(slots=True)
class _Bucket:
    plain: _Average = field(default_factory=_Average)  # seconds per token of plain steps
    first_plain: list[float] = field(default_factory=list)  # the first `first_references` of them
    seconds: _Average = field(default_factory=_Average)  # of drafted steps
    tokens: _Average = field(default_factory=_Average)  # emitted by drafted steps
    rows: _Average = field(default_factory=_Average)  # requests emitting in drafted steps
    asked_seconds: _Average = field(default_factory=_Average)  # of steps that asked drafters and verified nothing
    asked_tokens: _Average = field(default_factory=_Average)  # ... and their tokens (one a request)
    drafted_n: float = 0.0  # steps with drafting on that verified drafts (decayed by share_decay a step) ...
    asked_n: float = 0.0  # ... and that only asked
    off: bool = False
    last_plain: int = -(1 << 30)  # step number of the last plain step measured here
    wait: int = 0  # steps between probes now
    next_probe: int = 0
    probed: int = 0  # drafted steps of the probe under way
    on_since: int = 0  # drafted steps since the bucket last turned on
    requests: frozenset[str] = frozenset()  # the requests of the bucket's latest step
    off_for: frozenset[str] = frozenset()  # the requests drafts lost with when it last turned off
    modelled: bool = False  # steps with drafting on are measured in their predicted plain time (`gain`)

    def gain(self) -> float:
        """Plain seconds per token over the seconds per token of steps with drafting on (> 1:
        drafts pay): drafted steps and steps that only asked, mixed in the share they come in, so
        that a run of steps with nothing to draft moves the judgment only as far as their share.
        `modelled`: each step's seconds are in units of the time the cost model predicts it would
        have taken plain, so plain's rate for its requests is a token a request in `plain` units
        (the shape's plain steps' time over their prediction: what the model misses of a plain
        step, a ratio that stays put while the context grows); else plain's rate is the average
        seconds per token of the shape's plain steps."""
        f = self.drafted_n / (self.drafted_n + self.asked_n) if self.drafted_n + self.asked_n else 1.0
        tokens = f * self.tokens.value + (1.0 - f) * self.asked_tokens.value
        seconds = f * self.seconds.value + (1.0 - f) * self.asked_seconds.value
        if self.modelled:
            rows = f * self.rows.value + (1.0 - f) * self.asked_tokens.value  # a step that only asked: a token a request
            return self.plain.value * tokens / (rows * seconds)
        return self.plain.value * tokens / seconds

    def pays(self, at_least: float) -> bool:
        """Whether steps with drafting on deliver at least `at_least` x plain's tokens per second,
        and drafted steps some tokens beyond one per request at all: a step whose drafts were all
        rejected cannot have paid, however its time compares under a noisy clock."""
        return self.gain() >= at_least and (self.seconds.steps == 0 or self.tokens.value > 1.01 * self.rows.value)


@dataclass(frozen=True)
class GuardStats:
    plain_steps: int = 0  # decode steps the guard kept plain (bucket off, or control)
    probes: int = 0  # steps that probed (and drafted)
    turned_off: int = 0  # times a drafter at a shape was switched off by its own drafts' loss
    turned_on: int = 0  # ... and back on by a probe (also one that went off with another, see _off_with)
    buckets_off: int = 0  # (drafter, shape) buckets off now


class GoodputGuard:
    """Per batch shape and drafter: whether this step may draft with it, from what drafted and plain
    steps delivered. Drafters named in `per_drafter` are judged by a config of their own (a model
    drafter's steps vary more than a lookup's), the rest by `config`."""

    def __init__(self, config: GuardConfig | None = None, per_drafter: Mapping[str, GuardConfig] | None = None) -> None:
        self.config = config or GuardConfig()
        self.per_drafter = dict(per_drafter or {})  # drafters judged by a config of their own
        self._buckets: dict[tuple[int, int, str], _Bucket] = {}  # by (rows, context, drafter)
        self._counts = dict.fromkeys(GuardStats.__dataclass_fields__, 0)  # GuardStats' fields, as they run

    @staticmethod
    def key(rows: int, attended: int) -> tuple[int, int]:
        """The bucket of a decode-only step: requests decoding (exact to 4, then by powers of two),
        and mean context per request (by powers of four)."""
        r = rows if rows <= 4 else 1 << (rows - 1).bit_length()
        context = max(attended // max(rows, 1), 1)
        return r, (context.bit_length() - 1) // 2

    @staticmethod
    def fewest_rows(bucket_rows: int) -> int:
        """The fewest requests decoding in a step of the bucket whose rows `key` gave as
        `bucket_rows` (up to 4 exact; above, a bucket of r holds r/2 + 1 to r)."""
        return bucket_rows if bucket_rows <= 4 else bucket_rows // 2 + 1

    def modes(self, shape: tuple[int, int], drafters: list[str], step_no: int,
              requests: frozenset[str] = frozenset()) -> dict[str, Mode]:
        """The say on each drafter for a step of `shape` (`key`) decoding `requests`: each drafter
        has a bucket of its own at each shape (the bucket `shape + (drafter,)`), judged by the
        drafted steps that verified its trees against the shape's plain steps, which every
        drafter's bucket records. A plain reference for any bucket that is on makes the step plain
        for all; else an off bucket says PLAIN or PROBE, an on one DRAFT."""
        keys = {name: (*shape, name) for name in drafters}
        buckets = {name: self._bucket(k, step_no) for name, k in keys.items()}
        # The plain reference is the shape's, shared by its drafters, and a control step gives up the
        # gain of whichever drafter the step would have verified: where one clearly pays here, the
        # others' gains near plain's do not call for a control every `control_close` steps (on the
        # 1.5B's Spec-Bench at batch 1, ngram's and recycling's made every eighth step plain while
        # the draft model's drafts gave 1.5x plain's rate). Measured at batch 1 only, and kept there.
        clear = shape[0] <= 1 and any(self._clearly_pays(keys[n], b) for n, b in buckets.items())
        said = {name: self._say(keys[name], b, step_no, requests, clear) for name, b in buckets.items()}
        if any(m is Mode.PLAIN and not self._buckets[keys[n]].off for n, m in said.items()):
            return dict.fromkeys(drafters, Mode.PLAIN)
        probing = {id(self._config(keys[n])) for n, m in said.items() if m is Mode.PROBE}
        if probing:  # every drafter off here and judged alike probes with it: one probe schedule a shape and config
            for name, b in ((n, self._buckets[k]) for n, k in keys.items()):
                if b.off and b.plain.steps and id(self._config(keys[name])) in probing:
                    said[name] = Mode.PROBE
        return said

    def quiet(self, shape: tuple[int, int], drafters: list[str], step_no: int) -> bool:
        """Whether a decode-only step of `shape` at `step_no` would be plain for every drafter, read
        without recording anything: each has a bucket here, off, with no probe under way or due.
        (`modes` may still call a probe at once where the requests drafts lost with have left; new
        requests come with a prefill chunk, and the speculator asks this only after a step without
        one.)"""
        for name in drafters:
            b = self._buckets.get((*shape, name))
            if b is None or not b.off or ((step_no >= b.next_probe or b.probed) and b.plain.steps):
                return False
        return bool(drafters)

    def off(self, shape: tuple[int, int], drafters: list[str]) -> set[str]:
        """The drafters whose drafts lost at `shape` (`key` of a step's decodes) and are off there
        (a shape not seen yet: as its nearest context bucket), read without recording anything: for
        a step carrying a prefill chunk, which the guard neither judges nor makes a probe or a
        control step of, but whose decodes should not draft with what loses on decode-only steps
        of their shape (at batch 8 on a small model 51 of 53 such steps drafted, ~18 nodes each,
        while the guard kept 605 of 790 decode-only steps plain)."""
        out = set()
        for name in drafters:
            key = (*shape, name)
            b = self._buckets.get(key) or self._nearest(key)
            if (b.off if b is not None else self._starts_off(key)):
                out.add(name)
        return out

    def _config(self, key: tuple[int, int, str]) -> GuardConfig:
        return self.per_drafter.get(key[2], self.config)

    def _say(self, key: tuple[int, int, str], b: _Bucket, step_no: int, requests: frozenset[str],
             clear: bool = False) -> Mode:
        b.requests = requests
        c = self._config(key)
        if b.off and requests and b.off_for and not requests & b.off_for and key[0] <= c.fresh_requests_rows:
            # every request the drafts lost with has left: that loss says nothing of these (at batch
            # 1, one request that drafts badly would else keep drafting off for the next ones for up
            # to probe_max steps), so a probe comes at once. At batch 1 the waits start short again
            # too; at a shape of several requests they keep their length: there the requests turn
            # over every ~128 steps, and waits started short again at each turnover made 4-5 probes
            # of it (on ShareGPT at batch 8 on the bundled model, each probe a drafted step costing
            # ~1.9x a plain one: 1-2% of the run; BENCHMARKS.md, session 38)
            if key[0] <= c.fresh_short_rows:
                b.wait = 0
            b.next_probe, b.off_for = min(b.next_probe, step_no + 1), frozenset()
        if b.off:  # a probe is judged against this shape's own plain steps: one comes first
            return Mode.PROBE if (step_no >= b.next_probe or b.probed) and b.plain.steps else Mode.PLAIN
        since = step_no - b.last_plain
        if b.plain.steps == 0 or ((b.seconds.steps or b.asked_seconds.steps) and since >= c.control_close
                                  and since >= self._reference_every(c, b, clear)):
            # the reference first, and again when it is old (the gain read only then): also where the
            # drafters were only asked (lookups exploring, nothing verified), whose gain is read against it
            return Mode.PLAIN
        return Mode.DRAFT

    def _reference_every(self, c: GuardConfig, b: _Bucket, clear: bool = False) -> int:
        """Steps between plain references: fewer while drafting's measured gain is close to plain's,
        where a reference a few percent off (taken while the cost model was still learning, or
        at other contexts) decides the judgment; many where drafts clearly pay (each control step
        gives up their gain). And few until the shape has `first_references` of them: its first
        plain step alone is a poor reference (on ShareGPT at batch 8 on the bundled model it took
        1.5x its predicted time, so drafts that lost read as 1.6x plain's rate, too far from it for
        a control before 64 steps, and a shape drafted at a loss for its first 160-230 steps while
        that one step was washed out of the average; BENCHMARKS.md, session 37). The reference is
        the median of those first ones (a mean still carries a slow one for long), then a moving
        average from there.
        `clear`: another drafter's clearly pays at the shape (batch 1, `modes`): a control every
        `control_every` once the first references are in."""
        if b.plain.steps < c.first_references:
            return c.control_close
        if clear:
            return c.control_every
        return c.control_close if abs(b.gain() - 1.0) < c.close else c.control_every

    def _clearly_pays(self, key: tuple[int, int, str], b: _Bucket) -> bool:
        """Whether the drafter's drafts at this shape are on and, judged on at least `min_steps`
        drafted steps, deliver beyond `close` more than plain's rate."""
        c = self._config(key)
        return not b.off and b.plain.steps > 0 and b.seconds.steps >= c.min_steps and b.gain() >= 1.0 + c.close

    def record_step(self, shape: tuple[int, int], modes: dict[str, Mode], step_no: int, drafted_by: set[str],
                    seconds: float, tokens: float, rows: int, judged: bool = True, expected: float | None = None) -> None:
        """A step of `shape` that `modes` (from `modes`) said of, which took `seconds` and emitted
        `tokens` for `rows` requests (as the speculator values them: where no request waits for
        room, see `Speculator._valued_tokens`). `expected`: what the step would have taken without
        drafts (the step-cost model's prediction for its own requests and context, fitted to every step's
        measured time); given, a step with drafting on is judged against it (`_Bucket.gain`), else
        against the shape's plain steps. A step the guard made plain is every drafter's reference;
        a drafted one is judged in the buckets of the drafters whose nodes it verified, one that
        verified nothing in the buckets of the drafters that were on (DRAFT) for it; `judged`
        False (a step whose verified nodes were a grammar's forced text only) judges nothing. A
        drafter that probed without any of its trees verified did not lose: it probes next with
        the probers judged by its config that were judged and are still off (one schedule for the
        drafters off at a shape and judged alike); where none was, it probes again on the next step
        (a probe takes nothing from the drafters that are on: at batch 1, suffix is tried as soon as
        it has a match)."""
        if tokens > 0 and seconds > 0 and judged:
            modelled = expected is not None and expected > 0
            if modelled:
                seconds /= expected  # type: ignore[operator]
            for name in set(modes) | drafted_by:  # the units this step's records are in
                self._bucket((*shape, name), step_no).modelled = modelled
            if modes and all(m is Mode.PLAIN for m in modes.values()):
                self._count(plain_steps=1)
            if drafted_by and Mode.PROBE in modes.values():
                self._count(probes=1)  # a step, however many drafters it judged
            if drafted_by:
                for name in drafted_by:
                    self._record((*shape, name), modes.get(name, Mode.DRAFT), step_no, True, seconds, tokens, rows)
            elif all(m is Mode.PLAIN for m in modes.values()):  # the guard's plain step: every drafter's reference
                for name in modes:
                    self._record((*shape, name), Mode.PLAIN, step_no, False, seconds, tokens, rows)
            else:  # drafters asked, nothing verified: what being on cost this step (no reference)
                for name, mode in modes.items():
                    if mode is Mode.DRAFT:
                        self._record_asked((*shape, name), step_no, seconds, tokens)
        else:
            drafted_by = set()
        for name, mode in modes.items():
            if mode is not Mode.PROBE or name in drafted_by:
                continue
            config = self._config((*shape, name))
            group = [b for n in drafted_by if modes.get(n) is Mode.PROBE and self._config((*shape, n)) is config
                     and (b := self._bucket((*shape, n), step_no)).off]
            if group:
                b = self._bucket((*shape, name), step_no)
                b.wait, b.next_probe = max(g.wait for g in group), max(g.next_probe for g in group)

    def _record(self, key: tuple[int, int, str], mode: Mode, step_no: int, drafted: bool, seconds: float,
                tokens: float, rows: int) -> None:
        c = self._config(key)
        b = self._bucket(key, step_no)
        if not drafted:  # modelled: the step's time over its predicted time (how the model misses plain steps)
            x = seconds if b.modelled else seconds / tokens
            if len(b.first_plain) < c.first_references:  # the reference is their median, then moves with `decay`
                b.first_plain.append(x)
                b.plain.value, b.plain.steps = statistics.median(b.first_plain), b.plain.steps + 1
            else:
                b.plain.add(x, c.decay)
            b.last_plain = step_no
            return
        if b.plain.steps == 0:
            return
        # a probe's steps count alike (their mean: the probe started its averages afresh)
        decay = b.probed / (b.probed + 1) if mode is Mode.PROBE else c.decay
        b.seconds.add(seconds, decay)
        b.tokens.add(tokens, decay)
        b.rows.add(rows, decay)
        b.drafted_n, b.asked_n = c.share_decay * b.drafted_n + 1.0, c.share_decay * b.asked_n
        if mode is Mode.PROBE:
            b.probed += 1
            if b.probed < c.probe_steps:
                return  # the probe goes on
            b.probed = 0
            if b.pays(1.0):
                b.off, b.on_since = False, 0
                self._count(turned_on=1, buckets_off=-1)
            else:
                self._back_off(c, b, step_no)
            return
        b.on_since += 1
        self._judge(key, b, step_no)

    def _record_asked(self, key: tuple[int, int, str], step_no: int, seconds: float, tokens: float) -> None:
        """A step with the drafter on that verified nothing: its time is what being on costs where
        nothing is drafted (the asking, the learning); judged with the drafted steps in their share."""
        c = self._config(key)
        b = self._bucket(key, step_no)
        if b.plain.steps == 0 or b.off:
            return
        b.asked_seconds.add(seconds, c.decay)
        b.asked_tokens.add(tokens, c.decay)
        b.drafted_n, b.asked_n = c.share_decay * b.drafted_n, c.share_decay * b.asked_n + 1.0
        b.on_since += 1
        self._judge(key, b, step_no)

    def _judge(self, key: tuple[int, int, str], b: _Bucket, step_no: int) -> None:
        """Off once steps with drafting on lose (`min_steps` drafted ones, or four times as many
        that only asked)."""
        c = self._config(key)
        enough = b.seconds.steps >= c.min_steps or b.asked_seconds.steps >= 4 * c.min_steps
        if enough and not b.pays(1.0 - c.margin):
            self._back_off(c, b, step_no)
            b.off = True
            self._count(turned_off=1, buckets_off=1)
            self._off_with(key, b)
        elif b.on_since >= c.control_every:
            b.wait = 0  # it paid for a while: a later loss starts from short probes again

    def _bucket(self, key: tuple[int, int, str], step_no: int) -> _Bucket:
        """The bucket at `key` (`step_no`: the step asking, from which a new one's first probe is
        timed); a new one starts off where the nearest context bucket with the same
        rows and drafter is off (as the context grows, a shape where drafts lost is not tried
        afresh), and, with none to go by, where its steps have more than `start_off_rows`
        requests: its probes decide (`_starts_off`)."""
        b = self._buckets.get(key)
        if b is None:
            n = self._nearest(key)
            b = self._buckets[key] = _Bucket()
            if n is not None and n.off:
                b.off, b.wait, b.next_probe = True, n.wait, n.next_probe
                self._count(buckets_off=1)
            elif n is None and self._starts_off(key):
                c = self._config(key)
                b.off, b.wait, b.next_probe = True, c.probe_after, step_no + c.probe_after
                self._count(buckets_off=1)
        return b

    def _starts_off(self, key: tuple[int, int, str]) -> bool:
        """Whether a bucket never seen, at no context with its rows, starts off: where its steps all
        have more than `start_off_rows` requests (`fewest_rows`). There drafts are kept only where they slow no request (`Speculator.LATENCY_ROWS`), which
        the guard cannot know before it has judged the shape, and its first steps drafting would
        slow every request decoding: 48 ShareGPT requests at once on the bundled model, the p99
        TPOT, a 14-token request whose steps came when the last prompts were admitted and the
        64-row shape was new, was 0.98, 1.11, 1.09, 0.97 of `none`'s by round (BENCHMARKS.md,
        session 38)."""
        return self.fewest_rows(key[0]) > self._config(key).start_off_rows

    def _nearest(self, key: tuple[int, int, str]) -> _Bucket | None:
        """The bucket with the same rows and drafter as `key` at the nearest other context, if any."""
        near = [k for k in self._buckets if k[0] == key[0] and k[2] == key[2] and k != key]
        return self._buckets[min(near, key=lambda k: abs(k[1] - key[1]))] if near else None

    def _off_with(self, key: tuple[int, int, str], b: _Bucket) -> None:
        """Another drafter's bucket at this shape that has never been judged (none of its trees
        verified here yet) goes off with `b`, on the same probe schedule: where one drafter's drafts
        lost, the others are tried by probes, each judged on its own, rather than each by
        `min_steps` drafted steps of the controller's (with drafts that always lose, the probes of
        all of them then cost about what one drafter's would). Only drafters judged by the same
        config go with it: a draft model's loss says nothing of the lookups beside it."""
        config = self._config(key)
        for k, other in self._buckets.items():
            if (k[:2] == key[:2] and k != key and not other.off and other.seconds.steps == 0
                    and self._config(k) is config):
                other.off, other.wait, other.next_probe, other.off_for = True, b.wait, b.next_probe, b.off_for
                self._count(buckets_off=1)

    def _back_off(self, c: GuardConfig, b: _Bucket, step_no: int) -> None:
        """Off until a probe: the wait doubles with every loss since the bucket last paid for long."""
        b.wait = min(max(b.wait * 2, c.probe_after), c.probe_max)
        b.next_probe = step_no + b.wait
        b.probed = 0
        b.off_for = b.requests
        b.seconds, b.tokens, b.rows = _Average(), _Average(), _Average()  # judged afresh by the next probe
        b.asked_seconds, b.asked_tokens, b.drafted_n, b.asked_n = _Average(), _Average(), 0.0, 0.0

    def _count(self, **deltas: int) -> None:
        for k, v in deltas.items():
            self._counts[k] += v

    def stats(self) -> GuardStats:
        return GuardStats(**self._counts)
