"""What small operations cost right after a forward, against the same operations in a loop: the
forward streams the weights through the caches, and the interpreter and PyTorch's dispatcher run
from memory after it. Times ten small tensor additions, and each row's top-8 of the logits both
ways (the native `row_topk` and the chunked search in torch operators), after a batch-8 decode
forward of the bundled model and back to back.

    python benchmarks/after_forward.py --json benchmarks/after_forward_zen5_s16_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from specserve import LLM
    from specserve.model.forward import ForwardItem
    from specserve.speculation.sampler import chunked_topk_ids, row_topk_ids

    runner = LLM(a.model, max_num_seqs=a.rows).engine.core.runner
    bs = runner.block_size
    per = -(-(a.context + 1) // bs)
    items = [ForwardItem(list(range(r * per, (r + 1) * per)), a.context, [1]) for r in range(a.rows)]
    small = torch.ones(8, 8, dtype=torch.long)

    def adds(_: torch.Tensor) -> None:
        for _ in range(10):
            small + 1

    ops: dict[str, Callable[[torch.Tensor], object]] = {
        "ten small additions": adds,
        "row_topk_ids (native)": lambda x: row_topk_ids(x, 8),
        "chunked_topk_ids (torch operators)": lambda x: chunked_topk_ids(x, 8),
    }
    out: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for name, op in ops.items():
            after, loop = [], []
            for _ in range(a.repeats):
                logits = runner.run(items).logits
                t = time.perf_counter()
                op(logits)
                after.append(time.perf_counter() - t)
                for _ in range(3):
                    op(logits)
                t = time.perf_counter()
                op(logits)
                loop.append(time.perf_counter() - t)
            out[name] = {"after_forward_us": round(1e6 * statistics.median(after), 1),
                         "in_a_loop_us": round(1e6 * statistics.median(loop), 1)}
            print(f"{name:36s} after a forward {out[name]['after_forward_us']:8.1f} us, in a loop {out[name]['in_a_loop_us']:8.1f} us")
    if a.json:
        from specserve.bench.report import environment

        a.json.write_text(json.dumps({**environment(), "logits": [a.rows, runner.model.config.vocab_size],
                                      "results": out}, indent=1))


if __name__ == "__main__":
    main()
