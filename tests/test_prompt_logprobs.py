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


def test_a_scoring_request_computes_its_prompt_and_publishes_it(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), block_size=4)
    ids = random_prompts(1, seed=33, low=30, high=31)[0]
    score = SamplingParams(max_tokens=0, prompt_logprobs=0)
    first = llm.generate(ids, score, use_tqdm=False)[0]
    again = llm.generate(ids, score, use_tqdm=False)[0]
    assert again.metrics.num_cached_prompt_tokens == 0  # K/V in the cache has no logits: recomputed
    assert [e.logprob for e in again.prompt_logprobs[1:]] == pytest.approx(  # type: ignore[index,union-attr]
        [e.logprob for e in first.prompt_logprobs[1:]], abs=1e-5)  # type: ignore[index,union-attr]
    plain = llm.generate(ids, SamplingParams(max_tokens=1, **GREEDY), use_tqdm=False)[0]
    assert plain.metrics.num_cached_prompt_tokens == 28  # the scoring request published its blocks
    assert plain.prompt_logprobs is None


def test_prompt_logprobs_out_of_range_names_the_field() -> None:
    for bad in (-1, 21, True, 1.5):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(prompt_logprobs=bad)
        assert e.value.field == "prompt_logprobs"
