"""Time of the CPU paged-attention kernel for one layer, blocks of 16 scattered over the cache,
median of 30 calls (60 with --shape qwen1.5b).

    python benchmarks/paged_attention.py [bfloat16|float32] [--shape smollm2|qwen1.5b] [--save OUT.pt]
        [--isa avx2|avx512vnni] [--lanes 0|8] [--json OUT.json]

smollm2 (the bundled model: 9 query heads, 3 KV heads, dim 64): 8 decodes at 1000 and at 300 tokens
of context, 1 decode at 1000, 8 five-node draft trees at 300, a 256-token prefill from an empty cache.
qwen1.5b (Qwen2.5-Coder-1.5B: 12 query heads, 2 KV heads, dim 128): 1, 4 and 16 rows after 512
cached tokens, 8 decodes at 512, 1 and 4 rows at 2048, a 256-token prefill. `--save` writes every
shape's output, to check that two builds give bitwise the same results. `--isa` runs another
compiled variant than the widest, `--lanes 8` the eight-lane task where a wider one is compiled (a
build before session 32 has neither: leave both out). `--json` writes the medians.
"""
import argparse
import json
import statistics
import time

import torch

from specserve.model.attention.base import AttentionBatch
from specserve.model.attention.cpu_paged import CpuPagedBackend

SHAPES = {
    "smollm2": ((9, 3, 64, 4096, 30), [
        ("8 decodes ctx 1000", [(1000, 1, False)] * 8), ("8 decodes ctx 300", [(300, 1, False)] * 8),
        ("1 decode ctx 1000", [(1000, 1, False)]), ("8 trees(5) ctx 300", [(300, 5, True)] * 8),
        ("prefill 256 ctx 0", [(0, 256, False)])]),
    "qwen1.5b": ((12, 2, 128, 2048, 60), [
        ("1 row ctx 512", [(512, 1, False)]), ("4 rows ctx 512", [(512, 4, False)]),
        ("16 rows ctx 512", [(512, 16, False)]), ("8 decodes ctx 512", [(512, 1, False)] * 8),
        ("1 row ctx 2048", [(2048, 1, False)]), ("4 rows ctx 2048", [(2048, 4, False)]),
        ("prefill 256 ctx 0", [(0, 256, False)])]),
}
BS = 16


def batch(items: list[tuple[int, int, bool]], blocks: int) -> tuple[AttentionBatch, int]:
    g = torch.Generator().manual_seed(0)
    free = torch.randperm(blocks, generator=g).tolist()
    q_start, q_len, ctx, tables, masks, slots, t = [], [], [], [], [], [], 0
    for cached, n, tree in items:
        c = cached + n
        table = [free.pop() for _ in range(-(-c // BS))]
        q_start.append(t); q_len.append(n); ctx.append(c); tables.append(tuple(table))
        masks.append(torch.tril(torch.ones(n, n, dtype=torch.bool)) if tree else None)
        slots.extend(table[p // BS] * BS + p % BS for p in range(cached, c)); t += n
    return AttentionBatch(torch.tensor(slots), tuple(q_start), tuple(q_len), tuple(ctx), tuple(tables),
                          tuple(masks), t, BS), t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dtype", nargs="?", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    ap.add_argument("--save", help="write every shape's output here (torch.save)")
    ap.add_argument("--isa", help="a compiled variant (default: the widest this CPU runs)")
    ap.add_argument("--lanes", type=int, help="8: the eight-lane task (default: the widest)")
    ap.add_argument("--json", help="write the medians (us per layer) here")
    a = ap.parse_args()
    torch.set_num_threads(2)
    (H, KVH, D, NB, calls), cases = SHAPES[a.shape]
    torch.manual_seed(0)
    dtype = getattr(torch, a.dtype)
    kc = torch.randn(NB, BS, KVH, D).to(dtype)
    vc = torch.randn(NB, BS, KVH, D).to(dtype)
    be = CpuPagedBackend(H, KVH, D)
    if a.isa:
        from specserve.model import ops

        be._isa = ops.isa_id(a.isa)
    if a.lanes is not None:
        be.lanes = a.lanes
    outs, medians = {}, {}
    for name, items in cases:
        b, t = batch(items, NB)
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(t, H, D, generator=g), torch.randn(t, KVH, D, generator=g),
                   torch.randn(t, KVH, D, generator=g))
        meta = be.plan(b, torch.device("cpu"))
        ts = []
        for _ in range(calls):
            s = time.perf_counter()
            out = be.forward(q, k, v, kc, vc, meta)
            ts.append(time.perf_counter() - s)
        outs[name] = out.clone()
        medians[name] = round(statistics.median(ts) * 1e6, 1)
        print(f"{name:22s} {medians[name]:8.1f} us per layer")
    if a.save:
        torch.save(outs, a.save)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"dtype": a.dtype, "shape": a.shape, "isa": a.isa, "lanes": a.lanes, "us_per_layer": medians}, f,
                      indent=1)


if __name__ == "__main__":
    main()
