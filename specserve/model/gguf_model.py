"""A GGUF model run on its own blocks (`--quantization gguf`, what `auto` picks for a GGUF on the CPU).

Nothing is dequantized and requantized: every projection multiplies the file's tensors as they
are (Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1, and Q5_0 as the Q8_0 blocks that hold its numbers exactly;
a fused q/k/v or gate/up keeps each part's own type),
the embedding dequantizes only the rows it looks up, and the LM head is the file's output tensor
(or the embedding's, when tied). Weights stay in the file's mapping; only norms and biases are
copied out. Llama-architecture files store Q and K rows permuted for llama.cpp's rotary layout:
those two tensors are put back in row order (a copy of their blocks, not a requantization).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.model.file_cache import entry_dir, mark_used
from specserve.model.gguf_file import CONVERTED, GGML_TYPES, QUANTIZED, GGUFError, GGUFFile, StringArray
from specserve.model.quant import KernelFactory, gguf_candidates

logger = logging.getLogger("specserve.model")

ARCHITECTURES = ("llama", "qwen2")

_Q4_0 = 2  # ggml's type id

Chooser = Callable[[str, tuple[int, int], torch.dtype, dict[str, KernelFactory]], tuple[str, nn.Module]]


def gguf_config(g: GGUFFile) -> ModelConfig:
    """The model's shape from the file's metadata."""
    arch = g.require("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"model: {g.path}: GGUF architecture {arch!r} is not supported ({', '.join(ARCHITECTURES)})")
    n_head = int(g.require(f"{arch}.attention.head_count"))
    hidden = int(g.require(f"{arch}.embedding_length"))
    vocab = g.tensor("token_embd.weight").shape[0]
    rope_scaling: dict[str, Any] | None = None
    if g.get(f"{arch}.rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(g.require(f"{arch}.rope.scaling.factor"))}
    eos = g.get("tokenizer.ggml.eos_token_id")
    tokens = g.get("tokenizer.ggml.tokens")
    if isinstance(tokens, StringArray) and tokens.count > vocab:
        vocab = tokens.count
    hf = {
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(g.require(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(g.require(f"{arch}.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(g.get(f"{arch}.attention.head_count_kv", n_head)),
        "head_dim": int(g.get(f"{arch}.rope.dimension_count", hidden // n_head)),
        "rms_norm_eps": float(g.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(g.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(g.get(f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "attention_bias": "blk.0.attn_q.bias" in g.tensors,
        "bos_token_id": g.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": None if eos is None else int(eos),
    }
    return ModelConfig.from_hf_dict(hf)


KEEP_TOKENIZERS = 32  # converted tokenizers kept, the most recently used (a few MB each)


def gguf_tokenizer_dir(path: Path) -> Path:
    """A directory with the file's tokenizer (converted by transformers, once per file: about 20 s
    for a 150k vocabulary; later starts read the cached conversion) and its config.json."""
    target = entry_dir("gguf-tokenizers", path, "tok3")
    if (target / "config.json").is_file():
        mark_used(target, KEEP_TOKENIZERS)
        return target
    from transformers import AutoTokenizer

    logger.warning("converting the tokenizer of %s (once per file; later starts use %s)", path.name, target)
    start = time.perf_counter()
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(tmp))
    # With its added tokens in tokenizer_config.json, a later load does not parse tokenizer.json in
    # Python to find them (0.4 s for a 151k vocabulary) besides the tokenizers library's own parse.
    config_path = tmp / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["added_tokens_decoder"] = {
        str(i): {"content": t.content, "lstrip": t.lstrip, "rstrip": t.rstrip, "normalized": t.normalized,
                 "single_word": t.single_word, "special": t.special}
        for i, t in sorted(tokenizer.added_tokens_decoder.items())}
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (tmp / "config.json").write_text(json.dumps(gguf_config(GGUFFile(path)).to_hf_dict(), indent=2))
    try:
        tmp.rename(target)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    mark_used(target, KEEP_TOKENIZERS)
    logger.warning("tokenizer converted in %.1f s", time.perf_counter() - start)
    return target


class GGUFEmbedding(nn.Module):
    """An embedding table kept in the file's blocks; a lookup dequantizes only the rows it needs."""

    def __init__(self, blocks: torch.Tensor, type_id: int, dim: int) -> None:
        super().__init__()
        self.blocks = blocks
        self.type_id = type_id
        self.embedding_dim = dim
        self.num_embeddings = blocks.shape[0]

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "GGUFEmbedding":
        """As nn.Module's, over the blocks too (an attribute, not a buffer: see GGUFLinearKernel._apply)."""
        self.blocks = fn(self.blocks)
        return super()._apply(fn, recurse)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.specserve.gguf_embedding(ids, self.blocks, self.type_id, self.embedding_dim)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table as float32 (a copy, made on each access: for drafters that need the
        dense table, such as a learned head's inputs)."""
        return torch.ops.specserve.gguf_dequantize(self.blocks, self.type_id, self.embedding_dim)


def _unpermute_rows(blocks: torch.Tensor, n_head: int) -> torch.Tensor:
    """Q/K rows of a llama-architecture GGUF back in the order of the Hugging Face layout (llama.cpp's
    converter interleaves the two halves of every head for its rotary embedding)."""
    rows = blocks.shape[0]
    return blocks.reshape(n_head, rows // n_head // 2, 2, *blocks.shape[1:]).swapaxes(1, 2).reshape(blocks.shape)


# Engine projection -> the GGUF tensors whose rows it stacks, in order.
_PARTS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


def requantize_q4_0(blocks: torch.Tensor, type_id: int, cols: int) -> tuple[torch.Tensor, int]:
    """A tensor's blocks rounded to Q4_0 (ggml's rule: a scale per 32 weights, the same bytes as
    gguf-py computes) where its type stores more bits a weight than Q4_0 does; as they are otherwise."""
    from specserve.model import ops

    _, elems, size = GGML_TYPES[type_id]
    if size * 8 <= 4.5 * elems or cols % 32:
        return blocks, type_id
    ops.load()
    return torch.ops.specserve.gguf_quantize_q4_0(blocks, type_id, cols), _Q4_0


def install_gguf_weights(net: nn.Module, g: GGUFFile, cfg: ModelConfig, choose: Chooser,
                         q4_0: bool = False) -> dict[str, str]:
    """Give `net` (built on the meta device) the file's weights: norms and biases copied out as
    float32, the embedding and every projection over the mapped blocks, each projection's compiled
    variant chosen by `choose`. With `q4_0` (for a draft model, which need not be exact: the target
    verifies every token it proposes), projections stored in more bits a weight than Q4_0's 4.5
    (Q5_0, Q6_K, Q8_0, ...) are rounded to Q4_0 blocks at load, so a token reads fewer bytes; the
    embedding is looked up, not streamed, and stays as stored. Returns {module name: kernel name}."""
    from specserve.model import ops

    ops.load()
    cpu = torch.device("cpu")

    def floats(name: str) -> nn.Parameter:
        return nn.Parameter(g.floats(name).to(cpu), requires_grad=False)

    # The embedding's blocks, converted once where its type is (a tied head reads them again). Only
    # they are kept: every projection's tensor is read once, and a draft model's Q5_0 tensors' Q8_0
    # copies, all kept until the end, were 250 MB of the 0.5B's loading peak.
    embedding: list[tuple[torch.Tensor, int]] = []

    def blocks(name: str) -> tuple[torch.Tensor, int]:
        if name == "token_embd.weight":
            if not embedding:
                embedding.append(g.blocks(name))
            data, type_id = embedding[0]
        else:
            data, type_id = g.blocks(name)
        layer, _, short = name.partition(".weight")[0].rpartition(".")
        if cfg.model_type == "llama" and short in ("attn_q", "attn_k"):
            data = _unpermute_rows(data, cfg.num_heads if short == "attn_q" else cfg.num_kv_heads).contiguous()
        return data, type_id

    embed = g.tensor("token_embd.weight")
    if embed.type_name in QUANTIZED | CONVERTED:
        net.embed_tokens = GGUFEmbedding(*blocks("token_embd.weight"), cfg.hidden_size)
    else:
        net.embed_tokens = nn.Embedding.from_pretrained(g.floats("token_embd.weight"), freeze=True)
    net.norm.weight = floats("output_norm.weight")
    chosen: dict[str, str] = {}

    def install(module: nn.Module, name: str, tensors: list[str], bias: torch.Tensor | None) -> None:
        parts, types = zip(*(blocks(t) for t in tensors))
        names = [g.tensor(t).type_name for t in tensors]
        if q4_0:
            parts, types = zip(*(requantize_q4_0(p, ty, g.tensor(t).cols) for p, ty, t in zip(parts, types, tensors)))
            names = [GGML_TYPES[ty][0] if ty == _Q4_0 else n for n, ty in zip(names, types)]
        what = "gguf:" + "+".join(names)
        shape = (sum(p.shape[0] for p in parts), g.tensor(tensors[0]).cols)
        views = {i for i, (t, part) in enumerate(zip(tensors, parts)) if part.data_ptr() == g.data(t).data_ptr()}

        def packed(i: int, row0: int, row1: int) -> None:  # rows copied into a packed layout are not read
            if i in views:  # again: their pages go as the copy is made (not the whole tensor twice at once)
                g.release(tensors[i], row0, row1)

        candidates = gguf_candidates(list(parts), list(types), bias, packed)
        kernel_name, kernel = choose(what, shape, torch.float32, candidates)
        for t, used in zip(tensors, kernel.parts):
            if used.data_ptr() != g.data(t).data_ptr():  # a packed or reordered copy: the file's pages are not read again
                g.release(t)
        module.kernel = kernel
        module.weight = None  # the kernel holds the weights (and the bias)
        module.bias = None
        chosen[name] = kernel_name

    for i, layer in enumerate(net.layers):
        p = f"blk.{i}."
        layer.input_layernorm.weight = floats(p + "attn_norm.weight")
        layer.post_attention_layernorm.weight = floats(p + "ffn_norm.weight")
        for attr, gnames in _PARTS.items():
            sub, proj = attr.split(".")
            module = getattr(getattr(layer, sub), proj)
            bias = None
            if attr == "self_attn.qkv_proj" and cfg.attention_bias:
                bias = torch.cat([_bias(g, cfg, p + n) for n in gnames])
            install(module, f"layers.{i}.{attr}", [p + n + ".weight" for n in gnames], bias)
    install(net.lm_head, "lm_head", ["output.weight" if "output.weight" in g.tensors else "token_embd.weight"], None)
    return chosen


def _bias(g: GGUFFile, cfg: ModelConfig, name: str) -> torch.Tensor:
    b = g.floats(name + ".bias")
    short = name.rpartition(".")[2]
    if cfg.model_type == "llama" and short in ("attn_q", "attn_k"):
        b = _unpermute_rows(b, cfg.num_heads if short == "attn_q" else cfg.num_kv_heads).contiguous()
    return b


def rope_freq_factors(g: GGUFFile) -> torch.Tensor | None:
    """Llama 3.x files carry their rotary frequency scaling as a tensor of per-frequency divisors."""
    return g.floats("rope_freqs.weight") if "rope_freqs.weight" in g.tensors else None
