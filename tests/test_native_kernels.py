"""The native CPU kernels (torch.ops.specserve.*, every instruction-set variant this CPU runs)
compute what their PyTorch references compute: attention over the paged cache (decodes, chunks over
a cached prefix, draft trees, across block boundaries, float32 and bfloat16 caches), the quantized
and float projections (both the few-rows and the many-rows path), the native layer loop, and the
GGUF int4 blocks taken as they are; and they refuse arguments they would read outside of."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specserve import LLM, SamplingParams
from specserve.model import ops
from specserve.model.attention.base import AttentionBatch
from specserve.model.attention.cpu_paged import CpuPagedBackend
from specserve.model.attention.sdpa import SdpaBackend
from specserve.model.tuning import KernelTuner
from specserve.model.quant import (
    PREFETCH_POLICIES, GGUFLinearKernel, NativeF32Kernel, NativeInt4Kernel, NativeInt8Kernel, quantize_int4,
    quantize_int8,
)

from conftest import random_prompts

ISAS = ops.runnable_isas()  # the compiled variants this CPU runs: each is tested
# The attention kernel in each variant at each of its widths (`lanes`: 0 the widest, 8 the eight-lane
# task; the same where the variant has one).
ATTENTION = [f"{isa}-{lanes}" for isa in ISAS for lanes in (0, 8)]


def _on(kernel, isa: str):  # type: ignore[no-untyped-def]
    """The kernel (a projection, or the attention backend: `isa-lanes`) run by variant `isa`."""
    if isinstance(kernel, CpuPagedBackend):
        name, lanes = isa.rsplit("-", 1)
        kernel._isa = ops.isa_id(name)
        kernel.lanes = int(lanes)
    else:
        kernel.isa = ops.isa_id(isa)
    return kernel

H, KVH, D, BS, NB = 6, 2, 32, 8, 256
# (query heads, KV heads, head dim, block size): the tests' own; the bundled model's heads in the
# engine's blocks; a Qwen2.5-1.5B's in blocks of two key chunks. The kernels' vector paths split D
# and the query heads into groups: each shape takes them through other group sizes.
SHAPES = {"6x2x32-bs8": (6, 2, 32, 8), "9x3x64-bs16": (9, 3, 64, 16), "12x2x128-bs32": (12, 2, 128, 32)}


def _batch(items: list[tuple[int, int, torch.Tensor | None]], dtype: torch.dtype, seed: int = 0,
           shape: tuple[int, int, int, int] = (H, KVH, D, BS)):
    """items: (cached tokens, new tokens, tree mask or None). Blocks are scattered at random."""
    H, KVH, D, BS = shape
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(NB, generator=g).tolist()
    q_start, q_len, ctx, tables, masks, slots, t = [], [], [], [], [], [], 0
    for cached, n, mask in items:
        c = cached + n
        table = [free.pop() for _ in range(-(-c // BS))]
        q_start.append(t), q_len.append(n), ctx.append(c), tables.append(tuple(table)), masks.append(mask)
        slots.extend(table[p // BS] * BS + p % BS for p in range(cached, c))
        t += n
    kc = torch.randn(NB, BS, KVH, D, generator=g).to(dtype)
    vc = torch.randn(NB, BS, KVH, D, generator=g).to(dtype)
    batch = AttentionBatch(torch.tensor(slots), tuple(q_start), tuple(q_len), tuple(ctx), tuple(tables),
                           tuple(masks), t, BS)
    q, k, v = (torch.randn(t, h, D, generator=g) for h in (H, KVH, KVH))
    return batch, q, k, v, kc, vc


TREE = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [1, 0, 0, 1, 1]],
                    dtype=torch.bool)
CASES = {
    "decodes": [(0, 1, None), (7, 1, None), (8, 1, None), (45, 1, None)],
    "chunk-over-prefix": [(13, 21, None), (16, 8, None)],
    "tree": [(30, 5, TREE), (5, 5, TREE)],
    "fresh-prompts": [(0, 40, None), (0, 3, None)],
    "mixed": [(9, 1, None), (30, 5, TREE), (0, 33, None), (17, 12, None)],
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("isa", ATTENTION)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32-cache", "bf16-cache"])
@pytest.mark.parametrize("case", list(CASES))
def test_paged_kernel_equals_sdpa_reference(case: str, dtype: torch.dtype, isa: str, shape: str) -> None:
    """Every new token attends to exactly what the reference says (its cached prefix, then its
    causal or tree-ancestor new tokens), from blocks scattered over the cache; the caches end up
    holding the same K/V."""
    H, KVH, D, _ = SHAPES[shape]
    batch, q, k, v, kc, vc = _batch(CASES[case], dtype, shape=SHAPES[shape])
    ref_backend, backend = SdpaBackend(H, KVH, D), _on(CpuPagedBackend(H, KVH, D), isa)
    kc2, vc2 = kc.clone(), vc.clone()
    # the reference reads the cache in its own dtype: compare against the K/V as the cache holds them
    want = ref_backend.forward(q, k.to(dtype).float(), v.to(dtype).float(), kc, vc, ref_backend.plan(batch, q.device))
    got = backend.forward(q, k, v, kc2, vc2, backend.plan(batch, q.device))
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    for i in range(batch.num_items):
        s, n = batch.q_start[i], batch.q_len[i]
        err = (want[s : s + n] - got[s : s + n]).abs().max().item()
        assert err < 1e-5, (case, i, err)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("isa", ATTENTION)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32-cache", "bf16-cache"])
@pytest.mark.parametrize("cached", [1, 7, 40, 61, 200, 333, 517])
def test_paged_kernel_row_is_the_same_alone_in_a_batch_in_a_chunk_and_in_a_tree(
    cached: int, dtype: torch.dtype, isa: str, shape: str
) -> None:
    """A query row attending to the same keys gets bit for bit the same output as a decode alone,
    a decode among others, the last row of a prefill chunk, and a draft-tree node whose sibling
    (masked) lies between its ancestors: verification's logits are plain decoding's, whatever the
    batch, the tile, the block boundaries or the slots its ancestors sit in."""
    H, KVH, D, BS = SHAPES[shape]
    g = torch.Generator().manual_seed(cached)
    ctx = cached + 2  # the row sees `cached` keys, then its parent, then itself
    keys, values = torch.randn(ctx, KVH, D, generator=g), torch.randn(ctx, KVH, D, generator=g)
    q_row = torch.randn(1, H, D, generator=g)
    backend = _on(CpuPagedBackend(H, KVH, D), isa)

    def attend(items: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
        """items: (cached keys, new queries, new keys, new values, tree mask); each item's cached
        keys are the first ones of `keys`, its blocks its own. Returns every output row."""
        kc, vc = torch.zeros(NB, BS, KVH, D, dtype=dtype), torch.zeros(NB, BS, KVH, D, dtype=dtype)
        q_start, q_len, ctx_len, tables, masks, slots = [], [], [], [], [], []
        qs, ks, vs, t, next_block = [], [], [], 0, 0
        for c, q, k, v, mask in items:
            n = len(q)
            table = list(range(next_block + 3, next_block + 3 + -(-(c + n) // BS)))[::-1]  # blocks out of order
            next_block = max(table) + 1
            for p in range(c):
                kc[table[p // BS], p % BS], vc[table[p // BS], p % BS] = keys[p], values[p]
            q_start.append(t), q_len.append(n), ctx_len.append(c + n), tables.append(tuple(table)), masks.append(mask)
            slots.extend(table[p // BS] * BS + p % BS for p in range(c, c + n))
            qs.append(q), ks.append(k), vs.append(v)
            t += n
        batch = AttentionBatch(torch.tensor(slots), tuple(q_start), tuple(q_len), tuple(ctx_len), tuple(tables),
                               tuple(masks), t, BS)
        return backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), kc, vc, backend.plan(batch, q_row.device))

    def other(n: int) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, None]:
        return (2, torch.randn(n, H, D, generator=g), torch.randn(n, KVH, D, generator=g),
                torch.randn(n, KVH, D, generator=g), None)

    alone = attend([(ctx - 1, q_row, keys[-1:], values[-1:], None)])
    among = attend([other(3), (ctx - 1, q_row, keys[-1:], values[-1:], None), other(1)])[3:4]
    chunk_q = torch.cat([torch.randn(4, H, D, generator=g), q_row])
    chunk = attend([(ctx - 5, chunk_q, keys[-5:], values[-5:], None)])[4:5] if ctx >= 5 else alone
    sibling_k, sibling_v = torch.randn(1, KVH, D, generator=g), torch.randn(1, KVH, D, generator=g)
    tree_mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # root, sibling, the row
    tree_q = torch.cat([torch.randn(2, H, D, generator=g), q_row])
    tree = attend([other(2), (cached, tree_q, torch.cat([keys[cached:cached + 1], sibling_k, keys[-1:]]),
                              torch.cat([values[cached:cached + 1], sibling_v, values[-1:]]), tree_mask)])[4:5]
    for name, got in (("among others", among), ("chunk", chunk), ("tree", tree)):
        assert torch.equal(got, alone), name


def _fake_quant(x: torch.Tensor, isa: str) -> torch.Tensor:
    return torch.ops.specserve.int8_round_activations(x, ops.isa_id(isa))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 17, 70])
def test_projection_kernels_compute_their_definition(rows: int, isa: str) -> None:
    """w4a8 / w8a8 equal the float product of the dequantized weights with the activations
    rounded through int8 per block of 32; float32 equals F.linear."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(72, 96, generator=g) * 0.1
    bias = torch.randn(72, generator=g)
    x = torch.randn(rows, 96, generator=g)
    q4, q8 = quantize_int4(w), quantize_int8(w)
    want4 = F.linear(_fake_quant(x, isa), q4.dequantize(), bias)
    want8 = F.linear(_fake_quant(x, isa), q8.dequantize(), bias)
    for kernel, want in ((NativeInt4Kernel(q4, bias), want4), (NativeInt8Kernel(q8, bias), want8),
                         (NativeF32Kernel(w, bias), F.linear(x, w, bias))):
        torch.testing.assert_close(_on(kernel, isa)(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("k", [96, 608])  # an even and an odd number of groups of 32
def test_projection_kernels_are_batch_invariant(k: int, isa: str) -> None:
    """A row's output is bit for bit the same whatever else is in the batch (1..70 rows, every
    row-tile shape of the kernels): speculation, chunked prefill and preemption change batches,
    and the next layer's int8 rounding would turn a last-bit difference into a different token."""
    g = torch.Generator().manual_seed(k)
    w = torch.randn(40, k, generator=g) * 0.1
    bias = torch.randn(40, generator=g)
    x = torch.randn(70, k, generator=g)
    for kernel in (NativeInt4Kernel(quantize_int4(w), bias), NativeInt8Kernel(quantize_int8(w), bias),
                   NativeF32Kernel(w, bias)):
        _on(kernel, isa)
        alone = torch.cat([kernel(x[i : i + 1]) for i in range(len(x))])
        for rows in range(2, len(x) + 1):
            assert torch.equal(kernel(x[:rows]), alone[:rows]), (type(kernel).__name__, rows)


def test_int4_rounding_error_is_that_of_groups_of_32() -> None:
    w = torch.randn(64, 128) * 0.05
    q = quantize_int4(w)
    step = q.scale.repeat_interleave(32, dim=1)
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-7).all()


def test_gguf_int4_blocks_are_the_files_own(bundled_model_dir: Path) -> None:
    """The bundled GGUF's Q4_1 tensors, taken as int4 weights, dequantize to exactly what gguf's
    own dequantizer gives (no requantization)."""
    import gguf
    from gguf.quants import dequantize

    from specserve.model.loader import find_bundled_gguf
    from specserve.model.quant import gguf_int4

    reader = gguf.GGUFReader(str(find_bundled_gguf("smollm2-135m")))
    checked = 0
    for t in reader.tensors:
        if t.name.startswith("blk.0.") and t.tensor_type.name in ("Q4_0", "Q4_1"):
            mine = gguf_int4(t.data, t.tensor_type.name).dequantize()
            theirs = torch.from_numpy(dequantize(t.data, t.tensor_type).astype("float32"))
            assert torch.equal(mine, theirs), t.name
            checked += 1
    assert checked >= 7


@pytest.fixture(scope="module")
def int4_pair(tiny_llama: Path) -> tuple[LLM, LLM]:
    return LLM(str(tiny_llama), quantization="int4"), LLM(str(tiny_llama), quantization="int4")


def test_native_layer_loop_equals_the_python_path(int4_pair: tuple[LLM, LLM], monkeypatch: pytest.MonkeyPatch) -> None:
    """The same int4 model decoding with every layer in one native call and layer by layer in
    Python: the same greedy tokens (the kernels are the same; only the interpreter differs)."""
    native, python = int4_pair
    prompts = random_prompts(4, seed=5)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    calls = []
    real = type(native.engine.model)._native

    def spy(self, kv, x):
        out = real(self, kv, x)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(type(native.engine.model), "_native", spy)
    a = native.generate(prompts, params, use_tqdm=False)
    assert any(calls), "decode steps ran natively"
    monkeypatch.setattr(type(python.engine.model), "_native", lambda self, kv, x: None)
    b = python.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_feature_layer_states_are_the_states_after_that_many_layers(
    int4_pair: tuple[LLM, LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward asked for the state after layer 1 (an EAGLE-3 head's low-layer feature) returns,
    beside the unchanged last state, exactly what a forward through the first layer alone gives
    (the native loop run in two segments, and layer by layer in Python)."""
    from specserve.model.forward import ForwardItem

    ids = random_prompts(1, seed=7, low=30, high=31)[0]
    got = []
    for llm, native in ((int4_pair[0], True), (int4_pair[1], False)):
        if not native:
            monkeypatch.setattr(type(llm.engine.model), "_native", lambda self, kv, x: None)
        runner = llm.engine.runner
        item = ForwardItem(list(range(-(-len(ids) // runner.block_size))), 0, ids)
        both = runner.run([item], all_hidden=True, feature_layers=(1,)).all_hidden
        last = runner.run([item], all_hidden=True).all_hidden
        first = runner.run([item], num_layers=1, all_hidden=True).all_hidden
        h = last.shape[1]
        assert both.shape == (len(ids), 2 * h)
        assert torch.equal(both[:, h:], last) and torch.equal(both[:, :h], first)
        assert not torch.allclose(first, last, atol=1e-3), "the two layers' states differ"
        got.append(both)
    assert torch.allclose(got[0], got[1], atol=1e-4)
    with pytest.raises(ValueError, match="^feature_layers: 3 is not among the 2 layers"):
        int4_pair[0].engine.runner.run([item], all_hidden=True, feature_layers=(3,))


def test_tuner_decide_takes_the_fastest_and_remembers_it(tmp_path: Path) -> None:
    path = tmp_path / "choices.json"

    def broken() -> float:
        raise RuntimeError("cannot run here")

    cpu = torch.device("cpu")
    assert KernelTuner(cpu, path).decide("plan", {"a": lambda: 2.0, "b": lambda: 1.0}) == "b"
    # a later process on this machine recalls the choice without timing again
    assert KernelTuner(cpu, path).decide("plan", {"a": broken, "b": broken}) == "b"
    assert KernelTuner(cpu, path).recall("plan", ["a", "b"]) == "b"
    # a choice made while a candidate failed (perhaps only this time) is used, not remembered
    assert KernelTuner(cpu, path).decide("other", {"a": lambda: 2.0, "b": broken}) == "a"
    assert KernelTuner(cpu, path).recall("other", ["a", "b"]) is None


def test_attention_width_is_timed_once_per_machine_and_heads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the attention kernel has two widths (an AVX-512 variant, a head dim a multiple of 16),
    `attention_lanes` takes the one its timing finds faster and a later engine on this machine
    recalls it without timing; where it has one, 0 without timing; the backend `make_backend` gives
    runs the width chosen."""
    from specserve.model import tuning
    from specserve.model.attention import make_backend

    path = tmp_path / "kernel-choices.json"
    monkeypatch.setattr(tuning, "cache_root", lambda: tmp_path)  # make_backend's tuner reads the same file
    cpu = torch.device("cpu")
    wide = "avx512" in ops.ISAS[ops.layer_isa()]
    timed: list[int] = []

    def fake(*args: object) -> dict[int, float]:
        timed.append(1)
        return {0: 2.0, 8: 1.0}  # the eight-lane task faster here

    monkeypatch.setattr(tuning, "_attention_seconds", fake)
    want = 8 if wide else 0
    assert tuning.attention_lanes(KernelTuner(cpu, path), 9, 3, 64, torch.bfloat16) == want
    assert tuning.attention_lanes(KernelTuner(cpu, path), 9, 3, 64, torch.bfloat16) == want
    assert len(timed) == (1 if wide else 0)
    assert tuning.attention_lanes(KernelTuner(cpu, path), 9, 3, 40, torch.bfloat16) == 0  # one width for 40
    backend = make_backend("auto", cpu, 9, 3, 64, torch.bfloat16)
    assert isinstance(backend, CpuPagedBackend) and backend.lanes == want and len(timed) == (1 if wide else 0)
    if wide:  # the width asked for is the one that runs: the two sum in other orders
        batch, q, k, v, kc, vc = _batch(CASES["mixed"], torch.bfloat16, shape=SHAPES["9x3x64-bs16"])
        outs = [CpuPagedBackend(9, 3, 64, lanes).forward(q, k, v, kc.clone(), vc.clone(), backend.plan(batch, cpu))
                for lanes in (0, 8)]
        assert not torch.equal(*outs)


def test_the_prefetch_policy_is_timed_once_per_machine_and_set_on_every_kernel(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`choose_prefetch` times the policies on the packed kernels of the modules it is given
    (alternating rounds), sets the winner on every GGUF kernel in them (results unchanged), and a
    later load on this machine recalls it without timing; with no packed kernel there is nothing to
    choose."""
    import gguf

    from specserve.model import tuning

    q8_0 = int(gguf.GGMLQuantizationType.Q8_0)
    q8_0x16 = next(t.type_id for t in ops.PACKED_LAYOUTS["avx512vnni"].types if t.source == q8_0)
    blocks = torch.from_numpy(gguf.quants.quantize(torch.randn(64, 256).numpy(), gguf.GGMLQuantizationType.Q8_0))
    source = GGUFLinearKernel([blocks], [q8_0], None, "generic")  # the file's layout
    packed = GGUFLinearKernel([torch.ops.specserve.gguf_pack(blocks, q8_0, 256, q8_0x16)], [q8_0x16], None, "generic")
    path, cpu, x = tmp_path / "choices.json", torch.device("cpu"), torch.randn(3, 256)
    assert KernelTuner(cpu, path).choose_prefetch(source) is None
    timed: list[int] = []
    real = tuning._stream_seconds

    def stream_seconds(kernels: list[GGUFLinearKernel], rounds: int) -> dict[str, dict[int, float]]:
        timed.append(len(kernels))
        return {n: {m: 1e-9 if n == "in-stream-8k" else t for m, t in by_rows.items()}
                for n, by_rows in real(kernels, rounds).items()}

    monkeypatch.setattr(tuning, "_stream_seconds", stream_seconds)
    before = packed(x)
    assert KernelTuner(cpu, path).choose_prefetch(torch.nn.Sequential(source), packed) == "in-stream-8k"
    assert timed == [1]  # only the packed kernel was timed
    assert source.prefetch == packed.prefetch == PREFETCH_POLICIES["in-stream-8k"]
    assert torch.equal(packed(x), before)
    packed.prefetch = PREFETCH_POLICIES["next-group"]
    assert KernelTuner(cpu, path).choose_prefetch(packed) == "in-stream-8k"  # recalled, not timed again
    assert timed == [1] and packed.prefetch == PREFETCH_POLICIES["in-stream-8k"]


def test_float32_rows_are_batch_invariant_bit_for_bit(tiny_llama: Path) -> None:
    """float32 on the CPU runs only row-invariant kernels (the native one; F.linear and oneDNN block
    by the number of rows): every prompt's logprobs are the same bits generated alone and with three
    others, so greedy speculation and batching leave float32 output token for token unchanged."""
    llm = LLM(str(tiny_llama), quantization="none")
    model = llm.engine.model
    assert all(isinstance(m.kernel, NativeF32Kernel) for _, m in model.named_modules() if hasattr(m, "kernel"))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    prompts = random_prompts(4, seed=8)
    together = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, together):
        alone = llm.generate([prompt], params, use_tqdm=False)[0]
        assert alone.token_ids == out.token_ids
        assert [lp.logprob for lp in alone.logprobs] == [lp.logprob for lp in out.logprobs]
        assert [lp.top for lp in alone.logprobs] == [lp.top for lp in out.logprobs]


def test_operators_refuse_what_they_would_read_outside_of() -> None:
    """The kernels take raw pointers; their operators check first, and say which argument is wrong."""
    isa = ops.layer_isa()
    x, w = torch.randn(3, 64), torch.randn(8, 64)
    with pytest.raises(RuntimeError, match="x has 32 columns, the weight 64"):
        torch.ops.specserve.linear_f32(x[:, :32], w, None, isa)
    with pytest.raises(RuntimeError, match="bias has 7 values for 8 outputs"):
        torch.ops.specserve.linear_f32(x, w, torch.zeros(7), isa)
    with pytest.raises(RuntimeError, match="weight must be a 2-D Float"):
        torch.ops.specserve.linear_f32(x, w.double(), None, isa)
    with pytest.raises(RuntimeError, match="kernel variant 9 cannot run"):
        torch.ops.specserve.rms_norm(x, torch.ones(64), 1e-6, 9)
    batch, q, k, v, kc, vc = _batch(CASES["decodes"], torch.float32)
    backend = CpuPagedBackend(H, KVH, D)
    meta = backend.plan(batch, q.device)
    bad = meta.tables.clone()
    bad[0] = NB  # one past the cache
    with pytest.raises(RuntimeError, match=f"names block {NB} of a cache of {NB}"):
        torch.ops.specserve.paged_attention(q, kc, vc, meta.q_start, meta.q_len, meta.ctx_len, bad, meta.table_off,
                                            meta.masks, meta.mask_off, 1.0, isa)
    with pytest.raises(RuntimeError, match="lanes must be 0 .the widest. or 8, got 16"):
        torch.ops.specserve.paged_attention(q, kc, vc, meta.q_start, meta.q_len, meta.ctx_len, meta.tables,
                                            meta.table_off, meta.masks, meta.mask_off, 1.0, isa, 16)
    with pytest.raises(RuntimeError, match="is outside the cache"):
        torch.ops.specserve.write_kv(k, v, kc, vc, torch.full((len(k),), NB * BS), isa)
    decoder = torch.classes.specserve.Decoder(64, 128, 4, 2, 16, 1e-6, isa)
    layer = decoder.add_layer(torch.ones(64), torch.ones(64), torch.zeros(4, 8, 2, 16), torch.zeros(4, 8, 2, 16))
    with pytest.raises(RuntimeError, match=r"weight \[64, 64\] for \[128, 64\]"):
        decoder.set_linear(layer, 0, 0, [torch.randn(64, 64)], [], None, isa, 2)
    with pytest.raises(RuntimeError, match="layer 0 lacks a projection"):
        torch.ops.specserve.decoder_forward(decoder, torch.randn(1, 64), 1, torch.ones(1, 16), torch.zeros(1, 16),
                                            torch.zeros(1, dtype=torch.int64), *_items(), 1.0)


def _items() -> list[torch.Tensor]:
    """One decode item's attention metadata (q_start .. mask_off) over block 0."""
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    return [i32([0]), i32([1]), i32([1]), i32([0]), i32([0]), torch.zeros(1, dtype=torch.uint8),
            torch.tensor([-1])]


def test_operators_have_right_schemas_and_fakes_for_torch_compile() -> None:
    """torch.library.opcheck on every layer operator: the schema states what it mutates, the fake
    implementation gives the real one's shapes and dtypes, and AOT tracing (what torch.compile does)
    runs through it."""
    isa = ops.layer_isa()
    x, w, b = torch.randn(3, 64), torch.randn(8, 64), torch.randn(8)
    kc, vc = torch.zeros(4, 8, 2, 16), torch.zeros(4, 8, 2, 16)
    cases = {
        "linear_f32": (x, w, b, isa),
        "linear_int8": (x, torch.randint(-127, 127, (8, 64), dtype=torch.int8), torch.rand(8), b, isa),
        "linear_int4": (x, torch.randint(0, 255, (8, 32), dtype=torch.uint8), torch.rand(8, 2), torch.rand(8, 2),
                        None, isa),
        "int8_round_activations": (x, isa),
        "rms_norm": (x, torch.ones(64), 1e-6, isa),
        "silu_mul": (torch.randn(3, 64), isa),
        "rope_": (torch.randn(2, 96), 4, 16, torch.randn(2, 16), torch.randn(2, 16), isa),
        "write_kv": (torch.randn(2, 2, 16), torch.randn(2, 2, 16), kc, vc, torch.tensor([0, 9]), isa),
        "paged_attention": (torch.randn(2, 4, 16), kc, vc, *[torch.tensor(v, dtype=torch.int32) for v in
                                                             ([0], [2], [2], [0], [0])],
                            torch.zeros(1, dtype=torch.uint8), torch.tensor([-1]), 0.25, isa),  # 2 rows, causal
        # Q4_K rows (144 bytes per 256 weights) repacked sixteen at a time, and into given rows
        "gguf_pack": (torch.randint(0, 255, (16, 144), dtype=torch.uint8), 12, 256, 212),
        "gguf_pack_": (torch.zeros(16, 148, dtype=torch.uint8), torch.randint(0, 255, (16, 144), dtype=torch.uint8),
                       12, 256, 212),
    }
    for name, args in cases.items():
        results = torch.library.opcheck(getattr(torch.ops.specserve, name).default, args)
        assert all(v == "SUCCESS" for v in results.values()), (name, results)


@pytest.mark.parametrize("bias", [False, True])
def test_q8_0_candidates_compute_the_q8_0_weights_and_are_batch_invariant(bias: bool) -> None:
    """A draft head's projections rounded to Q8_0 blocks (`q8_0_candidates`): every GGUF kernel this
    CPU offers for them, forced one by one, computes x @ dequantize(blocks)^T (+ bias) within the
    activations' int8 rounding, and a row's result is the same bit for bit alone or among 1..40 rows."""
    import gguf

    from specserve.model.quant import q8_0_candidates

    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 256, generator=g)
    b = torch.randn(48, generator=g) if bias else None
    ref_w = torch.from_numpy(gguf.quants.dequantize(
        gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0)).float()
    assert (ref_w - w).abs().max() <= w.abs().max() / 127 + 1e-6  # Q8_0's own rounding
    factories = q8_0_candidates(w, b)
    assert factories and all(name.startswith("gguf-") for name in factories)
    x = torch.randn(40, 256, generator=g)
    ref = x @ ref_w.T + (b if b is not None else 0)
    for name, make in factories.items():
        kernel = make()
        y = kernel(x)
        assert (y - ref).abs().max() <= 0.02 * ref.abs().max(), name
        for rows in (1, 2, 5, 17, 40):
            assert torch.equal(kernel(x[:rows]), y[:rows]), (name, rows)
