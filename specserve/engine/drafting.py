"""Wiring speculation to an engine: the drafters' handles on the target and on a draft model,
the forward-time probe the controller's cost model starts from, and the Speculator itself.

This is the engine's side of the boundary: it may build runners and block managers; what it
hands to `speculation` is only forwards, shapes and a paged-KV handle.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch

from specserve.config import EngineConfig
from specserve.engine.block_manager import BlockManager
from specserve.engine.model_runner import ForwardItem, ModelRunner, allocate_kv_cache, kv_bytes_per_block
from specserve.engine.sequence import Sequence
from specserve.isa import cache_root, keep, read_kept
from specserve.model.attention import make_backend
from specserve.model.huge_pages import weights
from specserve.model.llama import LlamaForCausalLM
from specserve.model.tuning import machine_key
from specserve.sampling_params import SamplingParams
from specserve.speculation.config import SpeculativeConfig
from specserve.speculation.controller import (
    Controller, FixedController, ForwardProfile, GoodputController, StepCostModel,
)
from specserve.speculation.factory import ModelHandle, build_drafters
from specserve.speculation.guard import GoodputGuard, GuardConfig
from specserve.speculation.sampler import Sampler
from specserve.speculation.speculator import Speculator
from specserve.speculation.verifier import Verifier

logger = logging.getLogger("specserve.engine")

# Loads a draft model by name for a target context length, a draft quantization (a GGUF's
# projections as stored, or rounded to 4 bits: SpeculativeConfig.draft_quantization) and the token ids
# its LM head reads out (SpeculativeConfig.draft_vocab): (model, tokenizer).
DraftBuilder = Callable[[str, int, str, "int | None"], "tuple[LlamaForCausalLM, Any]"]

# Forward sizes probed at start. The CPU kernels take activation rows in passes of 8 (4 for the
# legacy GGUF types), each pass unpacking the weights again, so a forward's time jumps at the row
# after a pass is full: on the 1.5B on a 2-core Xeon (AVX-512), 8 rows 95 ms, 9 rows 115, 16 rows
# 160, 17 rows 179 (benchmarks/rows_per_forward.py). Probed only at powers of two, the profile drew
# a line from 8 to 16 and priced a ninth row at 8 ms where it cost 20: at batch 8 on ShareGPT `auto`
# verified a node or two on 88 steps, 111 ms each against 91 plain, for one more token a step
# (BENCHMARKS.md, session 28). The row after each full pass up to 16 is probed too.
PROBE_SIZES = (1, 2, 4, 5, 8, 9, 16, 17, 32, 64, 128)

# The guard where a drafter runs a model: a drafted step's outcome varies more (a chain of several
# forwards, accepted from none of it to all), so it is judged over more steps and probes last
# several. With the default's (one-step probes, an average over ~5 steps) the 0.5B drafting for the
# 1.5B kept being switched off where it paid (BENCHMARKS.md, session 21). Only the drafters that run a
# model are judged so; the lookups beside them under `auto` keep the default's quicker judgement. Its
# probes (a catch-up and forwards for every request) wait longer after each loss also as requests come
# and go at batch 2 and up (ShareGPT at batch 8, continuous, `auto` with the 0.5B: 0.84x plain before,
# 0.95x after, in one run each; BENCHMARKS.md, session 22).
MODEL_GUARD = GuardConfig(decay=0.9, min_steps=8, probe_steps=4, fresh_requests_rows=1,
                          start_off_rows=Speculator.LATENCY_ROWS)
# The lookups' guard: shapes of more than LATENCY_ROWS requests start off (`GuardConfig.start_off_rows`).
LOOKUP_GUARD = GuardConfig(start_off_rows=Speculator.LATENCY_ROWS)


class BlockPool:
    """A draft model's paged cache as the draft-model drafter uses it: a block table per request."""

    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks
        self._seqs: dict[str, Sequence] = {}

    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        seq = self._seqs.get(request_id)
        if seq is None:
            seq = self._seqs[request_id] = Sequence(request_id, [], SamplingParams(), 0.0, max_total_len=1 << 30)
        return seq.block_table if self.blocks.allocate(seq, num_tokens) else None

    def release(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.blocks.free(seq)


# Tries of each probed size, taken in rounds over the sizes, after a round that is not timed.
# Two leave the 1.5B's one-to-two-token difference anywhere from 1.7 to 4.9 ms over six probes on a
# 2-core Zen 4 (a step ~30 ms; one run that started from 5.4 ms judged a draft model's nodes too dear
# for most of Spec-Bench: 1,187 steps where a run that probed ~2 ms took 708; BENCHMARKS.md, session
# 27). The sizes a decode step's drafts reach (up to SMALL_PROBE tokens) are cheap and decide what a
# draft node costs: they are tried PROBE_TRIES_SMALL times. Without the untimed round the first
# speculating engine a process built probed its small sizes 4-25% slower than the next one did
# (their profile flatter: extra rows looked cheap), and in `bench spec` the method listed first lost
# 3-5% to the same method listed second (two runs; after, +2.5% and -1.6%; the first engine built
# may still run a few percent slow: benchmarks/auto_drafter_sets.py compares A B B A; BENCHMARKS.md, session 30).
PROBE_TRIES = 2
PROBE_TRIES_SMALL = 4
SMALL_PROBE = 17


def probe_forward(runner: ModelRunner, num_blocks: int, max_tokens: int, sizes=PROBE_SIZES,
                  tries_small: int = PROBE_TRIES_SMALL) -> dict[int, float]:
    """Seconds of one forward by number of new tokens, measured on this machine before the first
    request: the best of PROBE_TRIES runs each (`tries_small` up to SMALL_PROBE tokens), taken
    in rounds over the sizes (so that a slow moment of the machine weighs on one try of each size,
    not on every try of one), after an untimed round over the small sizes. Writes K/V only into
    blocks no request holds yet."""
    bs = runner.block_size
    fits = [n for n in sizes if n <= max_tokens and n <= num_blocks * bs] or [1]
    table = list(range(min(num_blocks, -(-max(fits) // bs))))
    seconds = dict.fromkeys(fits, float("inf"))
    with torch.inference_mode():
        for n in [n for n in fits if n <= SMALL_PROBE] or fits[:1]:  # warm-up
            runner.run([ForwardItem(table, 0, [0] * n)]).logits.sum().item()
        for r in range(max(PROBE_TRIES, tries_small)):
            for n in fits:
                if r >= (tries_small if n <= SMALL_PROBE else PROBE_TRIES):
                    continue
                start = time.perf_counter()
                out = runner.run([ForwardItem(table, 0, [0] * n)])
                out.logits.sum().item()  # wait for the device
                seconds[n] = min(seconds[n], time.perf_counter() - start)
    return seconds


def probe_attention(runner: ModelRunner, num_blocks: int, context: int = 512, rows: int = 8) -> tuple[float, float]:
    """Seconds one new token adds per token of context it attends to, (hot, cold): `rows`
    one-token items after `context` cached tokens against as many after none (the best of two
    each; several rows, so that the difference stands out of the noise). Hot: the rows share one
    request's blocks, read from the cache after the first (what a draft tree's further nodes
    cost); cold: each row reads blocks of its own from memory, as each request's first row does
    (on the bundled model at batch 8: 1.23-1.27 and 2.75-3.7 us a token). The cached K/V need no
    meaning, only to be memory that reading costs what reading a request's does: the blocks no
    request holds yet are written with zeros first (untouched pages would all read one shared zero
    page). Cold with fewer rows where the cache holds fewer tables of their own; 0 where it is too
    small to tell."""
    bs = runner.block_size
    context = min(context, num_blocks * bs - 1)
    if context < 64:
        return 0.0, 0.0
    per_row = -(-(context + 1) // bs)
    own = max(1, min(rows, num_blocks // per_row))
    layouts = {"hot": [list(range(per_row))] * rows, "cold": [list(range(r * per_row, (r + 1) * per_row)) for r in range(own)]}
    best: dict[tuple[str, int], float] = {}
    with torch.inference_mode():
        for k_cache, v_cache in runner.kv_cache:
            k_cache[: own * per_row].zero_()
            v_cache[: own * per_row].zero_()
        for _ in range(2):  # in turn, as many forwards as one layout's best of four took
            for name, tables in layouts.items():
                for start in (0, context):
                    t = time.perf_counter()
                    runner.run([ForwardItem(table, start, [0]) for table in tables]).logits.sum().item()
                    best[name, start] = min(best.get((name, start), float("inf")), time.perf_counter() - t)
    hot = max(0.0, (best["hot", context] - best["hot", 0]) / (rows * context))
    cold = max(0.0, (best["cold", context] - best["cold", 0]) / (own * context))
    return hot, cold


@dataclasses.dataclass(frozen=True)
class ForwardCosts:
    """What the probes measured: seconds of a forward by number of new tokens, and the seconds a new
    token adds per token of context it attends to, read hot and cold (probe_attention)."""

    seconds: dict[int, float]
    hot: float
    cold: float


# A forward's cost by size belongs to the machine, the model's shapes, kernels and memory (whether
# its weights lie in one 2 MB-page arena: `probe_key` counts their storages) and the cache's
# layout, not to a run: probing it took 6.3 s of the 1.5B's start on a 2-core Xeon (a third of the
# default's 19 s, issue 24's target being 2x llama-server's ~1.5 s). So it is kept
# (cache_root()/forward-probes.json, under a key of all of those) and, on a later start, checked
# before it is used: CHECK_SIZES probed again (the best of CHECK_TRIES after a warm-up: 0.5 s on the
# 1.5B). A busy moment only ever slows a measurement, and the same VM's checks at start ran from
# -10% to +41% of what was kept: a check slower than the kept costs by up to CHECK_SLOWER is taken
# for noise (probing again in it would keep a worse profile); one faster by more than CHECK_FASTER
# means the kept costs were taken in a slow moment, or the machine changed, and everything is
# probed again and kept anew. A check that passes changes nothing kept: lowering only the checked
# sizes to the least seen bent the profile's shape (the bundled model's kept 1-token forward fell
# below its 2-token one, a first draft node priced below nothing). What is kept sets the shape of
# the controller's cost model; its scale is fitted online to the steps as they are timed.
CHECK_SIZES = (1, 9)
CHECK_TRIES = 3
CHECK_FASTER = 0.10
CHECK_SLOWER = 0.50


def probe_key(runner: ModelRunner, max_tokens: int, context: int = 512) -> str:
    """The probes' key: the machine (CPU, flags, threads, PyTorch), the model's modules and kernels
    (every tensor's shape and type, each kernel's variant, types and prefetch policy), the KV cache's
    layout and attention, the largest forward, the attention probe's context, and what the probes
    measure."""
    model = runner.model
    modules = [(type(m).__name__, {a: repr(getattr(m, a)) for a in ("isa", "types", "prefetch") if hasattr(m, a)})
               for m in model.modules()]
    held = weights(model)
    tensors = [(tuple(t.shape), str(t.dtype)) for t in held]
    storages = len({t.untyped_storage().data_ptr() for t in held})  # one arena of 2 MB pages, or each its own
    k_cache = runner.kv_cache[0][0]
    described = {
        "machine": machine_key(runner.device), "modules": modules, "tensors": tensors, "storages": storages,
        "kv": (runner.block_size, str(k_cache.dtype), tuple(k_cache.shape[1:]), len(runner.kv_cache)),
        "attention": type(runner.attention).__name__, "max_tokens": max_tokens, "context": context,
        "probes": (PROBE_SIZES, PROBE_TRIES, PROBE_TRIES_SMALL, SMALL_PROBE),
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()


class ProbeCache:
    """ForwardCosts kept by probe_key in one JSON file (written whole, merged with what other
    processes wrote meanwhile); a file that cannot be read or written is no cache."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path if path is not None else cache_root() / "forward-probes.json"

    def recall(self, key: str) -> ForwardCosts | None:
        entry = read_kept(self.path).get(key)
        try:
            seconds = sorted((int(n), float(s)) for n, s in entry["seconds"].items())
            return ForwardCosts(dict(seconds), float(entry["hot"]), float(entry["cold"]))
        except (TypeError, KeyError, ValueError, AttributeError):
            return None

    def remember(self, key: str, costs: ForwardCosts) -> None:
        entry = {"seconds": {str(n): s for n, s in costs.seconds.items()}, "hot": costs.hot, "cold": costs.cold,
                 "when": time.strftime("%Y-%m-%d %H:%M:%S")}
        try:
            keep(self.path, {key: entry})
        except OSError as e:
            logger.warning("could not keep the forward probes in %s: %s", self.path, e)


def forward_costs(runner: ModelRunner, num_blocks: int, max_tokens: int, context: int,
                  cache: ProbeCache) -> tuple[ForwardCosts, str]:
    """The forward's costs on this machine, forwards up to `max_tokens` and attention after `context`
    cached tokens, and how they were had ("probed", or "kept" after the check): from `cache` where
    it holds them for `probe_key` and they pass the check, else probed (and kept)."""
    key = probe_key(runner, max_tokens, context)
    kept = cache.recall(key)
    if kept is not None:
        now = probe_forward(runner, num_blocks, max_tokens, sizes=CHECK_SIZES, tries_small=CHECK_TRIES)
        drift = {n: now[n] / kept.seconds[n] - 1.0 for n in now if n in kept.seconds and kept.seconds[n] > 0}
        if drift and all(-CHECK_FASTER <= d <= CHECK_SLOWER for d in drift.values()):
            return kept, "kept, checked: " + ", ".join(f"{n} tokens {d:+.0%}" for n, d in drift.items())
        logger.info("forward probes: the kept ones are off by %s; probing again",
                    ", ".join(f"{d:+.0%} at {n} tokens" for n, d in drift.items()) or "their sizes")
    seconds = probe_forward(runner, num_blocks, max_tokens)
    hot, cold = probe_attention(runner, num_blocks, context)
    costs = ForwardCosts(seconds, hot, cold)
    cache.remember(key, costs)
    return costs, "probed"


def build_speculator(
    spec: SpeculativeConfig, config: EngineConfig, runner: ModelRunner, tokenizer: Any | None,
    draft_builder: DraftBuilder | None, probe_cache: ProbeCache,
) -> Speculator:
    device = torch.device(config.device)
    sampler = Sampler(device, config.seed)
    verifier = Verifier(sampler.generator)
    if not spec.enabled:
        return Speculator({}, sampler, verifier, 0, FixedController())
    mc = runner.model.config
    target = ModelHandle(runner.run, mc.vocab_size, mc.num_layers, device, module=runner.model)
    draft = _draft_model(spec, config, draft_builder) if "draft-model" in spec.drafters else None
    drafters = build_drafters(spec, target, config.seed, draft, tokenizer)
    guard = None  # fixed grants are the baseline: nothing overrides them
    if spec.controller == "fixed":
        controller: Controller = FixedController()
    else:
        num_blocks = runner.kv_cache[0][0].shape[0]
        max_tokens = min(config.scheduler.max_num_batched_tokens, config.max_model_len)
        costs, how = forward_costs(runner, num_blocks, max_tokens, min(512, config.max_model_len - 1), probe_cache)
        logger.info("forward time by tokens (%s): %s; attention %.2f us per token of context a request reads, %.2f a "
                    "further row of it", how, {n: f"{s * 1e3:.1f} ms" for n, s in costs.seconds.items()},
                    costs.cold * 1e6, costs.hot * 1e6)
        slo = None if spec.latency_slo_ms is None else spec.latency_slo_ms / 1000.0
        model = StepCostModel(ForwardProfile(costs.seconds), per_attended=costs.hot, per_context=costs.cold)
        controller = GoodputController(model, latency_slo=slo,
                                       latency_slack=spec.latency_slack, pace_slack=spec.pace_slack)
        guard = GoodputGuard(LOOKUP_GUARD, per_drafter={n: MODEL_GUARD for n, d in drafters.items() if d.runs_a_model})
    return Speculator(drafters, sampler, verifier, spec.num_tokens, controller, guard=guard)


def _draft_model(spec: SpeculativeConfig, config: EngineConfig, draft_builder: DraftBuilder | None) -> ModelHandle:
    if draft_builder is None:
        raise ValueError("draft_model: this engine was built without a way to load a draft model")
    assert spec.draft_model is not None
    device = torch.device(config.device)
    # The draft sees the same positions as the target: its RoPE table must cover the target's context
    # (build_model names max_model_len if the draft model cannot).
    model, tokenizer = draft_builder(spec.draft_model, config.max_model_len, spec.draft_quantization, spec.draft_vocab)
    bs = config.cache.block_size
    kv_dtype = config.cache.dtype or config.dtype
    num_blocks = max(16, config.cache.kv_cache_bytes // 4 // kv_bytes_per_block(model, bs, kv_dtype))
    mc = model.config
    attention = make_backend(config.attention_backend, device, mc.num_heads, mc.num_kv_heads, mc.head_dim, kv_dtype)
    kv = allocate_kv_cache(model, num_blocks, bs, kv_dtype, device)
    runner = ModelRunner(model, kv, bs, device, attention)
    pool = BlockPool(BlockManager(num_blocks, bs, enable_prefix_caching=False))
    return ModelHandle(runner.run, mc.vocab_size, mc.num_layers, device, kv=pool, tokenizer=tokenizer)

