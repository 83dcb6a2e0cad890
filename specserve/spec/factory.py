"""Build the drafter a SpecConfig names, wired to the engine's model, cache and tokenizer."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

import torch

from specserve.spec.config import SpecConfig
from specserve.spec.drafter import Drafter

if TYPE_CHECKING:
    from specserve.engine.engine import LLMEngine
    from specserve.model.llama import LlamaForCausalLM

# Loads a draft model by name for a target context length: (model, tokenizer).
DraftBuilder = Callable[[str, int], "tuple[LlamaForCausalLM, Any]"]

# Layers the layer-skip drafter uses for a known model when none is given, chosen by measurement
# (BENCHMARKS.md); `with_model_defaults` fills them in.
DEFAULT_DRAFT_LAYERS = {"smollm2-135m": 24}


def with_model_defaults(spec: SpecConfig, model: str) -> SpecConfig:
    """`spec` with the measured per-model defaults filled in where the user gave none."""
    if "layer-skip" in spec.methods and spec.draft_layers is None and model in DEFAULT_DRAFT_LAYERS:
        return replace(spec, draft_layers=DEFAULT_DRAFT_LAYERS[model])
    return spec


def default_draft_layers(num_layers: int) -> int:
    return max(1, num_layers // 2)


def build_drafter(spec: SpecConfig, engine: "LLMEngine", draft_builder: DraftBuilder | None = None) -> Drafter:
    if len(spec.methods) > 1:
        from specserve.spec.drafters.hybrid import HybridDrafter

        return HybridDrafter([_build_one(m, spec, engine, draft_builder) for m in spec.methods])
    return _build_one(spec.method, spec, engine, draft_builder)


def _build_one(method: str, spec: SpecConfig, engine: "LLMEngine", draft_builder: DraftBuilder | None) -> Drafter:
    gen = torch.Generator(device=engine.device)
    gen.manual_seed(engine.config.seed + 1)
    if method == "ngram":
        from specserve.spec.drafters.ngram import NgramDrafter

        return NgramDrafter(max_width=spec.width)
    if method == "suffix":
        from specserve.spec.drafters.suffix import SuffixDrafter

        return SuffixDrafter()
    if method == "recycling":
        from specserve.spec.drafters.recycling import RecyclingDrafter

        vocab = engine.model.config.vocab_size
        return RecyclingDrafter(vocab_size=vocab, topk=min(8, vocab))
    if method == "layer-skip":
        from specserve.spec.drafters.model_based import LayerSkipDrafter

        total = engine.model.config.num_layers
        layers = spec.draft_layers or default_draft_layers(total)
        if not 1 <= layers < total:
            raise ValueError(f"draft_layers: must be between 1 and {total - 1} for this model, got {layers}")
        return LayerSkipDrafter(engine.runner, gen, layers, spec.draft_stop_below)
    if method == "draft-model":
        if draft_builder is None:
            raise ValueError("draft_model: this engine was built without a way to load a draft model")
        return _draft_model(spec, engine, gen, draft_builder)
    raise ValueError(f"spec: no drafter for method {method!r}")


def _draft_model(spec: SpecConfig, engine: "LLMEngine", gen: torch.Generator, draft_builder: DraftBuilder) -> Drafter:
    from specserve.engine.block_manager import BlockManager
    from specserve.engine.model_runner import ModelRunner, allocate_kv_cache, kv_bytes_per_block
    from specserve.model.attention import make_backend
    from specserve.spec.drafters.model_based import DraftModelDrafter, check_same_tokenizer

    assert spec.draft_model is not None
    cfg = engine.config
    # The draft sees the same positions as the target: its RoPE table must cover the target's context
    # (build_model names max_model_len if the draft model cannot).
    model, tokenizer = draft_builder(spec.draft_model, cfg.max_model_len)
    check_same_tokenizer(engine.tokenizer, tokenizer)
    if model.config.vocab_size != engine.model.config.vocab_size:
        raise ValueError(
            f"draft_model: vocabulary size {model.config.vocab_size} differs from the target's "
            f"{engine.model.config.vocab_size}"
        )
    bs = cfg.cache.block_size
    kv_dtype = cfg.cache.dtype or cfg.dtype
    num_blocks = max(16, cfg.cache.kv_cache_bytes // 4 // kv_bytes_per_block(model, bs, kv_dtype))
    mc = model.config
    attention = make_backend(cfg.attention_backend, engine.device, mc.num_heads, mc.num_kv_heads, mc.head_dim,
                             kv_dtype)
    kv = allocate_kv_cache(model, num_blocks, bs, kv_dtype, engine.device)
    runner = ModelRunner(model, kv, bs, engine.device, attention)
    return DraftModelDrafter(runner, BlockManager(num_blocks, bs, enable_prefix_caching=False), gen, spec.draft_stop_below)
