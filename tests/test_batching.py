"""A request's output does not depend on its batch, on chunked prefill, prefix-cache hits or preemption;
and every KV block is free once all requests are done or aborted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.engine.engine import LLMEngine

from conftest import random_prompts

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def assert_all_blocks_free(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert engine.blocks.num_used_blocks == 0


def run_to_end(engine: LLMEngine, prompts: list, params: SamplingParams) -> dict[str, list[int]]:
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return {i: done[i] for i in ids}


@pytest.fixture(scope="module")
def alone(tiny_llama: Path) -> list[list[int]]:
    """Each prompt run by itself: the reference every batched configuration must reproduce."""
    llm = LLM(str(tiny_llama))
    return [llm.generate(p, GREEDY, use_tqdm=False)[0].token_ids for p in random_prompts(8, seed=3)]


@pytest.mark.parametrize(
    "config",
    [
        dict(),  # defaults: chunked prefill on, large budget
        dict(max_num_batched_tokens=16),  # prefills split in chunks riding along with decodes
        dict(max_num_batched_tokens=40, enable_chunked_prefill=False),
        dict(enable_prefix_caching=False),
        dict(max_num_seqs=3),  # requests queue and join mid-flight
        dict(num_kv_blocks=20, block_size=4),  # tiny pool: forces preemption by recompute
    ],
    ids=["default", "chunked16", "no-chunking", "no-prefix-cache", "max3seqs", "preemption"],
)
def test_batch_of_8_matches_alone(tiny_llama: Path, alone: list[list[int]], config: dict) -> None:
    llm = LLM(str(tiny_llama), **config)
    outs = run_to_end(llm.engine, random_prompts(8, seed=3), GREEDY)
    assert list(outs.values()) == alone
    if "num_kv_blocks" in config:
        assert llm.engine.stats().num_preemptions > 0, "the tiny pool should have forced preemption"
    assert_all_blocks_free(llm.engine)


def test_prefix_cache_hit_skips_prefill_and_keeps_output(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), block_size=4)
    shared = random_prompts(1, seed=5, low=30, high=31)[0]
    first = llm.generate(shared + [7, 8, 9], GREEDY, use_tqdm=False)[0]
    assert first.metrics.num_cached_prompt_tokens == 0
    second = llm.generate(shared + [7, 8, 9], GREEDY, use_tqdm=False)[0]
    # 33 prompt tokens: 8 full blocks of 4 are reusable (the last token is always computed).
    assert second.metrics.num_cached_prompt_tokens == 32
    assert second.token_ids == first.token_ids
    other = llm.generate(shared + [10, 11], GREEDY, use_tqdm=False)[0]
    assert other.metrics.num_cached_prompt_tokens == 28  # 30 shared tokens = 7 full blocks
    fresh = LLM(str(tiny_llama), block_size=4, enable_prefix_caching=False)
    assert fresh.generate(shared + [10, 11], GREEDY, use_tqdm=False)[0].token_ids == other.token_ids
    assert llm.engine.stats().prefix_cache_hit_rate > 0
    assert_all_blocks_free(llm.engine)


def test_aborts_free_every_block(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), block_size=4, num_kv_blocks=40, max_num_batched_tokens=32)
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in random_prompts(8, seed=6)]
    engine.step()
    engine.step()
    engine.abort_request(ids[0])  # running
    engine.abort_request(ids[-1])  # likely still waiting
    engine.abort_request("no-such-request")  # harmless
    finished = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished.add(out.request_id)
                if len(finished) == 2:
                    engine.abort_request(ids[3])
    assert ids[0] not in finished and ids[-1] not in finished
    assert_all_blocks_free(engine)


def test_seeded_sampling_is_batch_invariant(tiny_llama: Path) -> None:
    """A seeded request draws the same tokens alone and inside different batches."""
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    other = SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True)
    prompt = random_prompts(1, seed=7)[0]
    llm = LLM(str(tiny_llama))
    alone = llm.generate(prompt, params, use_tqdm=False)[0].token_ids
    for seed in (8, 9):
        batch = random_prompts(5, seed=seed)
        outs = llm.generate([batch[0], prompt, *batch[1:]], [other, params] + [other] * 4, use_tqdm=False)
        assert outs[1].token_ids == alone
    preempting = LLM(str(tiny_llama), num_kv_blocks=20, block_size=4)
    outs = preempting.generate([prompt] + random_prompts(5, seed=10), [params] + [other] * 5, use_tqdm=False)
    assert outs[0].token_ids == alone


def test_runner_returns_the_hidden_states_behind_the_logits(tiny_llama) -> None:
    """The forward gives back, with the logits, the final-normed hidden states they were computed
    from (what a learned drafter drafts from): the LM head of those rows is those logits."""
    from specserve.engine.model_runner import ForwardItem

    llm = LLM(str(tiny_llama))
    runner = llm.engine.runner
    out = runner.run([ForwardItem([0], 0, [5, 6, 7], logits="all"), ForwardItem([1], 0, [8, 9], logits="last")])
    assert out.rows == [(0, 3), (3, 1)]
    assert out.hidden.shape == (4, llm.engine.model.config.hidden_size)
    torch.testing.assert_close(llm.engine.model.compute_logits(out.hidden), out.logits)


@pytest.mark.parametrize("max_tokens", [1, 2])
def test_a_request_that_ends_at_once_still_publishes_its_prompt_to_the_prefix_cache(
    tiny_llama: Path, max_tokens: int
) -> None:
    """Scoring clients send many max_tokens=1 requests over shared prefixes: a request that finishes
    in the step that computed its prompt publishes the prompt's full blocks before they are freed,
    so the same prompt again reuses them (it used to hit nothing)."""
    llm = LLM(str(tiny_llama), block_size=16)
    prompt = random_prompts(1, seed=9, low=256, high=257)[0]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    second = llm.generate([prompt], params, use_tqdm=False)[0]
    assert first.metrics.num_cached_prompt_tokens == 0
    assert second.metrics.num_cached_prompt_tokens == 240  # 16 full blocks, the last token computed again
    assert second.token_ids == first.token_ids
    assert_all_blocks_free(llm.engine)


def test_the_imports_are_frozen_and_a_dropped_engine_is_reclaimed(tiny_llama: Path) -> None:
    """Building an LLM leaves the imports' objects out of full garbage collections (they would
    walk every one of them each time) but not the engine's: an LLM dropped, reference cycles
    and all, is reclaimed by the next collection, model and K/V cache with it."""
    import gc
    import weakref

    first = LLM(str(tiny_llama))
    tracked = gc.get_objects()  # what full collections walk (frozen objects are not among them)
    assert not any(o is LLM.__init__ for o in tracked) and any(o is first.engine for o in tracked)
    del tracked
    kv = weakref.ref(first.engine.core.runner.kv_cache[0][0])
    weight = weakref.ref(first.engine.core.runner.model.embed_tokens.weight)
    cycle = weakref.ref(first.engine.core.scheduler)  # held by the core, and holding the core's bound methods
    del first
    gc.collect()
    assert kv() is None and weight() is None and cycle() is None
