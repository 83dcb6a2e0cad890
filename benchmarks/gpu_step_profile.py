"""Where a decode step's time goes on a GPU: the engine's step timed whole and its forward alone,
and torch.profiler's count of kernels and of the GPU's busy time per step, at each batch size.
A step far longer than its GPU time is bound by the host (Python and kernel launches), not by
the GPU; the top operators by host time say which.

    python benchmarks/gpu_step_profile.py --model llama-3.1-8b --batch-sizes 1,32   # random weights, bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b", help="a named shape (random weights)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from specserve import LLM, SamplingParams

    llm = LLM(a.model, load_format="dummy", device=a.device, dtype=a.dtype, speculative=None)
    vocab = llm.engine.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    core, step = llm.engine.core, llm.engine.step
    execute = core.runner.execute
    times: dict[str, list[float]] = {"step": [], "forward": []}

    def timed_execute(*args, **kwargs):
        t = time.perf_counter()
        out = execute(*args, **kwargs)
        times["forward"].append(time.perf_counter() - t)
        return out

    def timed_step():
        t = time.perf_counter()
        out = step()
        times["step"].append(time.perf_counter() - t)
        return out

    core.runner.execute, llm.engine.step = timed_execute, timed_step
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device.startswith("cuda") else [])
    rows = []
    for b in [int(x) for x in a.batch_sizes.split(",")]:
        prompts = [torch.randint(0, vocab, (64,), generator=g).tolist() for _ in range(b)]
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        for v in times.values():
            v.clear()
        llm.generate(prompts, params, use_tqdm=False)
        step_ms = statistics.median(times["step"]) * 1e3
        forward_ms = statistics.median(times["forward"]) * 1e3
        n_steps = len(times["step"])
        with profile(activities=activities) as prof:
            llm.generate(prompts, params, use_tqdm=False)
        events = prof.key_averages()
        gpu_us = sum(e.self_device_time_total for e in events if e.self_device_time_total > 0)
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
        row = {"batch": b, "steps": n_steps, "step_ms_median": round(step_ms, 2), "forward_ms_median": round(forward_ms, 2),
               "gpu_busy_ms_per_step": round(gpu_us / 1e3 / n_steps, 2), "kernel_launches_per_step": round(launches / n_steps, 1),
               "tok_per_s": round(b / step_ms * 1e3, 1)}
        rows.append(row)
        print(json.dumps(row))
        print(events.table(sort_by="self_cpu_time_total", row_limit=a.top, max_name_column_width=48))
    if a.json:
        a.json.write_text(json.dumps({"model": a.model, "device": a.device, "dtype": a.dtype,
                                      "gpu": torch.cuda.get_device_name(0) if a.device.startswith("cuda") else None,
                                      "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
