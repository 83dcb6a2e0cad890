"""Usage: python benchmarks/scoring_prefix.py

Scoring like a harness: one context, several continuations, max_tokens 0 + prompt_logprobs;
with the prompt-logprob store (default) against prefix caching off. Bundled model."""
import time, statistics
from specserve import LLM, SamplingParams
llm_on = LLM(quantization="int4", threads=2)
tok = llm_on.tokenizer
context = ("The following is a passage about the history of computing. " * 40)
conts = [" It began with the abacus.", " It began with punched cards.", " It began with vacuum tubes.", " It began with transistors."]
p = SamplingParams(max_tokens=0, prompt_logprobs=1)
def run(llm, tag):
    times = []
    for rep in range(3):
        ctx = f"[{tag}{rep}:{time.time()}] " + context  # a new context each time: the first continuation computes it
        t = time.perf_counter()
        for c in conts:  # one request at a time, as lm-eval's API models send them by default
            llm.generate(ctx + c, p, use_tqdm=False)
        times.append(time.perf_counter() - t)
    return statistics.median(times)
llm_off = LLM(quantization="int4", threads=2, enable_prefix_caching=False)
print("context tokens", len(tok(context).input_ids))
for name, llm in (("store", llm_on), ("no prefix cache", llm_off), ("store", llm_on), ("no prefix cache", llm_off)):
    print(name, f"{run(llm, name):.3f}s for 4 continuations")
