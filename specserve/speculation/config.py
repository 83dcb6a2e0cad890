"""Speculative decoding options."""

from __future__ import annotations

from dataclasses import dataclass

SPEC_METHODS = ("none", "auto", "ngram", "suffix", "recycling", "draft-model", "layer-skip", "eagle")
# What `auto` chooses among, per request: the drafters that cost a lookup, not a forward (and the
# draft model, where one is given: `SpeculativeConfig.drafters`). Not recycling: its learning (the
# target's top-8 at every verified row, every step or every 4th) and asking cost more than its trees
# gave. On the bundled model, `auto` without it against `auto` with it: ShareGPT batch 1 1.06x,
# batch 4 ~1.05x, HumanEval batch 1 ~1.05x, batch 4 1.02x; Spec-Bench batch 1 0.99x and the 1.5B
# with its draft model on ShareGPT 1.01x, within those runs' noise (BENCHMARKS.md, session 30).
# `--spec recycling` and `suffix+recycling` still run it. Not ngram either: beside suffix, whose
# per-request index already holds every match ngram finds, its trees were verified where suffix had
# none and lost to it where both had one (on the bundled model's Spec-Bench at batch 1, 3.2 nodes for
# 0.60 accepted against suffix's 2.5 for 1.33); `auto` without it against `auto`, A B B A: Spec-Bench
# batch 1 1.04x, ShareGPT batch 8 1.02x, HumanEval batch 1 1.01x and batch 4 0.99x, the 1.5B with
# its draft model 1.00x (Spec-Bench) and 0.99x (code editing); against ngram alone 1.00x where it
# was the best fixed drafter. Served at 0.25 req/s, a 14-token request alone verified 54 rejected
# nodes under suffix and ngram (p99 TPOT 1.25x `none`'s) and 8 under suffix alone (BENCHMARKS.md,
# session 39). `--spec ngram` and `suffix+ngram` still run it.
AUTO_METHODS = ("suffix",)
CONTROLLERS = ("goodput", "fixed")
# How a GGUF draft model run on its own blocks keeps its projections: rounded to Q4_0 where stored
# in more bits, or as stored (SpeculativeConfig.draft_quantization).
DRAFT_QUANTIZATIONS = ("q4_0", "file")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Which drafter, and how many draft tokens per request per step.

    method: none | auto | ngram | suffix | recycling | draft-model | layer-skip | eagle, or several joined
        by "+" (e.g. "suffix+recycling"): their trees are merged, earlier methods first. `auto`
        keeps suffix (and the draft model, given draft_model) side by side and drafts each
        request with the one whose measured acceptance pays best for it; the lookup is asked
        first, and the model is not run where it proposes text worth more.
    num_tokens: the most draft tokens (tree nodes) a decoding request may get per step (K);
        0 = plain decoding
    controller: goodput (each step, the draft nodes whose expected tokens pay for their measured
        cost, 0 included) | fixed (always K, the baseline)
    width: tree width for `ngram` (up to this many distinct continuations as branches); the
        other drafters choose their own tree shapes (recycling, suffix) or draft chains (models)
    draft_model: model for `draft-model` (alias, .gguf or HF directory); must share the tokenizer;
        for `eagle`, the head's directory (None: the head shipped for the model, if there is one).
        "auto" (the command line's default): for `auto` and `draft-model`, a smaller model of the
        target's family among the user's GGUF files, if any (`specserve.model.drafts`); else None
    draft_quantization: for a GGUF draft model run on its own blocks, q4_0 (projections stored in
        more bits, such as the Q5_0, Q6_K and Q8_0 of a small model's Q4_K_M file, rounded to Q4_0 at
        load: a draft token reads fewer bytes; verification keeps the output exact) | file (as stored)
    draft_window: how many of a prompt's last tokens a draft model reads (None: the whole prompt);
        it follows everything generated after them. A long prompt read whole costs the draft more
        than its drafts save on a short answer (BENCHMARKS.md, session 22)
    draft_vocab: the tokens a draft model's LM head reads out: the first this many token ids and
        the tokenizer's added tokens (end-of-turn and the like) at the end of the vocabulary (FR-Spec;
        byte-level BPE ids run roughly from frequent to rare); the rest are never proposed. A draft
        token reads fewer bytes (the 0.5B Qwen2.5-Coder's head: 32,768 of 151,936 rows); the target
        verifies every token, so the output is unchanged. None: the whole vocabulary. GGUF and float
        heads are cut; others read every row
    draft_layers: how many of the target's first layers `layer-skip` drafts with (None: the
        measured default for the model, else half the layers)
    latency_slo_ms: with the goodput controller, the inter-token latency (ms) speculation may take
        any request to: a step's drafts are cut until every request's expected time per token is
        within it (or within the plain step's time, where plain decoding already misses it); None:
        throughput alone decides
    latency_slack: with the goodput controller, how much longer than the plain step a request's
        expected time per token may be made (0.25: 25%); with latency_slo_ms too, the larger bound
        holds. None: no bound relative to the plain step (beyond latency_slo_ms's)
    pace_slack: with the goodput controller, protect requests behind plain decoding's pace (their
        tokens so far slower than plain steps would have given them): while one is in the batch, a
        step's drafts are cut until it expects its tokens within (1 + F) x the plain step's time.
        None: off. Default 0.5, from a served ShareGPT sweep (BENCHMARKS.md, session 9)
    """

    method: str = "none"
    num_tokens: int = 8
    controller: str = "goodput"
    width: int = 1
    draft_model: str | None = None
    draft_layers: int | None = None
    draft_quantization: str = "q4_0"
    draft_window: int | None = 256
    draft_vocab: int | None = 32768
    draft_stop_below: float = 0.0  # model drafters end a chain once their own pick's probability is below this
    latency_slo_ms: float | None = None
    latency_slack: float | None = None
    pace_slack: float | None = 0.5

    def __post_init__(self) -> None:
        for part in self.methods:
            if part not in SPEC_METHODS or (part in ("none", "auto") and len(self.methods) > 1):
                raise ValueError(f"spec: unknown method {part!r}; choose one of {', '.join(SPEC_METHODS)}, "
                                 "or several joined by '+'")
        if self.controller not in CONTROLLERS:
            raise ValueError(f"spec_controller: must be one of {', '.join(CONTROLLERS)}, got {self.controller!r}")
        if self.num_tokens < 0:
            raise ValueError(f"spec_tokens: must be >= 0, got {self.num_tokens}")
        if self.width < 1:
            raise ValueError(f"spec_width: must be >= 1, got {self.width}")
        if "draft-model" in self.methods and not self.draft_model:
            raise ValueError("draft_model: --spec draft-model needs --draft-model PATH")
        if self.draft_quantization not in DRAFT_QUANTIZATIONS:
            raise ValueError(f"draft_quantization: must be one of {', '.join(DRAFT_QUANTIZATIONS)}, "
                             f"got {self.draft_quantization!r}")
        if self.draft_window is not None and self.draft_window < 1:
            raise ValueError(f"draft_window: must be >= 1 (or None: the whole prompt), got {self.draft_window}")
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise ValueError(f"draft_vocab: must be >= 1 (or None: the whole vocabulary), got {self.draft_vocab}")
        if not 0.0 <= self.draft_stop_below < 1.0:
            raise ValueError(f"draft_stop_below: must be in [0, 1), got {self.draft_stop_below}")
        if self.width > 1 and "ngram" not in self.drafters:
            raise ValueError(f"spec_width: only the ngram drafter takes a width, got {self.width} for {self.method!r}")
        if self.latency_slo_ms is not None and not self.latency_slo_ms > 0:
            raise ValueError(f"spec_latency_slo: must be > 0 ms, got {self.latency_slo_ms}")
        if self.latency_slack is not None and not self.latency_slack >= 0:
            raise ValueError(f"spec_latency_slack: must be >= 0, got {self.latency_slack}")
        if self.pace_slack is not None and not self.pace_slack >= 0:
            raise ValueError(f"spec_pace_slack: must be >= 0, got {self.pace_slack}")
        if self.draft_layers is not None and self.draft_layers < 1:
            raise ValueError(f"draft_layers: must be >= 1, got {self.draft_layers}")

    @property
    def methods(self) -> tuple[str, ...]:
        return tuple(m.strip() for m in self.method.split("+"))

    @property
    def drafters(self) -> tuple[str, ...]:
        """The drafters to build: `auto`'s set (with the draft model, where one is given), or the
        methods named."""
        if self.method == "auto":
            return AUTO_METHODS + (("draft-model",) if self.draft_model else ())
        return self.methods

    @property
    def enabled(self) -> bool:
        return self.method != "none" and self.num_tokens > 0
