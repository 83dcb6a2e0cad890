"""Build the drafters a SpeculativeConfig names, from handles on the target (and a draft model)
that the engine passes down: a forward to call, a vocabulary size, a layer count. Nothing here
imports the engine."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from specserve.model.forward import Forward
from specserve.speculation.config import SpeculativeConfig
from specserve.speculation.drafter import Drafter
from specserve.speculation.drafters.model_based import PagedKV

# Layers the layer-skip drafter uses for a known model when none is given, chosen by measurement
# (BENCHMARKS.md); `with_model_defaults` fills them in.
DEFAULT_DRAFT_LAYERS = {"smollm2-135m": 24}
# Draft heads shipped with the package (specserve/heads/<name>), by the model alias they were trained for.
BUNDLED_HEADS = {"smollm2-135m": "smollm2-135m"}


def bundled_head(model: str) -> str | None:
    """The directory of the head shipped for `model`, if one is."""
    name = BUNDLED_HEADS.get(model)
    if name is None:
        return None
    from importlib.resources import files

    path = files("specserve") / "heads" / name
    return str(path) if path.joinpath("config.json").is_file() else None


def with_model_defaults(spec: SpeculativeConfig, model: str) -> SpeculativeConfig:
    """`spec` with the measured per-model defaults filled in where the user gave none."""
    if "layer-skip" in spec.drafters and spec.draft_layers is None and model in DEFAULT_DRAFT_LAYERS:
        spec = replace(spec, draft_layers=DEFAULT_DRAFT_LAYERS[model])
    if "eagle" in spec.drafters and spec.draft_model is None and bundled_head(model) is not None:
        spec = replace(spec, draft_model=bundled_head(model))
    return spec


def default_draft_layers(num_layers: int) -> int:
    return max(1, num_layers // 2)


@dataclass(frozen=True)
class ModelHandle:
    """A model as drafters see it: its forward over the engine's flat batches, and its shape.
    For the target, `kv` is None (drafters that run it write into the target's own cache); a
    draft model brings a paged cache of its own, and its tokenizer for the vocabulary check."""

    forward: Forward
    vocab_size: int
    num_layers: int
    device: torch.device
    kv: PagedKV | None = None
    tokenizer: Any | None = None
    module: Any | None = None  # the target's LlamaForCausalLM, for heads that read its embedding and LM head


def build_drafters(
    spec: SpeculativeConfig, target: ModelHandle, seed: int, draft: ModelHandle | None = None,
    target_tokenizer: Any | None = None,
) -> dict[str, Drafter]:
    """The drafters to choose among, by name: one (several joined by '+' are merged into one
    hybrid), or `auto`'s set, each its own."""
    if spec.method == "auto":
        return {m: _build_one(m, spec, target, seed, draft, target_tokenizer) for m in spec.drafters}
    if len(spec.methods) > 1:
        from specserve.speculation.drafters.hybrid import HybridDrafter

        return {spec.method: HybridDrafter(
            [_build_one(m, spec, target, seed, draft, target_tokenizer) for m in spec.methods]
        )}
    return {spec.method: _build_one(spec.method, spec, target, seed, draft, target_tokenizer)}


def _build_one(
    method: str, spec: SpeculativeConfig, target: ModelHandle, seed: int, draft: ModelHandle | None,
    target_tokenizer: Any | None,
) -> Drafter:
    gen = torch.Generator(device=target.device)
    gen.manual_seed(seed + 1)
    if method == "ngram":
        from specserve.speculation.drafters.ngram import NgramDrafter

        return NgramDrafter(max_width=spec.width)
    if method == "suffix":
        from specserve.speculation.drafters.suffix import SuffixDrafter

        return SuffixDrafter()
    if method == "recycling":
        from specserve.speculation.drafters.recycling import RecyclingDrafter

        return RecyclingDrafter(vocab_size=target.vocab_size, topk=min(8, target.vocab_size))
    if method == "layer-skip":
        from specserve.speculation.drafters.model_based import LayerSkipDrafter

        total = target.num_layers
        layers = spec.draft_layers or default_draft_layers(total)
        if not 1 <= layers < total:
            raise ValueError(f"draft_layers: must be between 1 and {total - 1} for this model, got {layers}")
        return LayerSkipDrafter(target.forward, gen, layers, spec.draft_stop_below)
    if method == "draft-model":
        from specserve.speculation.drafters.model_based import DraftModelDrafter, check_same_tokenizer

        if draft is None or draft.kv is None:
            raise ValueError("draft_model: this engine was built without a way to load a draft model")
        check_same_tokenizer(target_tokenizer, draft.tokenizer)
        if draft.vocab_size != target.vocab_size:
            raise ValueError(
                f"draft_model: vocabulary size {draft.vocab_size} differs from the target's {target.vocab_size}"
            )
        return DraftModelDrafter(draft.forward, draft.kv, gen, spec.draft_stop_below, spec.draft_window)
    if method == "eagle":
        return _eagle(spec, target, gen)
    raise ValueError(f"spec: no drafter for method {method!r}")


def _eagle(spec: SpeculativeConfig, target: ModelHandle, gen: torch.Generator) -> Drafter:
    from specserve.model.eagle import lm_head_rows, load_head
    from specserve.model.llama import Linear
    from specserve.model.quant import prepare_linears, q8_0_candidates
    from specserve.model.tuning import KernelTuner
    from specserve.speculation.drafters.eagle import EagleDrafter

    if spec.draft_model is None:
        raise ValueError("draft_model: --spec eagle needs a draft head: --draft-model DIR (one that "
                         "`specserve train-drafter` wrote, or an EAGLE-1/2 checkpoint); none ships for this model")
    if target.module is None:
        raise ValueError("draft_model: this engine gives drafters no access to the target's weights")
    model = target.module
    cfg = model.config
    head = load_head(spec.draft_model, cfg.rope_theta, cfg.rope_scaling)
    head.config.check_fits(cfg)
    # The embedding as the target looks tokens up (a GGUF table dequantizes only the rows asked
    # for), and only the LM head's rows the head reads out: no dense copy of either (for a 150k
    # vocabulary each would be about 1 GB in float32).
    device = model.norm.weight.device
    head = head.to(device=device, dtype=torch.float32)
    if int(head.vocab_ids.max()) >= cfg.vocab_size:
        raise ValueError("draft_model: the head's vocabulary ids exceed the target's vocabulary")
    readout = Linear(cfg.hidden_size, head.config.draft_vocab_size)
    readout.weight = torch.nn.Parameter(lm_head_rows(model, head.vocab_ids).contiguous(), requires_grad=False)
    # Drafting runs a few rows at a time: on the CPU, int8 kernels read a quarter of the bytes that
    # dense fp32 would, per depth; the head's weights as Q8_0 blocks may also run on the GGUF
    # kernels (sixteen rows to a vector with VNNI: on a Zen 4 the head's MLP at 2-3x the per-row
    # int8 kernel's speed); the timing chooses.
    cpu = device.type == "cpu"
    precision = "int8" if cpu else "none"
    more = q8_0_candidates if cpu else None
    tuner = KernelTuner(device)
    prepare_linears(head, precision, tuner.choose, more=more)
    prepare_linears(readout, precision, tuner.choose, more=more)
    tuner.choose_prefetch(head, readout)  # where the timing took the GGUF kernels for them
    return EagleDrafter(head, model.embed_tokens, cfg.vocab_size, readout, gen, max_depth=max(1, spec.num_tokens))
