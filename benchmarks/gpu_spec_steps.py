"""Where speculation's time goes on a GPU step: plain decoding and a drafting method on the same
random prompts, each step timed whole (device synchronized) and its forward alone, steps grouped by
whether they carried drafts (rows in the forward above the batch's decodes).

    python benchmarks/gpu_spec_steps.py --model llama-3.1-8b --batches 8,32 --spec auto   # on a GPU

Prints per engine: tok/s, and for plain and drafted steps the count, median step, median forward, mean
rows, and the median time outside the forward (the speculator's and the engine's host work).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b", help="a named shape, random weights")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", "--batch", default="32", help="batch sizes, comma-separated (one engine each kind)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--spec", default="auto")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sdpa-kernels", help="comma-separated SDPBackend names the SDPA backend may use "
                    "(default: the backend's own choice, specserve.model.attention.sdpa.SDPA_KERNELS)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.sdpa_kernels:
        from torch.nn.attention import SDPBackend

        from specserve.model.attention import sdpa
        sdpa.SDPA_KERNELS = tuple(getattr(SDPBackend, n.strip()) for n in a.sdpa_kernels.split(","))
    from specserve import LLM, SamplingParams

    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    batches = [int(x) for x in str(a.batches).split(",")]
    result: dict[str, dict] = {}
    for name, spec in (("none", None), (a.spec, dict(method=a.spec))):
        llm = LLM(a.model, load_format="dummy", device=a.device, dtype=a.dtype, speculative=spec)
        core, cur, rec = llm.engine.core, {}, []
        execute, step = core.runner.execute, llm.engine.step

        def timed_execute(batch, drafts=None, *args, execute=execute, cur=cur, **kw):
            sync()
            t = time.perf_counter()
            out = execute(batch, drafts, *args, **kw)
            sync()
            cur["forward"] = time.perf_counter() - t
            cur["drafted"] = sum(len(d) for d in (drafts or {}).values())
            cur["decodes"] = len(batch)
            return out

        def timed_step(step=step, cur=cur, rec=rec):
            cur.clear()
            sync()
            t = time.perf_counter()
            out = step()
            sync()
            if "forward" in cur:
                rec.append((time.perf_counter() - t, cur["forward"], cur["drafted"], cur["decodes"]))
            return out

        core.runner.execute = timed_execute
        llm.engine.step = timed_step
        vocab = llm.engine.model.config.vocab_size
        for b in batches:
            g = torch.Generator().manual_seed(b)
            prompts = [torch.randint(0, vocab, (64,), generator=g).tolist() for _ in range(b)]
            llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
            rec.clear()
            seconds, tokens = 0.0, 0
            for _ in range(a.rounds):
                t = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                seconds += time.perf_counter() - t
                tokens += sum(len(o.token_ids) for o in outs)
            decode = [r for r in rec if r[3] == b]  # steps with every request decoding
            row: dict = {"batch": b, "tok_s": round(tokens / seconds, 1), "steps": len(rec)}
            for kind, group in (("plain", [r for r in decode if r[2] == 0]), ("drafted", [r for r in decode if r[2] > 0])):
                if group:
                    row[kind] = dict(n=len(group), step_ms=round(1e3 * statistics.median(r[0] for r in group), 2),
                                     forward_ms=round(1e3 * statistics.median(r[1] for r in group), 2),
                                     outside_ms=round(1e3 * statistics.median(r[0] - r[1] for r in group), 2),
                                     draft_nodes=round(statistics.mean(r[2] for r in group), 1))
            result[f"{name}_b{b}"] = row
            print(name, json.dumps(row), flush=True)
        del llm
        if a.device == "cuda":
            torch.cuda.empty_cache()
    if a.json:
        a.json.write_text(json.dumps(dict(command=" ".join(__import__("sys").argv), rows=result,
                                          device=torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"), indent=1))


if __name__ == "__main__":
    main()
