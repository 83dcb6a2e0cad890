"""Session 27's rules for `auto` with a draft model against session 26's, at batch 8 (ShareGPT's
first 32 usable prompts, greedy, up to 256 tokens, one continuous batch of at most 8), every engine
built in one process and run in turn over the same prompts. Variants, comma-separated: `none`;
`new` (the code as it is); names holding `oldcatch` (the catch-up bound alone: CATCH_UP_SHARE 0),
`noclear` (no shared control interval) and `grosschoose` (lookups' worth counted gross) for the
rules they name turned back, `probe5` (five probe tries a size, as on 428a99b). Since 9ab9931 the first three apply
at batch 1 only, so at batch 8 `new` is session 26's rules.

    python benchmarks/b8_rules_ab.py $M $D none,new,grosschoose-oldcatch-noclear
"""

from __future__ import annotations

import sys
import time

import torch


def main() -> None:
    from specserve import LLM, SamplingParams
    from specserve.bench.datasets import open_dataset
    from specserve.bench.spec import chat_prompts
    import specserve.engine.drafting as drafting

    target, draft, variants = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    torch.set_num_threads(2)
    llms = {}
    for v in variants:
        if v == "none":
            llms[v] = LLM(target, max_num_seqs=8)
            continue
        tries = drafting.PROBE_TRIES
        drafting.PROBE_TRIES = 5 if "probe5" in v else tries
        llm = LLM(target, max_num_seqs=8, speculative=dict(method="auto", draft_model=draft))
        drafting.PROBE_TRIES = tries
        sp = llm.engine.core.speculator
        if "oldcatch" in v:
            sp.CATCH_UP_SHARE = 0.0
        if "noclear" in v:
            sp.guard._clearly_pays = lambda *args: False
        if "grosschoose" in v:
            worth = sp._worth
            sp._worth = lambda name, rid, nodes, cost=0.0, worth=worth: worth(name, rid, nodes)
        llms[v] = llm
    tokenizer = llms[variants[0]].tokenizer
    prompts = chat_prompts(open_dataset("sharegpt", None), 32, 256, tokenizer)
    params = SamplingParams(max_tokens=256, temperature=0)
    for llm in llms.values():
        llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)  # warm-up
    for v, llm in llms.items():
        start = time.perf_counter()
        tokens = sum(len(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False))
        seconds = time.perf_counter() - start
        stats = llm.engine.core.speculator.stats() if v != "none" else None
        extra = "" if stats is None else (f"  steps {stats.steps}, accepted {stats.accepted}, guard plain "
                                          f"{stats.guard_plain_steps}, turned off {stats.guard_turned_off}")
        print(f"{v:<40} {tokens / seconds:6.1f} tok/s  {tokens} tokens  {seconds:.1f} s{extra}", flush=True)


if __name__ == "__main__":
    main()
