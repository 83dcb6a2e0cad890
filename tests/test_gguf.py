"""GGUF models on their own blocks: every block type decodes exactly as gguf-py decodes it; every
compiled kernel variant computes the dequantized product of what it was given, and computes a row
bit for bit the same alone or in any batch of 1..70 rows; a model read from a k-quant file computes
what its dequantized weights compute, in the Qwen2 and Llama layouts; Q4_K repacked eight rows at a
time (Q4_K and Q6_K sixteen for AVX-512) is the same numbers and its kernels hold the same properties; speculation stays lossless on
it; a broken file is an error that names the file and the tensor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from specserve import LLM, SamplingParams
from specserve.errors import InvalidRequestError
from specserve.model import ops
from specserve.model.gguf_file import GGUFError, GGUFFile
from specserve.model.quant import PREFETCH_POLICIES

from conftest import random_prompts, record_proposed_tokens, shuffle_grants, write_random_head
from gguf_fixtures import random_blocks, write_model

ops.load()
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
ISAS = ops.runnable_isas()
SUPER = {Q.Q4_K, Q.Q5_K, Q.Q6_K}


def _blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    raw = random_blocks(qtype, rows, cols, np.random.default_rng(seed))
    return torch.from_numpy(raw), dequantize(raw, qtype).astype(np.float32)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_blocks_dequantize_exactly_as_gguf_py(qtype: Q) -> None:
    blocks, ref = _blocks(qtype, 24, 512)
    out = torch.ops.specserve.gguf_dequantize(blocks, int(qtype), 512)
    assert torch.equal(out, torch.from_numpy(ref))
    ids = torch.tensor([3, 0, 23, 3])
    assert torch.equal(torch.ops.specserve.gguf_embedding(ids, blocks, int(qtype), 512), out[ids])


def test_q5_0_is_computed_as_the_q8_0_blocks_that_hold_its_numbers_exactly() -> None:
    """Q5_0 has no kernel of its own: the loader converts it to Q8_0 with the same scale, and the
    numbers must be the file's exactly (every bit pattern of the high bits and nibbles)."""
    from specserve.model.gguf_file import q5_0_as_q8_0

    raw = random_blocks(Q.Q5_0, 24, 512, np.random.default_rng(3))
    q8 = q5_0_as_q8_0(torch.from_numpy(raw), 512)
    assert q8.shape == (24, 512 // 32 * GGML_QUANT_SIZES[Q.Q8_0][1])
    out = torch.ops.specserve.gguf_dequantize(q8, int(Q.Q8_0), 512)
    assert torch.equal(out, torch.from_numpy(dequantize(raw, Q.Q5_0).astype(np.float32)))


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.F32], ids=lambda t: t.name)
def test_float_tensors_dequantize_exactly(qtype: Q) -> None:
    x = torch.randn(5, 64)
    data = {Q.F16: x.half(), Q.BF16: x.bfloat16(), Q.F32: x}[qtype]
    raw = data.contiguous().view(torch.uint8).reshape(5, -1)
    assert torch.equal(torch.ops.specserve.gguf_dequantize(raw, int(qtype), 64), data.float())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_variant_computes_the_dequantized_product(qtype: Q, isa: str) -> None:
    """x as the kernels round it (int8 per block) times the dequantized weights, in float64: the
    kernel agrees to float32 rounding."""
    blocks, ref = _blocks(qtype, 40, 768, seed=1)
    x = torch.randn(9, 768) * 3
    rounded = torch.ops.specserve.gguf_round_activations(x, 256 if qtype in SUPER else 32)
    expect = rounded.double() @ torch.from_numpy(ref).double().T
    bias = torch.randn(40)
    y = torch.ops.specserve.gguf_linear(x, [blocks], [int(qtype)], bias, ops.isa_id(isa))
    err = (y.double() - bias.double() - expect).abs().max() / expect.abs().max()
    assert err < 2e-6, err
    # the rounding itself: at most half a step of each block's scale away from x
    step = (x.abs().reshape(9, -1, 256 if qtype in SUPER else 32).amax(-1, keepdim=True) / 127)
    assert ((rounded - x).reshape(step.shape[0], step.shape[1], -1).abs() <= step / 2 * 1.0001).all()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_variant_is_batch_invariant_bit_for_bit(qtype: Q, isa: str) -> None:
    """Each variant, forced (not left to the tuner): a row's result is the same bits alone and
    among any number of rows from 1 to 70 (the paths for few rows and for tiles of many differ)."""
    blocks, _ = _blocks(qtype, 24, 512, seed=2)
    x = torch.randn(70, 512)
    run = lambda rows: torch.ops.specserve.gguf_linear(rows, [blocks], [int(qtype)], None, ops.isa_id(isa))  # noqa: E731
    full = run(x)
    alone = torch.cat([run(x[i:i + 1]) for i in range(70)])
    assert torch.equal(full, alone)
    for m in range(2, 70):
        assert torch.equal(run(x[:m]), full[:m]), m
        assert torch.equal(run(x[70 - m:]), full[70 - m:]), m


@pytest.mark.parametrize("isa", ISAS)
def test_a_fused_projection_of_mixed_types_is_its_parts_side_by_side(isa: str) -> None:
    parts = [_blocks(t, r, 512, seed=i)[0] for i, (t, r) in enumerate([(Q.Q4_K, 48), (Q.Q6_K, 16), (Q.Q8_0, 8)])]
    types = [int(Q.Q4_K), int(Q.Q6_K), int(Q.Q8_0)]
    x, bias = torch.randn(5, 512), torch.randn(72)
    fused = torch.ops.specserve.gguf_linear(x, parts, types, bias, ops.isa_id(isa))
    alone = torch.cat([torch.ops.specserve.gguf_linear(x, [p], [t], None, ops.isa_id(isa))
                       for p, t in zip(parts, types)], dim=1) + bias
    assert torch.equal(fused, alone)


LAYOUTS = list(ops.PACKED_LAYOUTS.values())
PACKED = list(ops.PACKED_BY_ID.values())  # packing, and the portable variant, run anywhere
X8, X16 = ops.PACKED_LAYOUTS["avx2"], ops.PACKED_LAYOUTS["avx512vnni"]
Q4KX8, Q4KX16, Q6KX16 = ops.PACKED_BY_ID[112], ops.PACKED_BY_ID[212], ops.PACKED_BY_ID[214]
RUNNABLE_LAYOUTS = [ops.PACKED_LAYOUTS[isa].name for isa in ISAS if isa in ops.PACKED_LAYOUTS]


def _name(t: ops.PackedType) -> str:
    return f"{Q(t.source).name}x{t.rows}"


def _variant_reads(isa: str, t: ops.PackedType) -> bool:
    """ops.cpp's variant_reads: the portable variant reads every packed type, a vectorised one its
    own layout's (AVX-512's reads AVX2's too)."""
    return isa == "generic" or t in ops.PACKED_LAYOUTS[isa].types or (isa == "avx512vnni" and t == Q4KX8)


READS = [pytest.param(isa, t, id=f"{isa}-{_name(t)}") for isa in ISAS for t in PACKED if _variant_reads(isa, t)]


def _packed(blocks: torch.Tensor, t: ops.PackedType = Q4KX8) -> torch.Tensor:
    elems, size = GGML_QUANT_SIZES[Q(t.source)]  # the file's block
    return torch.ops.specserve.gguf_pack(blocks, t.source, blocks.shape[1] // size * elems, t.type_id)


@pytest.mark.parametrize("t", PACKED, ids=_name)
def test_packing_is_lossless(t: ops.PackedType) -> None:
    """Eight or sixteen rows at a time, every byte kept: the packed tensor dequantizes to the file's
    values (Q4_K: scales and mins of all 64 values, every quant; Q6_K: every 6-bit quant and scale;
    Q8_0's quants stored plus 128 and back), in the file's size per row (Q4_K: 4 bytes more per 256)."""
    blocks, ref = _blocks(Q(t.source), 64, 1024, seed=4)
    packed = _packed(blocks, t)
    assert packed.shape == (64, t.row_bytes(1024))
    assert torch.equal(torch.ops.specserve.gguf_dequantize(packed, t.type_id, 1024), torch.from_numpy(ref))


@pytest.mark.parametrize("isa, t", READS)
def test_every_variant_computes_the_dequantized_product_from_packed_weights(isa: str, t: ops.PackedType) -> None:
    blocks, ref = _blocks(Q(t.source), 48, 768, seed=1)
    x = torch.randn(9, 768) * 3
    rounded = torch.ops.specserve.gguf_round_activations(x, 256 if Q(t.source) in SUPER else 32)
    expect = rounded.double() @ torch.from_numpy(ref).double().T
    bias = torch.randn(48)
    y = torch.ops.specserve.gguf_linear(x, [_packed(blocks, t)], [t.type_id], bias, ops.isa_id(isa))
    err = (y.double() - bias.double() - expect).abs().max() / expect.abs().max()
    assert err < 2e-6, err
    if isa == "generic":  # the portable variant unpacks each group and sums as it does for the file
        assert torch.equal(y, torch.ops.specserve.gguf_linear(x, [blocks], [t.source], bias, ops.isa_id(isa)))


@pytest.mark.parametrize("isa, t", READS)
def test_every_variant_is_batch_invariant_bit_for_bit_on_packed_weights(isa: str, t: ops.PackedType) -> None:
    """As for the file's blocks: a row alone and among 1..70 rows (tiles, groups of activation rows
    and the remainders) gives the same bits, under every prefetch policy the machine's timing can
    choose, and the same bits under each. 128 weight rows: each thread's chunk holds several
    groups, so the kernels' path that asks for the next group ahead runs too (policy "next-group")."""
    packed = _packed(_blocks(Q(t.source), 128, 512, seed=2)[0], t)
    x = torch.randn(70, 512)
    fulls = []
    for prefetch in PREFETCH_POLICIES.values():
        def run(rows: torch.Tensor) -> torch.Tensor:
            return torch.ops.specserve.gguf_linear(rows, [packed], [t.type_id], None, ops.isa_id(isa), prefetch)

        full = run(x)
        assert torch.equal(full, torch.cat([run(x[i:i + 1]) for i in range(70)])), prefetch
        for m in range(2, 70):
            assert torch.equal(run(x[:m]), full[:m]), (prefetch, m)
            assert torch.equal(run(x[70 - m:]), full[70 - m:]), (prefetch, m)
        fulls.append(full)
    assert all(torch.equal(f, fulls[0]) for f in fulls)


@pytest.mark.parametrize("isa, t", READS)
def test_a_fused_projection_with_a_packed_part_is_its_parts_side_by_side(isa: str, t: ops.PackedType) -> None:
    other = Q.Q6_K if t.source == Q.Q4_K else Q.Q4_K
    parts = [_packed(_blocks(Q(t.source), 48, 512, seed=0)[0], t), _blocks(other, 16, 512, seed=1)[0],
             _packed(_blocks(Q(t.source), t.rows, 512, seed=2)[0], t)]
    types = [t.type_id, int(other), t.type_id]
    x, bias = torch.randn(5, 512), torch.randn(64 + t.rows)
    fused = torch.ops.specserve.gguf_linear(x, parts, types, bias, ops.isa_id(isa))
    alone = torch.cat([torch.ops.specserve.gguf_linear(x, [p], [ty], None, ops.isa_id(isa))
                       for p, ty in zip(parts, types)], dim=1) + bias
    assert torch.equal(fused, alone)


@pytest.mark.parametrize("isa, t", READS)
def test_a_projection_cut_to_spans_of_rows_computes_those_rows_as_the_whole_does(isa: str, t: ops.PackedType) -> None:
    """GGUFLinearKernel.row_spans (a draft model's LM head cut to the tokens it may propose): the
    rows kept, packed or in the file's blocks, give the whole projection's outputs for them, bit
    for bit; a span that would split a packed group is refused."""
    from specserve.model.quant import GGUFLinearKernel

    other = Q.Q6_K if t.source == Q.Q4_K else Q.Q4_K
    parts = [_packed(_blocks(Q(t.source), 4 * t.rows, 512, seed=0)[0], t), _blocks(other, 24, 512, seed=1)[0]]
    whole = GGUFLinearKernel(parts, [t.type_id, int(other)], torch.randn(4 * t.rows + 24), isa)
    x = torch.randn(3, 512)
    full = whole(x)
    spans = [(0, t.rows), (3 * t.rows, 4 * t.rows + 5)]  # a whole group, then the last group and 5 file rows
    for copy in (False, True):
        cut = whole.row_spans(spans, copy=copy)
        assert torch.equal(cut(x), torch.cat([full[:, a:b] for a, b in spans], dim=1))
    with pytest.raises(ValueError, match="cuts a group"):
        whole.row_spans([(0, t.rows // 2)])


def test_packing_refuses_what_it_cannot_pack() -> None:
    blocks, _ = _blocks(Q.Q4_K, 12, 512)
    with pytest.raises(RuntimeError, match="12 rows are not whole groups of 8"):
        _packed(blocks)
    with pytest.raises(RuntimeError, match="24 rows are not whole groups of 16"):
        _packed(_blocks(Q.Q4_K, 24, 512)[0], Q4KX16)
    with pytest.raises(RuntimeError, match="ggml type 14 has no packed layout 112"):
        torch.ops.specserve.gguf_pack(_blocks(Q.Q6_K, 8, 512)[0], int(Q.Q6_K), 512, 112)
    for policy in (-1, len(PREFETCH_POLICIES)):
        with pytest.raises(RuntimeError, match=f"prefetch policy must be 0 to {len(PREFETCH_POLICIES) - 1}, got {policy}"):
            torch.ops.specserve.gguf_linear(torch.randn(1, 512), [blocks], [int(Q.Q4_K)], None, 0, policy)
    with pytest.raises(RuntimeError, match="ggml type 12 has no packed layout 214"):
        torch.ops.specserve.gguf_pack(blocks, int(Q.Q4_K), 512, 214)
    with pytest.raises(RuntimeError, match="a packed tensor .* has a multiple of 8 rows, got 12"):
        torch.ops.specserve.gguf_linear(torch.randn(1, 512), [torch.zeros(12, 296, dtype=torch.uint8)], [112], None, 0)
    with pytest.raises(RuntimeError, match="a packed tensor .* has a multiple of 16 rows, got 8"):
        torch.ops.specserve.gguf_linear(torch.randn(1, 512), [torch.zeros(8, 420, dtype=torch.uint8)], [214], None, 0)
    with pytest.raises(RuntimeError, match="is not a lookup table"):
        torch.ops.specserve.gguf_embedding(torch.tensor([0]), _packed(_blocks(Q.Q4_K, 8, 512)[0]), 112, 512)


@pytest.mark.skipif("avx2" not in ISAS, reason="no AVX2 variant on this CPU")
def test_a_variant_refuses_a_packed_layout_it_has_no_kernel_for() -> None:
    packed = _packed(_blocks(Q.Q6_K, 16, 512)[0], Q6KX16)
    with pytest.raises(RuntimeError, match="kernel variant 1 has no kernel for weight 0's packed type 214"):
        torch.ops.specserve.gguf_linear(torch.randn(1, 512), [packed], [214], None, ops.isa_id("avx2"))


def test_bad_arguments_are_errors_that_say_what_is_wrong() -> None:
    blocks, _ = _blocks(Q.Q4_K, 8, 512)
    with pytest.raises(RuntimeError, match="x must be a 2-D float32"):
        torch.ops.specserve.gguf_linear(torch.randn(2, 512).double(), [blocks], [int(Q.Q4_K)], None, 0)
    with pytest.raises(RuntimeError, match="rows of 288 bytes do not hold 768 elements"):
        torch.ops.specserve.gguf_linear(torch.randn(2, 768), [blocks], [int(Q.Q4_K)], None, 0)
    with pytest.raises(RuntimeError, match="weight 0 has ggml type 7, which has no integer kernel"):
        torch.ops.specserve.gguf_linear(torch.randn(2, 512), [blocks], [7], None, 0)
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32"):
        torch.ops.specserve.gguf_linear(torch.randn(2, 512), [blocks], [int(Q.Q4_K)], torch.zeros(3), 0)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        torch.ops.specserve.gguf_embedding(torch.tensor([8]), blocks, int(Q.Q4_K), 512)


# -- files --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("gguf")
    return {
        "qwen2": write_model(d / "qwen2.gguf", "qwen2"),
        # Q5_0 where a Q4_K_M file puts it (rows not whole super-blocks: Qwen2.5-0.5B's 896-wide
        # tensors and its embedding), tied as the 0.5B's head is
        "qwen2-q5_0": write_model(d / "qwen2-q5_0.gguf", "qwen2", tie=True, seed=2,
                                  types={"attn_k": Q.Q5_0, "ffn_gate": Q.Q5_0, "token_embd": Q.Q5_0}),
        "llama": write_model(d / "llama.gguf", "llama", tie=True, seed=1,
                             types={"attn_q": Q.Q5_K, "attn_k": Q.Q8_0, "ffn_up": Q.Q4_0, "ffn_gate": Q.Q4_1,
                                    "token_embd": Q.Q6_K}),
    }


@pytest.fixture(params=["file", "x8", "x16"])
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every GGUF projection forced onto the file's blocks ("file") or, where a part is Q4_K, onto
    Q4_K packed eight ("x8") or sixteen ("x16") rows at a time, instead of leaving the choice to the
    timing."""
    from specserve.model.tuning import KernelTuner

    if request.param != "file" and request.param not in RUNNABLE_LAYOUTS:
        pytest.skip(f"no kernel variant on this CPU reads the {request.param} layout")
    original = KernelTuner.choose
    packed_suffixes = tuple(f"-{layout.name}" for layout in LAYOUTS)

    def choose(self, precision, shape, dtype, factories):  # type: ignore[no-untyped-def]
        if precision.startswith("gguf:"):
            names = [n for n in factories if n.endswith(f"-{request.param}")]
            names = names or [n for n in factories if not n.endswith(packed_suffixes)]
            factories = {names[-1]: factories[names[-1]]}
        return original(self, precision, shape, dtype, factories)

    monkeypatch.setattr(KernelTuner, "choose", choose)
    return request.param


class _RoundedDense(torch.nn.Module):
    """A dense projection whose input is rounded as the block kernels round it, part by part."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows: list[int], types: list[int]) -> None:
        super().__init__()
        self.weights = weight.split(rows)
        self.blocks = [ops.PACKED_BY_ID[t].block_elems if t in ops.PACKED_BY_ID else (256 if Q(t) in SUPER else 32)
                       for t in types]
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([torch.nn.functional.linear(torch.ops.specserve.gguf_round_activations(x, blk), w)
                       for w, blk in zip(self.weights, self.blocks)], dim=-1)
        return y if self.bias is None else y + self.bias


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen2-q5_0"])
def test_a_model_on_its_blocks_computes_what_its_dequantized_weights_compute(files: dict[str, Path], arch: str,
                                                                              layout: str) -> None:
    """The same file run on its blocks (gguf) and dequantized to float32 (none), the float model's
    projections given the same int8 rounding of their inputs: the same logits, up to rounding. So
    the layouts agree (fused q/k/v and gate/up of mixed types, llama's permuted Q/K rows, Qwen2's
    biases, a tied head) and nothing else differs."""
    from specserve.model.forward import ForwardItem

    prompt = random_prompts(1, seed=5, low=30, high=31, vocab=259)[0]
    blocks = LLM(str(files[arch]), quantization="gguf", kv_cache_dtype="float32")
    dense = LLM(str(files[arch]), quantization="none")
    assert LLM(str(files[arch])).engine.config.cache.dtype == torch.bfloat16  # as the other quantized precisions
    model = dense.engine.model
    for name, module in model.named_modules():
        if hasattr(module, "kernel"):
            gk = blocks.engine.model.get_submodule(name).kernel
            weight = module.weight if module.weight is not None else module.kernel.weight
            module.kernel = _RoundedDense(weight.detach(), None if module.bias is None else module.bias.detach(),
                                          [p.shape[0] for p in gk.parts], gk.types)
    model.kernels_changed()
    logits = []
    for llm in (blocks, dense):
        with torch.inference_mode():
            logits.append(llm.engine.runner.run([ForwardItem(list(range(4)), 0, prompt, logits="all")]).logits)
    a, b = logits
    assert a.shape == b.shape == (len(prompt), 259)
    # Float sums in another order can move a value across an int8 rounding boundary, a whole step
    # of its block (1/127 of the block's largest value), and later layers carry that on: rows
    # without such a flip agree to float rounding, the others by a few steps' worth. A layout
    # error would move every logit by about its own size.
    row = (a - b).abs().amax(-1) / b.abs().max()
    assert row.max() < 0.03, row
    assert (row < 1e-5).float().mean() >= 0.5, row


def test_the_native_layer_loop_computes_the_python_layers_bit_for_bit(files: dict[str, Path], layout: str) -> None:
    from specserve.model.forward import ForwardItem

    llm = LLM(str(files["qwen2"]))
    packed = [t for m in llm.engine.model.modules() if hasattr(m, "kernel") for t in getattr(m.kernel, "types", [])]
    layout_ids = {t.type_id: lay.name for lay in LAYOUTS for t in lay.types}
    assert {layout_ids[t] for t in packed if t in layout_ids} == ({layout} if layout != "file" else set())
    model, runner = llm.engine.model, llm.engine.runner
    assert model._native(runner.kv_cache, torch.zeros(1, 256)) is not None  # the loop runs these kernels
    prompt = random_prompts(1, seed=6, low=20, high=21, vocab=259)[0]
    with torch.inference_mode():
        native = runner.run([ForwardItem(list(range(4)), 0, prompt, logits="all")]).logits
        model._native = lambda kv, x: None  # type: ignore[method-assign]
        python = runner.run([ForwardItem(list(range(4, 8)), 0, prompt, logits="all")]).logits
    assert torch.equal(native, python)


GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(files: dict[str, Path]) -> list[list[int]]:
    llm = LLM(str(files["qwen2"]), max_num_batched_tokens=24)
    return [o.token_ids for o in llm.generate(random_prompts(6, seed=9, vocab=259), GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("method", ["ngram", "suffix", "recycling", "layer-skip", "draft-model", "eagle"])
def test_greedy_speculation_on_a_k_quant_model_is_plain_decoding(
    files: dict[str, Path], plain: list[list[int]], method: str, tmp_path: Path
) -> None:
    """Every drafter, grants shuffled step by step, chunked prefill: the plain greedy tokens."""
    spec: dict = dict(method=method, num_tokens=4, controller="fixed")
    if method == "draft-model":
        # another model with the same vocabulary (mostly rejected), with Q5_0 tensors as Qwen2.5-0.5B's
        spec["draft_model"] = str(files["qwen2-q5_0"])
    if method == "layer-skip":
        spec["draft_layers"] = 1
    if method == "eagle":
        from specserve.model.gguf_model import gguf_tokenizer_dir

        spec["draft_model"] = str(write_random_head(gguf_tokenizer_dir(files["qwen2"]), tmp_path / "head"))
    llm = shuffle_grants(LLM(str(files["qwen2"]), speculative=spec, max_num_batched_tokens=24), seed=3)
    outs = llm.generate(random_prompts(6, seed=9, vocab=259), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == plain
    assert llm.engine.draft_totals.proposed > 0
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


@pytest.mark.parametrize("layout", ["x8", "x16"], indirect=True)
@pytest.mark.parametrize("method", ["ngram", "draft-model"])
def test_greedy_speculation_on_packed_q4k_is_plain_decoding(files: dict[str, Path], layout: str, method: str) -> None:
    """Verifying drafts runs the packed kernels on several rows at once: still the plain tokens."""
    plain = LLM(str(files["qwen2"]), max_num_batched_tokens=24)
    prompts = random_prompts(6, seed=9, vocab=259)
    expected = [o.token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    spec: dict = dict(method=method, num_tokens=4, controller="fixed")
    if method == "draft-model":
        spec["draft_model"] = str(files["qwen2"])  # the same model: every draft accepted, 5 rows verified a step
        spec["draft_quantization"] = "file"  # (not rounded to Q4_0: then it would be another model)
    llm = shuffle_grants(LLM(str(files["qwen2"]), speculative=spec, max_num_batched_tokens=24), seed=3)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    assert llm.engine.draft_totals.proposed > 0


@pytest.mark.parametrize("tie", [False, True], ids=["own-head", "tied-head"])
def test_a_gguf_draft_cut_to_its_first_token_ids_proposes_only_them_and_output_is_plain(
    files: dict[str, Path], plain: list[list[int]], tie: bool
) -> None:
    """draft_vocab on a GGUF draft model (its own head, or the embedding's blocks as the 0.5B
    Qwen2.5's): its LM head keeps the first 128 of 259 rows; it proposes none of the others, and
    greedy output is plain decoding's."""
    draft = files["qwen2-q5_0"] if tie else files["qwen2"]
    llm = LLM(str(files["qwen2"]), max_num_batched_tokens=24,
              speculative=dict(method="draft-model", num_tokens=4, controller="fixed", draft_model=str(draft),
                               draft_quantization="file", draft_vocab=100))
    drafter = llm.engine.speculator.drafters["draft-model"]
    head = drafter.forward.__self__.model.lm_head
    assert (head.keep, head.tail) == (128, 259)  # rounded up to whole spans of 64 rows; no special token beyond
    proposed = record_proposed_tokens(drafter)
    outs = llm.generate(random_prompts(6, seed=9, vocab=259), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == plain
    assert proposed and max(proposed) < 128


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q6_K, Q.Q4_1, Q.Q4_K, Q.Q4_0])
def test_a_draft_models_wider_projections_are_its_numbers_rounded_to_q4_0(qtype: Q) -> None:
    """A tensor stored in more bits a weight than Q4_0 (Q8_0, Q6_K, Q4_1, and Q5_0 as the Q8_0 it
    converts to) becomes exactly gguf-py's Q4_0 rounding of its numbers; one stored in as few (Q4_K,
    Q4_0) stays the file's own blocks, not a copy."""
    from gguf.quants import quantize

    from specserve.model.gguf_model import requantize_q4_0

    rows, cols = 48, 512
    blocks = torch.from_numpy(random_blocks(qtype, rows, cols, np.random.default_rng(3)))
    out, type_id = requantize_q4_0(blocks, int(qtype), cols)
    if qtype in (Q.Q4_K, Q.Q4_0):
        assert out is blocks and type_id == int(qtype)
        return
    expected = quantize(dequantize(blocks.numpy(), qtype).reshape(rows, cols), Q.Q4_0)
    assert type_id == int(Q.Q4_0) and np.array_equal(out.numpy(), expected)


def test_q4_0_rounding_keeps_gguf_pys_choices_at_its_edges() -> None:
    """The native rounding's bytes equal gguf-py's where the rule has choices to make: the first of
    equal magnitudes of either sign sets the scale, a block of zeros (+0.0 or -0.0 first) keeps the
    sign gguf-py gives its scale, values at the rounding boundaries, tiny and huge scales."""
    from gguf.quants import quantize

    from specserve.model.gguf_model import requantize_q4_0

    rng = np.random.default_rng(5)
    x = (rng.standard_normal((12, 256)) * 0.02).astype(np.float32)
    x[0, :32] = 0.0
    x[1, :32] = -0.0
    x[1, 32:64] = 0.0
    x[1, 32] = -0.0
    x[2, :32], x[2, 7], x[2, 3] = 0.25, 0.5, -0.5  # -0.5 comes first
    x[3, :32] = np.linspace(-1, 1, 32, dtype=np.float32)  # the largest magnitude twice, -1 first
    x[4, :32] = (np.arange(32, dtype=np.float32) - 16) / 16 * -8 / 8.5  # on the trunc(+8.5) boundaries
    x[5] *= 1e-30
    x[6] *= 1e30
    out, type_id = requantize_q4_0(torch.from_numpy(x).view(torch.uint8), int(Q.F32), 256)
    with np.errstate(over="ignore"):  # the 1e30 block's scale is inf in half precision, as in ggml
        expected = quantize(x, Q.Q4_0)
    assert type_id == int(Q.Q4_0) and np.array_equal(out.numpy(), expected)


def test_a_gguf_draft_model_runs_on_q4_0_blocks_and_decodes_as_plain(files: dict[str, Path]) -> None:
    """The draft model (Q5_0, Q6_K and Q4_K tensors) runs every projection on Q4_0 or Q4_K blocks by
    default (a draft token reads fewer bytes), on the file's types with draft_quantization="file";
    the target keeps its own either way, and the output is plain decoding's."""
    prompts = random_prompts(4, seed=9, vocab=259)
    plain = [o.token_ids for o in LLM(str(files["qwen2"])).generate(prompts, GREEDY, use_tqdm=False)]

    def kinds(model: torch.nn.Module) -> set[str]:
        out = set()
        for m in model.modules():
            for t in getattr(getattr(m, "kernel", None), "types", []):
                out.add(Q(ops.PACKED_BY_ID[t].source if t in ops.PACKED_BY_ID else t).name)
        return out

    for setting, expected in (("q4_0", {"Q4_0", "Q4_K"}), ("file", {"Q8_0", "Q6_K", "Q4_K"})):
        llm = LLM(str(files["qwen2"]), speculative=dict(method="draft-model", num_tokens=3, controller="fixed",
                                                        draft_model=str(files["qwen2-q5_0"]),
                                                        draft_quantization=setting))
        drafter = llm.engine.speculator.drafters["draft-model"]
        assert kinds(drafter.forward.__self__.model) == expected
        assert kinds(llm.engine.model) == {"Q4_K", "Q6_K"}
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == plain


def test_draft_model_auto_finds_the_largest_smaller_sibling_with_the_same_vocabulary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`draft_model="auto"` takes, among the GGUF files of $SPECSERVE_MODELS, the largest with the
    target's architecture, family and vocabulary (byte for byte) and at most half its numbers; none
    found, `auto` drafts with its lookups alone and `draft-model` is an error naming the field. The
    output with the draft found is plain decoding's."""
    from specserve.model.drafts import find_draft_model

    models = tmp_path / "models"
    models.mkdir()
    target = write_model(models / "target.gguf", "qwen2", family="Tiny")  # 1.31M numbers
    small = dict(layers=1, intermediate=256, family="Tiny")
    write_model(models / "small-tied.gguf", "qwen2", tie=True, seed=2, **small)  # 0.46M
    best = write_model(models / "small.gguf", "qwen2", seed=3, **small)  # 0.52M
    # 0.62M, the largest under half the target's, but each differs from it in one thing
    larger = dict(layers=1, intermediate=384, types={p: Q.Q8_0 for p in ("ffn_gate", "ffn_up", "ffn_down")})
    write_model(models / "other-vocab.gguf", "qwen2", seed=4, last_token="ba", family="Tiny", **larger)
    write_model(models / "other-family.gguf", "qwen2", seed=5, family="Other", **larger)
    write_model(models / "llama.gguf", "llama", seed=6, family="Tiny", **larger)
    write_model(models / "as-large.gguf", "qwen2", seed=7, family="Tiny")
    assert find_draft_model(target, models) == best
    best.rename(tmp_path / "small.gguf")
    assert find_draft_model(target, models) == models / "small-tied.gguf"
    (tmp_path / "small.gguf").rename(best)

    monkeypatch.setenv("SPECSERVE_MODELS", str(models))
    prompts = random_prompts(3, seed=12, vocab=259)
    plain = [o.token_ids for o in LLM(str(target)).generate(prompts, GREEDY, use_tqdm=False)]
    with caplog.at_level("INFO", logger="specserve"):
        llm = LLM(str(target), speculative=dict(method="auto", draft_model="auto"))
    assert f"draft model: {best}, found" in caplog.text
    assert llm.engine.speculator.drafters.keys() >= {"draft-model", "suffix"}
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == plain

    monkeypatch.setenv("SPECSERVE_MODELS", str(tmp_path / "empty"))
    assert "draft-model" not in LLM(str(target), speculative=dict(method="auto", draft_model="auto")).engine.speculator.drafters
    with pytest.raises(ValueError, match="^draft_model:"):
        LLM(str(target), speculative=dict(method="draft-model", draft_model="auto"))


def test_a_truncated_file_names_the_file_and_the_tensor(files: dict[str, Path], tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    data = files["qwen2"].read_bytes()
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(GGUFError, match=r"cut\.gguf is truncated: tensor 'output\.weight'"):
        GGUFFile(cut)
    with pytest.raises(GGUFError, match="cut.gguf"):
        LLM(str(cut))
    head_only = tmp_path / "head.gguf"
    head_only.write_bytes(data[:100])
    with pytest.raises(GGUFError, match=r"head\.gguf is truncated or corrupt"):
        GGUFFile(head_only)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + bytes([3, 0, 0, 0]) + bytes([0xFF] * 16) + data[24:2000])
    with pytest.raises(GGUFError, match="garbage.gguf"):
        GGUFFile(garbage)
    # inside the vocabulary's string array: cut short, or one string's length beyond the file
    key = data.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens")
    first = key + 4 + 4 + 8  # the value's type, the array's element type and count
    mid_array = tmp_path / "mid_array.gguf"
    mid_array.write_bytes(data[:first + 200])
    with pytest.raises(GGUFError, match=r"mid_array\.gguf is truncated or corrupt \(a string array"):
        GGUFFile(mid_array)
    huge = bytearray(data)
    assert int.from_bytes(data[first:first + 8], "little") < 64  # the first token's length
    huge[first:first + 8] = (1 << 62).to_bytes(8, "little")
    bad_length = tmp_path / "bad_length.gguf"
    bad_length.write_bytes(bytes(huge))
    with pytest.raises(GGUFError, match=r"bad_length\.gguf is truncated or corrupt \(a string array"):
        GGUFFile(bad_length)
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(not_gguf)


def test_an_unsupported_type_names_the_tensor_and_its_type(files: dict[str, Path], tmp_path: Path) -> None:
    """One tensor's type id rewritten in the header to IQ4_XS (a type this engine has no kernel for,
    whose blocks are smaller than Q4_K's, so the file still holds the data)."""
    raw = bytearray(files["qwen2"].read_bytes())
    name = b"blk.1.ffn_up.weight"
    at = raw.index(name) + len(name)
    type_at = at + 4 + 8 * int.from_bytes(raw[at:at + 4], "little")  # after n_dims and the dims
    assert int.from_bytes(raw[type_at:type_at + 4], "little") == int(Q.Q4_K)
    raw[type_at:type_at + 4] = (23).to_bytes(4, "little")
    bad = tmp_path / "iq4xs.gguf"
    bad.write_bytes(bytes(raw))
    with pytest.raises(GGUFError, match=r"iq4xs\.gguf: tensor 'blk\.1\.ffn_up\.weight' is IQ4_XS"):
        LLM(str(bad))


def test_auto_runs_a_k_quant_file_on_its_blocks_and_gguf_needs_a_gguf(files: dict[str, Path], tiny_llama: Path) -> None:
    from specserve.model.loader import resolve_quantization

    assert resolve_quantization("auto", files["qwen2"]) == "gguf"
    assert resolve_quantization("auto", files["qwen2"], "cuda") == "none"
    with pytest.raises(ValueError, match="quantization: 'gguf' runs a GGUF file's own blocks"):
        LLM(str(tiny_llama), quantization="gguf")
    with pytest.raises(InvalidRequestError, match="float32 activations"):
        LLM(str(files["qwen2"]), quantization="gguf", dtype="bfloat16")


@pytest.mark.parametrize("layout", ["file"], indirect=True)
def test_weights_stay_in_the_files_mapping(files: dict[str, Path], layout: str) -> None:
    """On the file's blocks the kernels read the file's bytes where the mapping holds them: no
    projection, head or embedding is copied (a Qwen2 file needs no row reordering). (With
    huge_pages, everything is then copied once more, into 2 MB pages: test_huge_pages.)"""
    llm = LLM(str(files["qwen2"]), huge_pages=False)
    g = GGUFFile(files["qwen2"])
    model = llm.engine.model
    base = model.embed_tokens.blocks.data_ptr() - g.tensor("token_embd.weight").offset
    layer = model.layers[1]
    for module, names in ((layer.self_attn.qkv_proj, ["attn_q", "attn_k", "attn_v"]),
                          (layer.mlp.down_proj, ["ffn_down"]), (model.lm_head, ["output"])):
        for part, short in zip(module.kernel.parts, names):
            full = short if short == "output" else f"blk.1.{short}"
            assert part.data_ptr() - base == g.tensor(full + ".weight").offset, full


@pytest.mark.parametrize("layout", ["x8", "x16"], indirect=True)
def test_packed_projections_hold_the_files_numbers(files: dict[str, Path], layout: str) -> None:
    """Packed, a projection's parts of a type the layout packs (Q4_K; Q6_K too in x16) are copies in
    the packed layout that dequantize to the file's values; its other parts stay views of the mapping
    (unless huge_pages copies them: test_huge_pages)."""
    llm = LLM(str(files["qwen2"]), huge_pages=False)
    g = GGUFFile(files["qwen2"])
    model = llm.engine.model
    base = model.embed_tokens.blocks.data_ptr() - g.tensor("token_embd.weight").offset  # the engine's mapping
    layer = model.layers[0]
    for module, names in ((layer.self_attn.qkv_proj, ["attn_q", "attn_k", "attn_v"]),
                          (layer.mlp.gate_up_proj, ["ffn_gate", "ffn_up"])):
        for part, type_id, short in zip(module.kernel.parts, module.kernel.types, names):
            t = g.tensor(f"blk.0.{short}.weight")
            file_values = torch.ops.specserve.gguf_dequantize(g.data(t.name), t.type_id, t.cols)
            if ops.PACKED_LAYOUTS[{"x8": "avx2", "x16": "avx512vnni"}[layout]].of(t.type_id) is not None:
                assert type_id in ops.PACKED_BY_ID and part.data_ptr() - base != t.offset
                assert torch.equal(torch.ops.specserve.gguf_dequantize(part, type_id, t.cols), file_values)
            else:
                assert type_id == t.type_id and part.data_ptr() - base == t.offset


@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_a_heads_readout_and_embedding_are_the_targets_rows_without_dense_copies(
    files: dict[str, Path], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An EAGLE head on a GGUF target reads the LM head's rows it needs (read back from the kernel a
    chunk of hidden dims at a time: the same numbers as the whole matrix read back at once) and
    looks tokens up through the target's embedding (the table's rows, dequantized as asked); it
    never asks for the dense table (about 1 GB for a 150k vocabulary)."""
    from specserve.model.eagle import lm_head_rows, lm_head_weight
    from specserve.model.gguf_model import GGUFEmbedding, gguf_tokenizer_dir
    from specserve.speculation.drafters.eagle import EagleDrafter

    llm = LLM(str(files[name]))
    model = llm.engine.model
    assert model.lm_head.weight is None  # a kernel: the matrix only exists read back
    ids = torch.tensor([0, 5, 17, 200, 258, 3])
    whole = lm_head_weight(model)
    for chunk in (256, 100, 7):
        assert torch.equal(lm_head_rows(model, ids, chunk=chunk), whole[ids].float())
    dense = model.embed_tokens.weight
    assert torch.equal(model.embed_tokens(ids).float(), dense[ids].float())

    def refused(self: GGUFEmbedding) -> torch.Tensor:
        raise AssertionError("the dense embedding table was asked for")

    monkeypatch.setattr(GGUFEmbedding, "weight", property(refused))
    head = write_random_head(gguf_tokenizer_dir(files[name]), files[name].parent / f"head-{name}")
    spec = LLM(str(files[name]), speculative=dict(method="eagle", draft_model=str(head), num_tokens=4,
                                                   controller="fixed"))
    drafter = next(iter(spec.engine.speculator.drafters.values()))
    assert isinstance(drafter, EagleDrafter)
    outs = spec.generate(random_prompts(3, seed=4, vocab=259), GREEDY, use_tqdm=False)
    assert spec.engine.draft_totals.proposed > 0 and all(o.token_ids for o in outs)


def test_a_gguf_cache_entry_is_found_by_content_and_the_entries_are_bounded(
    files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The conversion of a GGUF (and of its tokenizer) is cached under the file's content: the same
    file at another path (another virtual environment) or touched finds the entry it has, a changed
    file gets its own, and a kind's entries are kept to the most recently used few. Keyed by path
    and mtime, the cache grew by one 517 MB entry for every install of the bundled model."""
    import os
    import shutil

    from specserve.model import loader
    from specserve.model.gguf_model import gguf_tokenizer_dir

    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECSERVE_CACHE", str(cache))
    monkeypatch.setattr(loader, "KEEP_CONVERSIONS", 2)
    src = files["llama"]
    copies = []
    for i in range(3):
        copy = tmp_path / f"venv{i}" / src.name
        copy.parent.mkdir()
        shutil.copy(src, copy)
        copies.append(copy)
    os.utime(copies[0], (1, 1))
    first = loader.convert_gguf(src)
    assert loader.convert_gguf(copies[0]) == first and gguf_tokenizer_dir(copies[0]) == gguf_tokenizer_dir(src)
    assert [p.name for p in (cache / "gguf").iterdir()] == [first.name]

    changed = []
    for i, copy in enumerate(copies[1:], start=1):  # a changed weight: another file
        data = bytearray(copy.read_bytes())
        data[-1] ^= 0x1
        data[len(data) // 2] ^= i
        copy.write_bytes(bytes(data))
        changed.append(loader.convert_gguf(copy))
    assert len({first, *changed}) == 3
    assert sorted(p.name for p in (cache / "gguf").iterdir()) == sorted(p.name for p in changed)  # the oldest went
    assert loader.convert_gguf(copies[2]) == changed[1] and (changed[1] / "model.safetensors").is_file()
    monkeypatch.setattr(loader, "CONVERSION_BYTES", 1)  # within a size too: the one in use stays
    loader.convert_gguf(copies[2])
    assert [p.name for p in (cache / "gguf").iterdir()] == [changed[1].name]
