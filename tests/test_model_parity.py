"""Our Llama-family model computes what transformers computes on identical weights.

Protects: correctness of the model math (RMSNorm, RoPE incl. llama3 scaling,
GQA, SwiGLU, biases, tied embeddings), of the weight loading (HF and GGUF), and
of the paged attention paths (causal prefill, chunks over a cached prefix,
single-token decode).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.engine.model_runner import ForwardItem
from specserve.engine.sequence import Sequence

from conftest import random_prompts


def hf_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def engine_logits(llm: LLM, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits at every position, computed through the engine's paged path `chunk` tokens at a time
    (returned on the CPU, beside the reference, whatever device the engine runs on)."""
    engine = llm.engine
    seq = Sequence("probe", list(ids), SamplingParams(), 0.0, max_total_len=len(ids) + 1)
    assert engine.blocks.allocate(seq, len(ids))
    rows = []
    for start in range(0, len(ids), chunk):
        n = min(chunk, len(ids) - start)
        logits, _ = engine.runner.run([ForwardItem(seq.block_table, start, ids[start : start + n], logits="all")])
        rows.append(logits)
        seq.num_computed_tokens = start + n
    engine.blocks.free(seq)
    return torch.cat(rows).cpu()


@pytest.mark.parametrize(
    "name,arch,overrides",
    [
        ("llama-gqa", "llama", {}),
        ("llama3-rope-tied", "llama", {"tie_word_embeddings": True,
                                        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
        ("llama-mha-bias", "llama", {"num_key_value_heads": 4, "attention_bias": True}),
        ("qwen2", "qwen2", {"tie_word_embeddings": True}),
    ],
)
def test_logits_match_transformers(tiny_model_factory, name: str, arch: str, overrides: dict) -> None:
    path = tiny_model_factory(name, arch=arch, **overrides)
    ref_model = hf_model(path)
    llm = LLM(str(path), num_kv_blocks=64, block_size=4)
    ids = random_prompts(1, seed=1, low=90, high=91)[0]  # long enough to reach llama3's scaled band
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    for chunk in (len(ids), 7, 1):  # one causal prefill; chunks over a cached prefix; token by token
        ours = engine_logits(llm, ids, chunk)
        assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4), (name, chunk, (ours - ref).abs().max())


@pytest.mark.parametrize("name,arch", [("llama", "llama"), ("qwen2", "qwen2")])
def test_greedy_64_tokens_match_transformers(tiny_model_factory, name: str, arch: str) -> None:
    path = tiny_model_factory(name, arch=arch) if arch == "llama" else tiny_model_factory("qwen2", arch="qwen2", tie_word_embeddings=True)
    ref_model = hf_model(path)
    llm = LLM(str(path))
    prompts = random_prompts(3, seed=2)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            gen = ref_model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)
        assert out.token_ids == gen[0, len(ids):].tolist()


@pytest.mark.slow
def test_bundled_smollm2_matches_transformers(bundled_model_dir: Path) -> None:
    """The GGUF-converted SmolLM2: same logits and the same 64 greedy tokens as transformers."""
    ref_model = hf_model(bundled_model_dir)
    llm = LLM("smollm2-135m", quantization="none")  # the float32 reference
    tok = llm.tokenizer
    prompts = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,"]
    for text in prompts:
        ids = tok(text).input_ids
        with torch.no_grad():
            gen = ref_model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)
            ref_logits = ref_model(gen[:, :-1]).logits[0]
        expected = gen[0, len(ids):].tolist()
        out = llm.generate(ids, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True), use_tqdm=False)[0]
        assert out.token_ids == expected, text
        ours = engine_logits(llm, gen[0, :-1].tolist(), chunk=16)
        assert torch.allclose(ours, ref_logits, atol=1e-3, rtol=1e-4)


@pytest.mark.slow
def test_gguf_conversion_matches_transformers_own_gguf_loader(bundled_model_dir: Path) -> None:
    """An independent check of our GGUF dequantization and Q/K un-permutation: transformers reads
    the same GGUF file with its own converter, and the logits agree."""
    from transformers import AutoModelForCausalLM

    from specserve.model.loader import find_bundled_gguf

    gguf_path = find_bundled_gguf("smollm2-135m")
    ref_model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    llm = LLM("smollm2-135m", quantization="none")  # the float32 reference
    ids = llm.tokenizer("The quick brown fox jumps over the lazy dog because").input_ids
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    ours = engine_logits(llm, ids, chunk=len(ids))
    assert torch.allclose(ours, ref, atol=1e-3, rtol=1e-4), (ours - ref).abs().max()
