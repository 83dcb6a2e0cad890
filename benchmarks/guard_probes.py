"""What the goodput guard's probe steps verified: per probe, the drafter whose tree was verified and
how many of its nodes were accepted, over Spec-Bench's 13 prompts at batch 1.

    python benchmarks/guard_probes.py auto      # or suffix, ngram, ...; bundled model, 128 tokens
"""

from __future__ import annotations

import sys
from collections import Counter

import torch

from specserve import LLM, SamplingParams
from specserve.bench.spec import chat_prompts, open_dataset
from specserve.speculation.guard import Mode


def main() -> None:
    method = sys.argv[1] if len(sys.argv) > 1 else "auto"
    torch.set_num_threads(2)
    llm = LLM(speculative=dict(method=method), threads=2)
    tok = llm.tokenizer
    prompts = chat_prompts(open_dataset("spec-bench", None), 1, 128, tok)
    sp = llm.engine.core.speculator
    probes: Counter[tuple[str | None, int | None]] = Counter()
    learn = sp._learn

    def counting(step, seconds):  # the step's record, before the speculator learns from it
        if step.guard is not None and step.guard[1] is Mode.PROBE:
            for r in step.rows.values():
                drafted = r.drafted is not None and r.verdict is not None
                probes[(r.drafted.name if drafted else None, len(r.verdict.accepted) if drafted else None)] += 1
        return learn(step, seconds)

    sp._learn = counting
    for p in prompts:
        llm.generate([p], SamplingParams(max_tokens=128, temperature=0), use_tqdm=False)
    s = llm.engine.speculation_stats()
    print(f"{method}: {s.guard_probes} probes, {s.guard_plain_steps} steps kept plain, turned off {s.guard_turned_off}")
    for (name, accepted), n in probes.most_common():
        print(f"  verified {name or 'nothing'}: {'' if accepted is None else f'{accepted} accepted, '}{n} probes")


if __name__ == "__main__":
    main()
