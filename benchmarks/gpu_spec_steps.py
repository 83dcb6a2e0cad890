"""Where speculation's time goes on a GPU step: plain decoding and a drafting method on the same
random prompts, each step timed whole (device synchronized) and its forward alone, steps grouped by
whether they carried drafts (rows in the forward above the batch's decodes).

    python benchmarks/gpu_spec_steps.py --model llama-3.1-8b --batches 8,32 --spec auto   # on a GPU
    python benchmarks/gpu_spec_steps.py --batches 1,32 --interleave --profile-dir gpu_out  # both engines in one process

Prints per engine and batch: tok/s, and for plain and drafted steps the count, median step, median
forward, mean draft nodes, and the median time outside the forward (the speculator's and the
engine's host work). By default one engine is built, measured and freed, then the other;
`--interleave` builds both first and alternates them round by round, so that the two engines' plain
steps are compared in the same process and minutes (one reading per process moved 25-40 ms on an
H100's host-bound step). `--profile-dir`: torch.profiler over a few steps of each engine where every
request decodes and none carries drafts, its top operators by host time written per engine and batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch


class Timed:
    """An engine whose steps and forwards are timed (device synchronized around each)."""

    def __init__(self, name: str, llm: Any, sync) -> None:  # type: ignore[no-untyped-def]
        self.name, self.llm, self.sync = name, llm, sync
        self.cur: dict[str, Any] = {}
        self.rec: list[tuple[float, float, int, int]] = []
        core = llm.engine.core
        self._execute, self._step = core.runner.execute, llm.engine.step
        core.runner.execute = self._timed_execute
        llm.engine.step = self._timed_step

    def _timed_execute(self, batch, drafts=None, *args, **kw):  # type: ignore[no-untyped-def]
        self.sync()
        t = time.perf_counter()
        out = self._execute(batch, drafts, *args, **kw)
        self.sync()
        self.cur.update(forward=time.perf_counter() - t, drafted=sum(len(d) for d in (drafts or {}).values()),
                        decodes=len(batch))
        return out

    def _timed_step(self):  # type: ignore[no-untyped-def]
        self.cur.clear()
        self.sync()
        t = time.perf_counter()
        out = self._step()
        self.sync()
        if "forward" in self.cur:
            self.rec.append((time.perf_counter() - t, self.cur["forward"], self.cur["drafted"], self.cur["decodes"]))
        return out

    def generate(self, prompts: list[list[int]], params: Any) -> tuple[float, int]:
        t = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t, sum(len(o.token_ids) for o in outs)


def summary(rec: list[tuple[float, float, int, int]], batch: int, seconds: float, tokens: int) -> dict:
    decode = [r for r in rec if r[3] == batch]  # steps with every request decoding
    row: dict = {"batch": batch, "tok_s": round(tokens / seconds, 1), "steps": len(rec)}
    for kind, group in (("plain", [r for r in decode if r[2] == 0]), ("drafted", [r for r in decode if r[2] > 0])):
        if group:
            row[kind] = dict(n=len(group), step_ms=round(1e3 * statistics.median(r[0] for r in group), 2),
                             forward_ms=round(1e3 * statistics.median(r[1] for r in group), 2),
                             outside_ms=round(1e3 * statistics.median(r[0] - r[1] for r in group), 2),
                             draft_nodes=round(statistics.mean(r[2] for r in group), 1))
    return row


def profile_plain_steps(engine: Timed, prompts: list[list[int]], params: Any, path: Path, steps: int = 6) -> None:
    """torch.profiler over `steps` steps in which every request decodes and none carries drafts."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    llm = engine.llm
    for p in prompts:
        llm.engine.add_request(p, params)
    for _ in range(3):  # past the prefill
        llm.engine.step()
    taken = drafted = 0
    with profile(activities=activities) as prof:
        while llm.engine.has_unfinished_requests() and taken < steps:
            llm.engine.step()
            if engine.cur.get("drafted", 1) == 0 and engine.cur.get("decodes") == len(prompts):
                taken += 1
            else:
                drafted += 1
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
    path.write_text(f"{engine.name}: {taken} plain steps with every request decoding, {drafted} other steps\n{table}\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b", help="a named shape, random weights")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", "--batch", default="32", help="batch sizes, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--spec", default="auto")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--interleave", action="store_true", help="both engines built first, alternated round by round")
    ap.add_argument("--profile-dir", type=Path, help="profile a few plain steps of each engine at each batch")
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
    kinds = (("none", None), (a.spec, dict(method=a.spec)))

    def build(name: str, spec: Any) -> Timed:
        return Timed(name, LLM(a.model, load_format="dummy", device=a.device, dtype=a.dtype, speculative=spec), sync)

    def measure(engines: list[Timed]) -> dict[str, dict]:
        out: dict[str, dict] = {}
        vocab = engines[0].llm.engine.model.config.vocab_size
        for b in batches:
            g = torch.Generator().manual_seed(b)
            prompts = [torch.randint(0, vocab, (64,), generator=g).tolist() for _ in range(b)]
            totals = {e.name: [0.0, 0] for e in engines}
            for e in engines:
                e.llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
                e.rec.clear()
            for _ in range(a.rounds):
                for e in engines:
                    seconds, tokens = e.generate(prompts, params)
                    totals[e.name][0] += seconds
                    totals[e.name][1] += tokens
            for e in engines:
                row = out[f"{e.name}_b{b}"] = summary(e.rec, b, *totals[e.name])
                print(e.name, json.dumps(row), flush=True)
                if a.profile_dir:
                    a.profile_dir.mkdir(parents=True, exist_ok=True)
                    profile_plain_steps(e, prompts, params, a.profile_dir / f"plain_steps_{e.name}_b{b}.txt")
        return out

    result: dict[str, dict] = {}
    if a.interleave:
        result = measure([build(name, spec) for name, spec in kinds])
    else:
        for name, spec in kinds:
            engine = build(name, spec)
            result.update(measure([engine]))
            del engine
            if a.device == "cuda":
                torch.cuda.empty_cache()
    if a.json:
        a.json.write_text(json.dumps(dict(command=" ".join(__import__("sys").argv), rows=result, interleaved=a.interleave,
                                          device=torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"), indent=1))


if __name__ == "__main__":
    main()
