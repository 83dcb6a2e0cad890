"""Forward time of the bundled model (int4 unless told) by batch and context: one new token per
item after 10, 300 or 1000 cached tokens, at batch 1 and 8, and one 8-token item; median of 15,
shapes interleaved.

    python benchmarks/forward_by_context.py [int4|int8|none]
"""
import time, statistics, torch, sys
from specserve import LLM
from specserve.engine.model_runner import ForwardItem
torch.set_num_threads(2)
llm = LLM(quantization=sys.argv[1] if len(sys.argv) > 1 else "int4")
r = llm.engine.runner
tables = [list(range(i * 70, i * 70 + 70)) for i in range(8)]
with torch.inference_mode():
    for i in range(8): r.run([ForwardItem(tables[i], 0, [3] * 1000, logits="last")])
    cases = {}
    for B in (1, 8):
        for ctx in (10, 300, 1000):
            cases[f"B={B} ctx={ctx}"] = [ForwardItem(tables[i], ctx, [7], logits="last") for i in range(B)]
    cases["1 item x 8 tok ctx=0"] = [ForwardItem(tables[0], 0, [7] * 8, logits="all")]
    cases["1 item x 8 tok ctx=300"] = [ForwardItem(tables[0], 300, [7] * 8, logits="all")]
    cases["1 item x 8 tok ctx=0 last"] = [ForwardItem(tables[0], 0, [7] * 8, logits="last")]
    res = {k: [] for k in cases}
    for rep in range(15):
        for k, it in cases.items():
            t = time.perf_counter(); r.run(it); res[k].append(time.perf_counter() - t)
for k in cases: print(k, f"{statistics.median(res[k])*1e3:.2f} ms")
