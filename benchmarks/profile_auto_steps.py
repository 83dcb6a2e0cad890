"""Where an engine's steps spend the time outside the forward: one batch of prompts under cProfile,
the step's forward (`ModelRunner.execute`) against the whole step (`EngineCore._step`), and the
speculator's parts (propose, verify, observe) by cumulative time. Run it once with `--spec none`
and once with `--spec auto` on the same prompts: the difference outside the forward is what the
speculator's own Python costs a step.

    python benchmarks/profile_auto_steps.py --spec auto --batch 4 --prompts 16
    python benchmarks/profile_auto_steps.py --spec none --batch 4 --prompts 16
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--spec", default="auto", help="a --spec method, or none")
    ap.add_argument("--dataset", default="sharegpt")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=40, help="rows of the cumulative-time table")
    a = ap.parse_args()
    from specserve import LLM, SamplingParams
    from specserve.bench.datasets import open_dataset
    from specserve.bench.spec import load_questions
    from specserve.tokenizer import apply_chat_template

    torch.set_num_threads(a.threads)
    spec = None if a.spec == "none" else dict(method=a.spec)
    llm = LLM(a.model, max_num_seqs=a.batch, speculative=spec)
    prompts = [apply_chat_template(llm.tokenizer, [{"role": "user", "content": q}])
               for _, q in load_questions(open_dataset(a.dataset, None), a.prompts, a.max_tokens, llm.tokenizer)]
    llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)  # warm-up
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    llm.generate(prompts, SamplingParams(max_tokens=a.max_tokens, temperature=0), use_tqdm=False)
    profile.disable()
    print(f"{a.spec}: {time.perf_counter() - start:.2f} s under the profiler")
    stats = pstats.Stats(profile)
    stats.sort_stats("cumulative").print_stats(a.top)


if __name__ == "__main__":
    main()
