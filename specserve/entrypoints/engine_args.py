"""One definition of the engine's options: `EngineArgs`, its command-line arguments, and the
engine it builds. `generate`, `chat`, `serve` and every `bench` command take their engine
options from here, and `LLM(...)` takes the same names as keyword arguments."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from specserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, parse_dtype
from specserve.model.attention import ATTENTION_BACKENDS
from specserve.model.loader import DEFAULT_MODEL, LOAD_FORMATS
from specserve.model.quant import QUANTIZATIONS
from specserve.speculation.config import CONTROLLERS, DRAFT_QUANTIZATIONS, SPEC_METHODS, SpeculativeConfig

QUANTIZATION_CHOICES = ("auto", *QUANTIZATIONS)
HUGE_PAGES = ("auto", "load", "off")


def speculative_config(speculative: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig:
    if speculative is None:
        return SpeculativeConfig()
    if isinstance(speculative, SpeculativeConfig):
        return speculative
    if isinstance(speculative, str):
        return SpeculativeConfig(method=speculative)
    return SpeculativeConfig(**speculative)


def _off_or_float(text: str) -> float | None:
    """A command-line number, or None for "off"."""
    return None if text.strip().lower() in ("off", "none") else float(text)


# What `--spec` is when the command line does not say: speculation that measures whether it pays
# and drafts nothing where it does not, so a user of `specserve serve/generate` gets it by default.
# `LLM(...)` in Python (EngineArgs itself) keeps plain decoding unless asked, as vLLM's does: it is
# the reference every equivalence test compares speculation with.
CLI_SPEC_DEFAULT = "auto"
# ... and `--draft-model`: a smaller model of the target's family that the user keeps among their
# GGUF files ($SPECSERVE_MODELS), if there is one (`specserve.model.drafts`); `none` for none.
CLI_DRAFT_DEFAULT = "auto"


def _cli_draft_model(name: str | None, spec: str) -> str | None:
    """`--draft-model` as SpeculativeConfig takes it: none is None, and so is the default `auto`
    where the method drafts with no draft model."""
    if name in (None, "", "none"):
        return None
    methods = {m.strip() for m in spec.split("+")}
    if name == CLI_DRAFT_DEFAULT and not methods & {"auto", "draft-model"}:
        return None
    return name


@dataclass(frozen=True)
class EngineArgs:
    """Everything that shapes an engine, with the defaults of `specserve generate/serve` (but
    speculation: the command line's `--spec` defaults to CLI_SPEC_DEFAULT, this class to none).

    quantization: auto | none | int8 | int4 | gguf. auto takes the precision the weights were
        shipped in: on the CPU a GGUF runs on its own blocks (gguf: each tensor its own type, never
        requantized), except one whose projections are all Q4_0/Q4_1 (int4, from its own blocks
        exactly) or Q8_0 (int8); anything else runs the float dtype (none).
    kv_cache_dtype: auto | float32 | bfloat16 | float16. auto: bfloat16 on the CPU with quantized
        weights (half the memory of float32), else the model's dtype.
    attention_backend: auto | sdpa | cpu-paged (auto: the in-place CPU kernel where it builds).
    threads: CPU threads for PyTorch and the native kernels (None: PyTorch's default).
    huge_pages: auto | load | off: where the weights (target's and draft model's) get 2 MB pages on
        the CPU (specserve.model.huge_pages: decoding 1.1-1.2x, a step's weight reads miss the TLB
        512x less). auto: collapsed in place by a thread of their own once the engine is built, while
        it serves (Linux 6.1+; the start as without); load: moved at load into one mapping advised
        for them (the 1.5B's server start 2.6 -> 5.5 s where memory must be compacted first); off:
        4 KB pages. True and False are taken as load and off.
    """

    model: str = DEFAULT_MODEL
    load_format: str = "auto"
    device: str = "cpu"
    dtype: str = "float32"
    quantization: str = "auto"
    attention_backend: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_gb: float = 0.5
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    seed: int = 0
    threads: int | None = None
    huge_pages: str = "auto"
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative", speculative_config(self.speculative))  # accept a name or a dict
        parse_dtype(self.dtype)
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format: {self.load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization: {self.quantization!r} is not one of {', '.join(QUANTIZATION_CHOICES)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend: {self.attention_backend!r} is not one of "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        if self.kv_cache_dtype != "auto":
            parse_dtype(self.kv_cache_dtype)
        if self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb: must be positive, got {self.kv_cache_gb}")
        if isinstance(self.huge_pages, bool):  # LLM(huge_pages=True), as before the modes
            object.__setattr__(self, "huge_pages", "load" if self.huge_pages else "off")
        if self.huge_pages not in HUGE_PAGES:
            raise ValueError(f"huge_pages: {self.huge_pages!r} is not one of {', '.join(HUGE_PAGES)}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads: must be >= 1, got {self.threads}")

    @classmethod
    def from_kwargs(cls, model: str, kwargs: dict[str, Any]) -> "EngineArgs":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"LLM: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return cls(model=model, **kwargs)

    def with_(self, **changes: Any) -> "EngineArgs":
        return replace(self, **changes)

    # -- the command line -------------------------------------------------------------------------

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        d = EngineArgs()
        g = p.add_argument_group("model and engine")
        g.add_argument("--model", default=d.model, help=f"alias, .gguf file or HF directory (default: {d.model})")
        g.add_argument("--load-format", default=d.load_format, choices=LOAD_FORMATS)
        g.add_argument("--device", default=d.device, help="cpu or cuda")
        g.add_argument("--dtype", default=d.dtype, help="float32, bfloat16 or float16 (activations, KV cache)")
        g.add_argument("--quantization", default=d.quantization, choices=QUANTIZATION_CHOICES,
                       help="weight precision: auto = as shipped (a GGUF: its own blocks, gguf; the bundled Q4_1 GGUF: "
                            "int4), none = float")
        g.add_argument("--attention-backend", default=d.attention_backend, choices=ATTENTION_BACKENDS)
        g.add_argument("--max-model-len", type=int, default=d.max_model_len)
        g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
        g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
        g.add_argument("--no-chunked-prefill", action="store_true")
        g.add_argument("--no-prefix-caching", action="store_true")
        g.add_argument("--block-size", type=int, default=d.block_size)
        g.add_argument("--kv-cache-gb", type=float, default=d.kv_cache_gb)
        g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype,
                       help="auto (bfloat16 on CPU with int8/int4 weights, else --dtype), float32, bfloat16, float16")
        g.add_argument("--engine-seed", type=int, default=d.seed,
                       help="seed of the engine's own generator (requests without a seed draw from it)")
        g.add_argument("--threads", type=int, default=d.threads, help="CPU threads (default: PyTorch's choice)")
        g.add_argument("--huge-pages", nargs="?", const="load", default=d.huge_pages, choices=HUGE_PAGES,
                       help="the weights in 2 MB pages (Linux, transparent huge pages not off; decoding 1.1-1.2x): "
                            "auto (default) collapses them in place while the server already serves (Linux 6.1+); "
                            "load (the bare flag) moves them at load, the start slower by the copy (0.4-3 s for a "
                            "1.5B model); off")
        s = p.add_argument_group("speculative decoding")
        spec = d.speculative
        s.add_argument("--spec", default=CLI_SPEC_DEFAULT,
                       help=f"drafter: {', '.join(SPEC_METHODS)}, or several joined by '+' (default: "
                            f"{CLI_SPEC_DEFAULT}: picks per request between suffix and a draft model, given one, and drafts only "
                            f"where it measures drafts paying; none: plain decoding)")
        s.add_argument("--spec-tokens", type=int, default=spec.num_tokens,
                       help="the most draft tokens a request gets per step (K)")
        s.add_argument("--spec-controller", choices=CONTROLLERS, default=spec.controller,
                       help="goodput: per step and request, as many draft tokens as pay for their measured cost "
                            "(0 included); fixed: always K")
        s.add_argument("--spec-width", type=int, default=spec.width, help="tree width where the drafter has one")
        s.add_argument("--draft-model", default=CLI_DRAFT_DEFAULT,
                       help="model for --spec draft-model (same tokenizer); with --spec auto it drafts beside the "
                            f"lookups where it pays (default: {CLI_DRAFT_DEFAULT}: a smaller model of the target's "
                            "family among the GGUF files in $SPECSERVE_MODELS, ~/.cache/specserve-models, if any; "
                            "none: no draft model)")
        s.add_argument("--draft-quantization", choices=DRAFT_QUANTIZATIONS, default=spec.draft_quantization,
                       help="a GGUF draft model's projections: q4_0 (those stored in more bits rounded to Q4_0 at "
                            "load: cheaper draft tokens, output unchanged) or file (as stored)")
        s.add_argument("--draft-window", type=int, default=spec.draft_window or 0,
                       help="how many of a prompt's last tokens a draft model reads before drafting "
                            f"(default: {spec.draft_window}; 0: the whole prompt)")
        s.add_argument("--draft-vocab", type=int, default=spec.draft_vocab or 0,
                       help="a draft model proposes only the first N token ids and the tokenizer's added tokens "
                            f"(its LM head cut to them: cheaper draft tokens, output unchanged; default: "
                            f"{spec.draft_vocab}; 0: the whole vocabulary)")
        s.add_argument("--draft-layers", type=int, default=spec.draft_layers, help="layers for --spec layer-skip")
        s.add_argument("--draft-stop-below", type=float, default=spec.draft_stop_below,
                       help="model drafters stop a chain when their pick's probability is below this")
        s.add_argument("--spec-latency-slo", type=float, default=spec.latency_slo_ms, metavar="MS",
                       help="inter-token latency (ms) drafts may take any request to (default: none; "
                            "throughput decides): a step's drafts are cut until every request's expected "
                            "time per token is within it, or within plain decoding's where that misses it")
        s.add_argument("--spec-latency-slack", type=float, default=spec.latency_slack, metavar="F",
                       help="how much longer than a plain step drafts may make any request's expected time "
                            "per token (0.25: 25%%; default: no such bound)")
        s.add_argument("--spec-pace-slack", type=_off_or_float, default=spec.pace_slack, metavar="F|off",
                       help="protect requests behind plain decoding's pace: while one is in the batch, drafts are "
                            f"cut until it expects its tokens within (1 + F) x a plain step (default: {spec.pace_slack})")

    @classmethod
    def from_cli(cls, a: argparse.Namespace) -> "EngineArgs":
        return cls(
            model=a.model, load_format=a.load_format, device=a.device, dtype=a.dtype, quantization=a.quantization,
            attention_backend=a.attention_backend, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=a.max_num_batched_tokens, enable_chunked_prefill=not a.no_chunked_prefill,
            block_size=a.block_size, kv_cache_gb=a.kv_cache_gb, kv_cache_dtype=a.kv_cache_dtype,
            enable_prefix_caching=not a.no_prefix_caching,
            seed=a.engine_seed, threads=a.threads, huge_pages=a.huge_pages,
            speculative=SpeculativeConfig(method=a.spec, num_tokens=a.spec_tokens, controller=a.spec_controller,
                                          width=a.spec_width, draft_layers=a.draft_layers,
                                          draft_model=_cli_draft_model(a.draft_model, a.spec),
                                          draft_quantization=a.draft_quantization,
                                          draft_window=a.draft_window or None, draft_vocab=a.draft_vocab or None,
                                          draft_stop_below=a.draft_stop_below, latency_slo_ms=a.spec_latency_slo,
                                          latency_slack=a.spec_latency_slack, pace_slack=a.spec_pace_slack),
        )

    # -- what it builds ---------------------------------------------------------------------------

    def kv_dtype(self, precision: str) -> torch.dtype:
        """The KV cache dtype, given the weights' resolved precision."""
        if self.kv_cache_dtype != "auto":
            return parse_dtype(self.kv_cache_dtype)
        if self.device == "cpu" and precision in ("int8", "int4", "gguf"):
            return torch.bfloat16
        return parse_dtype(self.dtype)

    def engine_config(self, model: ModelConfig, max_model_len: int, precision: str = "none") -> EngineConfig:
        return EngineConfig(
            model=model,
            cache=CacheConfig(block_size=self.block_size, num_blocks=self.num_kv_blocks,
                              kv_cache_bytes=int(self.kv_cache_gb * (1 << 30)),
                              enable_prefix_caching=self.enable_prefix_caching, dtype=self.kv_dtype(precision)),
            scheduler=SchedulerConfig(max_num_batched_tokens=self.max_num_batched_tokens,
                                      max_num_seqs=self.max_num_seqs,
                                      enable_chunked_prefill=self.enable_chunked_prefill),
            max_model_len=max_model_len,
            device=self.device,
            dtype=parse_dtype(self.dtype),
            seed=self.seed,
            attention_backend=self.attention_backend,
        )
