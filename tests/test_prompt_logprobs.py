"""Prompt logprobs (scoring): every prompt token's logprob under the model, as the reference model
gives it, whatever the chunking; `max_tokens=0` scores without generating; a scoring request
computes its whole prompt (cached K/V has no logits) yet publishes its blocks for others."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.errors import InvalidRequestError

from conftest import random_prompts

GREEDY = dict(temperature=0, ignore_eos=True)


def reference_logprobs(path: Path, ids: list[int]) -> torch.Tensor:
    """log p(ids[q] | ids[:q]) for q = 1.., from transformers' forward of the same weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.mark.parametrize("options", [{}, dict(max_num_batched_tokens=16)], ids=["whole", "chunked16"])
def test_prompt_logprobs_match_the_reference_model(tiny_llama: Path, options: dict) -> None:
    ids = random_prompts(1, seed=31, low=40, high=41)[0]
    llm = LLM(str(tiny_llama), **options)
    out = llm.generate(ids, SamplingParams(max_tokens=2, prompt_logprobs=3, **GREEDY), use_tqdm=False)[0]
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(ids) and plp[0] is None
    ref = reference_logprobs(tiny_llama, ids)
    got = torch.tensor([e.logprob for e in plp[1:]])  # type: ignore[union-attr]
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    for q, entry in enumerate(plp[1:], start=1):
        assert entry is not None and entry.token_id == ids[q]
        assert len(entry.top) == 3 and entry.top[0][1] >= entry.logprob - 1e-6  # the top one is the most likely
        assert [v for _, v in entry.top] == sorted((v for _, v in entry.top), reverse=True)
    assert len(out.token_ids) == 2


def test_scoring_a_generation_gives_the_logprobs_it_was_generated_with(tiny_llama: Path) -> None:
    """Score prompt + greedy output with max_tokens=0: the output tokens' prompt logprobs are the
    logprobs they were generated with."""
    llm = LLM(str(tiny_llama))
    prompt = random_prompts(1, seed=32)[0]
    gen = llm.generate(prompt, SamplingParams(max_tokens=6, logprobs=2, **GREEDY), use_tqdm=False)[0]
    scored = llm.generate(prompt + gen.token_ids, SamplingParams(max_tokens=0, prompt_logprobs=2), use_tqdm=False)[0]
    assert scored.token_ids == [] and scored.finish_reason == "length" and scored.text == ""
    tail = scored.prompt_logprobs[len(prompt):]  # type: ignore[index]
    assert [e.token_id for e in tail] == gen.token_ids  # type: ignore[union-attr]
    for mine, theirs in zip(tail, gen.logprobs):  # type: ignore[arg-type]
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
    assert llm.engine.blocks.num_used_blocks == 0  # nothing leaked by a request that never decoded


def _lps(out) -> list[float]:  # type: ignore[no-untyped-def]
    return [e.logprob for e in out.prompt_logprobs[1:]]


def test_scoring_requests_share_a_prefix_and_its_logprobs(tiny_llama: Path) -> None:
    """What harnesses send: one context with several continuations. The first request computes
    everything and keeps its blocks' logprobs beside the prefix cache; the next ones read the shared
    blocks and their logprobs, and get the same numbers as an engine without a prefix cache (top
    alternatives included). A request asking for more alternatives than were kept recomputes; a
    plain request reads the blocks a scoring request published."""
    context = random_prompts(1, seed=33, low=30, high=31)[0]
    choices = [[5, 6, 7], [8, 9], [5, 6, 10, 11, 12]]
    score = SamplingParams(max_tokens=0, prompt_logprobs=2)
    fresh = LLM(str(tiny_llama), block_size=4, enable_prefix_caching=False)
    want = [fresh.generate(context + c, score, use_tqdm=False)[0] for c in choices]
    llm = LLM(str(tiny_llama), block_size=4)
    got = [llm.generate(context + c, score, use_tqdm=False)[0] for c in choices]
    assert got[0].metrics.num_cached_prompt_tokens == 0
    assert all(g.metrics.num_cached_prompt_tokens == 28 for g in got[1:])  # 7 full blocks of the context
    for g, w in zip(got, want):
        assert _lps(g) == pytest.approx(_lps(w), abs=1e-5)
        assert [[t for t, _ in e.top] for e in g.prompt_logprobs[1:]] == [[t for t, _ in e.top] for e in w.prompt_logprobs[1:]]
        assert [e.token_id for e in g.prompt_logprobs[1:]] == (context + choices[got.index(g)])[1:]
    wider = llm.generate(context + choices[0], SamplingParams(max_tokens=0, prompt_logprobs=5), use_tqdm=False)[0]
    assert wider.metrics.num_cached_prompt_tokens == 0 and all(len(e.top) == 5 for e in wider.prompt_logprobs[1:])
    narrower = llm.generate(context + choices[1], SamplingParams(max_tokens=0, prompt_logprobs=1), use_tqdm=False)[0]
    assert narrower.metrics.num_cached_prompt_tokens == 28 and all(len(e.top) == 1 for e in narrower.prompt_logprobs[1:])
    plain = llm.generate(context, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0]
    assert plain.metrics.num_cached_prompt_tokens == 28 and plain.prompt_logprobs is None
    assert llm.engine.blocks.num_used_blocks == 0


def test_prompt_logprobs_out_of_range_names_the_field() -> None:
    for bad in (-1, 21, True, 1.5):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(prompt_logprobs=bad)
        assert e.value.field == "prompt_logprobs"
