"""Small GGUF files written in the tests (gguf-py's writer): quantized tensors of every type the
engine reads, made of random quants with scales chosen so that the weights have the size of a
trained model's, and a tiny model in the Qwen2 or Llama layout with a byte-level tokenizer.

gguf-py cannot quantize to the k-quants, and nothing here needs a trained model: the engine must
compute what the file's blocks say, whatever their values.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType as Q

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)

# offsets of the fp16 scale fields in a block, and the range each is drawn from
_HALVES: dict[Q, list[tuple[int, float, float]]] = {
    Q.Q4_0: [(0, 0.005, 0.03)],
    Q.Q4_1: [(0, 0.005, 0.03), (2, -0.2, -0.05)],
    Q.Q5_0: [(0, 0.002, 0.015)],
    Q.Q8_0: [(0, 0.0005, 0.003)],
    Q.Q4_K: [(0, 0.0001, 0.0004), (2, 0.0001, 0.0004)],
    Q.Q5_K: [(0, 0.00005, 0.0002), (2, 0.0001, 0.0004)],
    Q.Q6_K: [(208, 0.00002, 0.0001)],
}


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, bytes per row] of valid `qtype` blocks with random quants and sane scales."""
    elems, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // elems, size), dtype=np.uint8)
    for off, lo, hi in _HALVES[qtype]:
        vals = rng.uniform(lo, hi, size=(rows, cols // elems)).astype(np.float16)
        raw[..., off:off + 2] = vals.view(np.uint8).reshape(rows, cols // elems, 2)
    return raw.reshape(rows, -1)


def byte_tokens() -> list[str]:
    from tokenizers import pre_tokenizers

    return ["<s>", "</s>", *sorted(pre_tokenizers.ByteLevel.alphabet()), "ab"]  # one merge: transformers needs one


def write_model(path: Path, arch: str = "qwen2", *, hidden: int = 256, intermediate: int = 512, layers: int = 2,
                heads: int = 4, kv_heads: int = 2, types: dict[str, Q] | None = None, tie: bool = False,
                seed: int = 0, context: int = 2048, family: str | None = None, last_token: str = "ab") -> Path:
    """A tiny model: the projections in `types` (by GGUF short name, e.g. "attn_v", "ffn_down",
    "output", "token_embd"; default Q4_K, with Q6_K for attn_v, ffn_down and the output as a
    Q4_K_M file has them), norms and biases F32. `family`: its general.basename; `last_token`
    replaces the vocabulary's last token (another vocabulary of the same size)."""
    rng = np.random.default_rng(seed)
    kinds = {"token_embd": Q.Q4_K, "attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q4_K,
             "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K, "output": Q.Q6_K, **(types or {})}
    tokens = byte_tokens()[:-1] + [last_token]
    vocab = len(tokens)
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), arch)
    if family is not None:
        w.add_basename(family)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(intermediate)
    w.add_block_count(layers)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (vocab - 2))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_chat_template(CHAT_TEMPLATE)

    def quantized(name: str, short: str, rows: int, cols: int) -> None:
        w.add_tensor(name, random_blocks(kinds[short], rows, cols, rng), raw_dtype=kinds[short])

    def floats(name: str, shape: tuple[int, ...], scale: float, offset: float = 0.0) -> None:
        w.add_tensor(name, (offset + scale * rng.standard_normal(shape)).astype(np.float32))

    quantized("token_embd.weight", "token_embd", vocab, hidden)
    for i in range(layers):
        p = f"blk.{i}."
        floats(p + "attn_norm.weight", (hidden,), 0.1, 1.0)
        floats(p + "ffn_norm.weight", (hidden,), 0.1, 1.0)
        quantized(p + "attn_q.weight", "attn_q", heads * head_dim, hidden)
        quantized(p + "attn_k.weight", "attn_k", kv_heads * head_dim, hidden)
        quantized(p + "attn_v.weight", "attn_v", kv_heads * head_dim, hidden)
        if arch == "qwen2":
            floats(p + "attn_q.bias", (heads * head_dim,), 0.1)
            floats(p + "attn_k.bias", (kv_heads * head_dim,), 0.1)
            floats(p + "attn_v.bias", (kv_heads * head_dim,), 0.1)
        quantized(p + "attn_output.weight", "attn_output", hidden, heads * head_dim)
        quantized(p + "ffn_gate.weight", "ffn_gate", intermediate, hidden)
        quantized(p + "ffn_up.weight", "ffn_up", intermediate, hidden)
        quantized(p + "ffn_down.weight", "ffn_down", hidden, intermediate)
    floats("output_norm.weight", (hidden,), 0.1, 1.0)
    if not tie:
        quantized("output.weight", "output", vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
