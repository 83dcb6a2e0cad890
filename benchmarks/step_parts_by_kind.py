"""Where a batch's steps go, by kind: decode-only steps and steps carrying a prompt chunk, each
split into propose, forward (`ModelRunner.execute`), verify and observe, for `--spec none` and
`--spec auto` in turn (two rounds), with the batch's wall time. The speculator's own Python per
step is propose + verify + observe less what the plain engine spends in the same calls.

    python benchmarks/step_parts_by_kind.py --batch 4 --prompts 16
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from typing import Any, Callable

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dataset", default="sharegpt")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from specserve import LLM, SamplingParams
    from specserve.bench.datasets import open_dataset
    from specserve.bench.spec import load_questions
    from specserve.tokenizer import apply_chat_template

    torch.set_num_threads(a.threads)
    for _ in range(a.rounds):
        for name, spec in (("none", None), ("auto", dict(method="auto"))):
            llm = LLM(a.model, max_num_seqs=a.batch, speculative=spec)
            core, sp = llm.engine.core, llm.engine.core.speculator
            acc: dict[tuple[str, str], float] = defaultdict(float)
            kind = {"now": "decode"}

            def wrap(obj: Any, attr: str, label: str) -> None:
                f: Callable[..., Any] = getattr(obj, attr)

                def timed(*args: Any, f: Callable[..., Any] = f, label: str = label, **kwargs: Any) -> Any:
                    start = time.perf_counter()
                    try:
                        return f(*args, **kwargs)
                    finally:
                        acc[(kind["now"], label)] += time.perf_counter() - start

                setattr(obj, attr, timed)

            inner = core._step

            def step(batch: Any, inner: Callable[..., Any] = inner) -> Any:
                mixed = any(it.seq.num_computed_tokens < it.seq.num_prompt_tokens for it in batch)
                kind["now"] = "mixed" if mixed else "decode"
                acc[(kind["now"], "steps")] += 1
                return inner(batch)

            core._step = step
            wrap(core, "_step", "step")
            wrap(sp, "propose", "propose")
            wrap(core.runner, "execute", "forward")
            wrap(sp, "verify", "verify")
            wrap(sp, "observe", "observe")
            prompts = [apply_chat_template(llm.tokenizer, [{"role": "user", "content": q}])
                       for _, q in load_questions(open_dataset(a.dataset, None), a.prompts, a.max_tokens, llm.tokenizer)]
            llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)  # warm-up
            acc.clear()
            start = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=a.max_tokens, temperature=0), use_tqdm=False)
            wall = time.perf_counter() - start
            parts = {f"{k}/{label}": round(v, 3) for (k, label), v in sorted(acc.items())}
            print(f"{name}: wall {wall:.3f} s", parts)


if __name__ == "__main__":
    main()
