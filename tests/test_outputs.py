"""What callers see: text decoded incrementally equals the full decode, stop conditions cut where
defined, streaming deltas add up to the final text, logprobs come per token."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from specserve import LLM, SamplingParams
from specserve.tokenizer import IncrementalDetokenizer, load_tokenizer

from conftest import EOS_ID, random_prompts

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.mark.parametrize("text", ["héllo wörld", "日本語のテキスト", "emoji 🙂🚀 end", "plain ascii"])
def test_incremental_detokenization_matches_full_decode(tiny_llama: Path, text: str) -> None:
    tok = load_tokenizer(tiny_llama)
    ids = tok(text).input_ids
    detok = IncrementalDetokenizer(tok, [])
    pieces = [detok.add([t]) for t in ids]
    detok.flush()
    assert "".join(pieces) == detok.text == text
    assert all("\ufffd" not in p for p in pieces)  # never emits half a character


def test_stop_token_id_cuts_and_is_kept_in_ids(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama))
    prompt = random_prompts(1, seed=12)[0]
    free = llm.generate(prompt, SamplingParams(max_tokens=30, **GREEDY), use_tqdm=False)[0]
    stop_id = free.token_ids[6]
    first = free.token_ids.index(stop_id)
    out = llm.generate(prompt, SamplingParams(max_tokens=30, stop_token_ids=[stop_id], **GREEDY), use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[: first + 1]


def test_eos_stops_unless_ignored(tiny_llama: Path, tmp_path: Path) -> None:
    prompt = random_prompts(1, seed=13)[0]
    free = LLM(str(tiny_llama)).generate(prompt, SamplingParams(max_tokens=30, **GREEDY), use_tqdm=False)[0]
    eos = free.token_ids[5]
    # The same weights, with that token declared the end of sequence.
    model_dir = tmp_path / "eos-model"
    shutil.copytree(tiny_llama, model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["eos_token_id"] = eos
    (model_dir / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(model_dir))
    out = llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0), use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    # The tokenizer's own EOS (</s>) still counts too, as in vLLM.
    cut = next(i for i, t in enumerate(free.token_ids) if t in (eos, EOS_ID))
    assert out.token_ids == free.token_ids[: cut + 1]
    ignored = llm.generate(prompt, SamplingParams(max_tokens=30, **GREEDY), use_tqdm=False)[0]
    assert ignored.finish_reason == "length" and ignored.token_ids == free.token_ids


def test_logprobs_per_token(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama))
    out = llm.generate(random_prompts(1, seed=14)[0], SamplingParams(max_tokens=5, logprobs=3, **GREEDY),
                       use_tqdm=False)[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and len(lp.top) == 3
        assert lp.top[0][0] == tok  # greedy picks the most likely token
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


@pytest.fixture(scope="module")
def smollm() -> LLM:
    from specserve.model.loader import ModelNotFoundError

    try:
        return LLM("smollm2-135m")
    except ModelNotFoundError as e:
        pytest.skip(str(e))


@pytest.mark.slow
def test_stop_strings_and_streaming_on_the_bundled_model(smollm: LLM) -> None:
    messages = [{"role": "user", "content": "List the numbers from one to ten in words, separated by commas."}]
    free = smollm.chat(messages, SamplingParams(max_tokens=60, temperature=0), use_tqdm=False)[0]
    assert free.finish_reason in ("stop", "length") and free.text
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    cut = smollm.chat(messages, SamplingParams(max_tokens=60, temperature=0, stop=[stop]), use_tqdm=False)[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop)]
    kept = smollm.chat(messages, SamplingParams(max_tokens=60, temperature=0, stop=[stop],
                                                include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.text == free.text[: free.text.index(stop) + len(stop)]

    from specserve.tokenizer import apply_chat_template

    ids = apply_chat_template(smollm.tokenizer, messages)
    deltas = [o.new_text for o in smollm.stream(ids, SamplingParams(max_tokens=60, temperature=0, stop=[stop]))]
    assert "".join(deltas) == cut.text  # held-back text never leaks a partial stop string


@pytest.mark.slow
def test_chat_answers_on_the_bundled_model() -> None:
    # in float32 (the reference weights): the default path (the file's Q4_1 blocks x int8 activations) answers this
    # 135M model's bare question with French words, as llama.cpp does on the same Q4_1 file
    llm = LLM("smollm2-135m", quantization="none")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=32, temperature=0), use_tqdm=False)[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # ends with <|im_end|>
    assert out.metrics.ttft is not None and out.metrics.ttft >= 0


def test_engine_core_gives_token_deltas_and_a_stop_string_ends_the_request_in_it(tiny_llama: Path) -> None:
    """The core's boundary: token ids in, token deltas out (no text), the same tokens LLM.generate
    gives. Stop strings are text, found around the core: the text ends at the string, and the core
    is told at once: nothing of the request runs after that step and its KV blocks are free."""
    from specserve.outputs import TokenDelta

    llm = LLM(str(tiny_llama))
    engine = llm.engine
    prompt = random_prompts(1, seed=21)[0]
    want = llm.generate([prompt], SamplingParams(max_tokens=24, **GREEDY), use_tqdm=False)[0]
    engine.core.add_request("core", list(prompt), SamplingParams(max_tokens=24, **GREEDY))
    deltas: list[TokenDelta] = []
    while engine.core.has_unfinished_requests():
        deltas += engine.core.step()
    assert all(isinstance(d, TokenDelta) for d in deltas) and deltas[-1].finish_reason == "length"
    assert [t for d in deltas for t in d.new_token_ids] == want.token_ids
    stop = next(want.text[i : i + 3] for i in range(6, len(want.text) - 3) if want.text[i : i + 3].strip())
    engine.add_request(list(prompt), SamplingParams(max_tokens=24, stop=[stop], **GREEDY), request_id="stopped")
    outs = []
    while not (outs and outs[-1].finished):
        outs += [o for o in engine.step() if o.request_id == "stopped"]
        if outs and outs[-1].finished:
            assert not engine.core.has_unfinished_requests()  # aborted in the core in the same step
    assert outs[-1].finish_reason == "stop" and outs[-1].text == want.text[: want.text.index(stop)]
    assert "".join(o.new_text for o in outs) == outs[-1].text
    assert engine.blocks.num_used_blocks == 0


def test_every_end_of_turn_token_ends_generation(tiny_llama: Path, tmp_path: Path) -> None:
    """A model's chat format may end a turn with a token other than its declared eos (Qwen2.5:
    <|endoftext|> beside <|im_end|>): those added tokens stop generation, as in llama.cpp; an added
    token that ends nothing does not."""
    from specserve.tokenizer import end_of_generation_ids

    model_dir = tmp_path / "eog-model"
    shutil.copytree(tiny_llama, model_dir)
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    hf.add_tokens(["<|endoftext|>", "<|im_end|>", "<tool_call>"], special_tokens=True)
    hf.save_pretrained(str(model_dir))
    tok = load_tokenizer(model_dir)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>", "<tool_call>")}
    assert end_of_generation_ids(tok) == {ids["<|endoftext|>"], ids["<|im_end|>"]}
    eos = LLM(str(model_dir)).engine.eos_token_ids
    assert {ids["<|endoftext|>"], ids["<|im_end|>"], EOS_ID} <= eos and ids["<tool_call>"] not in eos
