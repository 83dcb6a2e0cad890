"""Per-step time of the bundled model over the 13 Spec-Bench prompts (128 tokens each), plain or with a drafter.

    python benchmarks/spec_step_profile.py none 0
    python benchmarks/spec_step_profile.py ngram 4

Prints tokens/s, the number of steps, mean and median step time, and a cProfile by self time.
"""
import torch, time, cProfile, pstats, sys
from specserve import LLM, SamplingParams
from specserve.bench.spec import load_by_category
from specserve.tokenizer import apply_chat_template
method = sys.argv[1]; k = int(sys.argv[2])
llm = LLM(speculative=dict(method=method, num_tokens=k) if method != "none" else None)
e = llm.engine
qs = load_by_category(None, 1)
ps = [apply_chat_template(llm.tokenizer, [{"role":"user","content":q}]) for _, q in qs]
llm.generate(ps[0], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
orig = e.step
times = []
def timed():
    t = time.perf_counter(); r = orig(); times.append(time.perf_counter() - t); return r
e.step = timed
pr = cProfile.Profile()
t=time.perf_counter()
pr.enable()
n=0
for p in ps: n += len(llm.generate(p, SamplingParams(max_tokens=128, temperature=0), use_tqdm=False)[0].token_ids)
pr.disable()
dt=time.perf_counter()-t
import statistics
print(method, "tok/s", n/dt, "steps", len(times), "mean step ms", 1000*sum(times)/len(times), "median", 1000*statistics.median(times), "max", 1000*max(times), "sum steps", sum(times), "total", dt)
st = pstats.Stats(pr); st.sort_stats("tottime").print_stats(12)
