"""Time of the CPU paged-attention kernel for one layer of the bundled model's shape (9 query heads,
3 KV heads, head dim 64, blocks of 16), blocks scattered over the cache, median of 30 calls.

    python benchmarks/paged_attention.py [bfloat16|float32]

Shapes: 8 decodes at 1000 and at 300 tokens of context, 1 decode at 1000, 8 five-node draft trees
at 300, and a 256-token prefill from an empty cache.
"""
import time, statistics, torch, sys
from specserve.model.attention.base import AttentionBatch
from specserve.model.attention.cpu_paged import CpuPagedBackend
torch.set_num_threads(2)
H, KVH, D, BS = 9, 3, 64, 16
NB = 4096
def batch(items):
    g = torch.Generator().manual_seed(0)
    free = torch.randperm(NB, generator=g).tolist()
    q_start, q_len, ctx, tables, masks, slots, t = [], [], [], [], [], [], 0
    for cached, n, mask in items:
        c = cached + n
        table = [free.pop() for _ in range(-(-c // BS))]
        q_start.append(t); q_len.append(n); ctx.append(c); tables.append(tuple(table)); masks.append(mask)
        slots.extend(table[p // BS] * BS + p % BS for p in range(cached, c)); t += n
    return AttentionBatch(torch.tensor(slots), tuple(q_start), tuple(q_len), tuple(ctx), tuple(tables), tuple(masks), t, BS), t
dtype = getattr(torch, sys.argv[1]) if len(sys.argv) > 1 else torch.bfloat16
kc = torch.randn(NB, BS, KVH, D).to(dtype); vc = torch.randn(NB, BS, KVH, D).to(dtype)
be = CpuPagedBackend(H, KVH, D)
tree = torch.tril(torch.ones(5, 5, dtype=torch.bool))
for name, items in [("8 decodes ctx 1000", [(1000, 1, None)] * 8), ("8 decodes ctx 300", [(300, 1, None)] * 8),
                    ("1 decode ctx 1000", [(1000, 1, None)]), ("8 trees(5) ctx 300", [(300, 5, tree)] * 8),
                    ("prefill 256 ctx 0", [(0, 256, None)])]:
    b, t = batch(items)
    q, k, v = torch.randn(t, H, D), torch.randn(t, KVH, D), torch.randn(t, KVH, D)
    meta = be.plan(b, torch.device("cpu"))
    ts = []
    for _ in range(30):
        s = time.perf_counter(); be.forward(q, k, v, kc, vc, meta); ts.append(time.perf_counter() - s)
    print(f"{name:22s} {statistics.median(ts)*1e6:8.1f} us per layer")
