"""Output tok/s of one `LLM.generate` over a dataset's prompts as one continuous batch of at most
--batch requests (greedy, 128 tokens), for comparing two builds of the engine in alternation:

    for d in /path/to/before /path/to/after /path/to/after /path/to/before; do
      PYTHONPATH=$d python benchmarks/generate_rate.py --spec none --batch 8 --json-dir out/; done

(a checkout without its own build needs the compiled specserve/_C*.so copied in). Prints one JSON
line: where the engine came from, the rate, and a digest of the outputs (two builds whose kernels sum
in other orders may differ after a while: greedy ties broken by the last bits).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default="none", help="a --spec method, or none")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dataset", default="sharegpt")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, help="append the JSON line to this file")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import specserve
    from specserve import LLM, SamplingParams
    from specserve.bench.datasets import open_dataset
    from specserve.bench.spec import chat_prompts

    llm = LLM(max_num_seqs=a.batch, speculative=None if a.spec == "none" else dict(method=a.spec))
    prompts = chat_prompts(open_dataset(a.dataset, None), a.prompts, a.max_tokens, llm.tokenizer)
    llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=a.max_tokens, temperature=0), use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    digest = hashlib.sha256(json.dumps([list(o.token_ids) for o in outs]).encode()).hexdigest()[:12]
    line = json.dumps(dict(engine=str(Path(specserve.__file__).parent.parent), spec=a.spec, batch=a.batch,
                           dataset=a.dataset, tok_s=round(tokens / seconds, 1), seconds=round(seconds, 3),
                           tokens=tokens, digest=digest))
    print(line)
    if a.json:
        with a.json.open("a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
