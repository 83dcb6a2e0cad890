"""The OpenAI-compatible server end to end: real `specserve serve` processes on loopback, driven
with the official `openai` client and with httpx.

Two servers start once for the module (in parallel): a plain one and one with `--spec ngram`
(fixed K, so that drafts are certain, and `--max-num-seqs 1 --max-waiting 1`, which also makes the 429 path reachable on purpose).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest
from openai import AsyncOpenAI

from specserve import LLM, SamplingParams
from specserve.tokenizer import apply_chat_template

from conftest import random_prompts
from serverproc import MODEL, Server

MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def servers(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    logs = tmp_path_factory.mktemp("server-logs")
    made = {
        "plain": Server(tiny_llama, logs / "plain.log", "--max-body-bytes", str(MAX_BODY)),
        "spec": Server(tiny_llama, logs / "spec.log", "--spec", "ngram",
                       "--spec-controller", "fixed", "--max-num-seqs", "1",
                       "--max-waiting", "1", "--shutdown-timeout", "2"),
    }
    try:
        for s in made.values():
            s.wait_ready()
        yield made
    finally:
        for s in made.values():
            s.stop()


@pytest.fixture(scope="module")
def server(servers: dict[str, Server]) -> Server:
    return servers["plain"]


@pytest.fixture(scope="module")
def spec_server(servers: dict[str, Server]) -> Server:
    return servers["spec"]


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama))


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


# -- the API answers as the OpenAI client expects ------------------------------------------------


def test_models_and_health(server: Server) -> None:
    """/v1/models lists the served name with its context; /health says the engine runs."""
    models = server.openai.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert server.http.get("/v1/models").json()["data"][0]["max_model_len"] == 1024
    assert server.http.get("/health").status_code == 200


def test_completions_greedy_equal_llm_generate(server: Server, llm: LLM) -> None:
    """Greedy completions over HTTP (token-id prompts, several in one request) are exactly what
    LLM.generate gives for the same prompts; choices come back in prompt order with usage."""
    prompts = random_prompts(3, seed=11)
    expected = llm.generate(prompts, greedy(12, ignore_eos=True), use_tqdm=False)
    res = server.openai.completions.create(model=MODEL, prompt=prompts, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert [c.index for c in res.choices] == [0, 1, 2]
    assert [c.text for c in res.choices] == [e.text for e in expected]
    assert all(c.finish_reason == "length" for c in res.choices)
    assert res.usage.prompt_tokens == sum(len(p) for p in prompts)
    assert res.usage.completion_tokens == 36 and res.usage.total_tokens == res.usage.prompt_tokens + 36
    # A text prompt, and the OpenAI default of 16 tokens when max_tokens is not given.
    text = server.openai.completions.create(model=MODEL, prompt="Hello there", temperature=0,
                                            extra_body={"ignore_eos": True})
    assert text.choices[0].text == llm.generate("Hello there", greedy(16, ignore_eos=True), use_tqdm=False)[0].text
    assert text.usage.completion_tokens == 16


def test_spec_server_is_lossless_and_counts_speculation(spec_server: Server, llm: LLM) -> None:
    """With --spec ngram, greedy outputs are token for token those of plain decoding; the speculation
    counters in /metrics move (drafts proposed and verified), and each response's usage says what was
    drafted for it (OpenAI's accepted/rejected prediction tokens, summing to /metrics' drafts)."""
    prompts = [list(b"abcabcabcabc the cat the cat the cat"), *random_prompts(2, seed=12)]
    expected = llm.generate(prompts, greedy(40, ignore_eos=True), use_tqdm=False)
    before = spec_server.metrics()
    drafted = accepted = 0
    for prompt, exp in zip(prompts, expected):
        res = spec_server.openai.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                                    extra_body={"ignore_eos": True})
        assert res.choices[0].text == exp.text
        details = res.usage.completion_tokens_details
        assert details.accepted_prediction_tokens < res.usage.completion_tokens
        accepted += details.accepted_prediction_tokens
        drafted += details.accepted_prediction_tokens + details.rejected_prediction_tokens
    m = spec_server.metrics()
    assert drafted == m["specserve_spec_draft_tokens_total"] - before.get("specserve_spec_draft_tokens_total", 0)
    assert accepted == m["specserve_spec_accepted_tokens_total"] - before.get("specserve_spec_accepted_tokens_total", 0)
    assert accepted > 0  # the repetitive prompt's drafts were taken
    assert m["specserve_spec_draft_tokens_total"] > 0
    assert m["specserve_spec_verification_steps_total"] > 0
    assert m["specserve_spec_accepted_tokens_total"] >= m.get('specserve_spec_accepted_tokens_by_position_total{position="1"}', 0)


def test_spec_stream_chunks_carry_accepted_runs(spec_server: Server, llm: LLM) -> None:
    """Under speculation a stream chunk is one engine step: it carries every token the step
    accepted (several when a draft was accepted), the chunks add up to all tokens, and the text is
    still exactly plain greedy decoding's."""
    expected = llm.generate("x", greedy(60, ignore_eos=True), use_tqdm=False)[0]
    accepted_before = spec_server.metrics()["specserve_spec_accepted_tokens_total"]
    chunks = list(spec_server.openai.completions.create(model=MODEL, prompt="x", max_tokens=60, temperature=0,
                                                        logprobs=0, stream=True, extra_body={"ignore_eos": True}))
    sizes = [len(c.choices[0].logprobs.tokens) for c in chunks if c.choices[0].logprobs]
    assert sum(sizes) == 60
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    accepted = spec_server.metrics()["specserve_spec_accepted_tokens_total"] - accepted_before
    assert accepted > 0, "this prompt is one where n-gram drafts get accepted"
    assert max(sizes) > 1
    assert len(sizes) >= 60 - accepted  # one chunk per step (a run cut by max_tokens counts in full)


def test_chat_stream_and_non_stream(server: Server, llm: LLM) -> None:
    """Chat uses the model's chat template: the reply equals LLM.chat's; streaming yields the role
    first, then deltas that join to the same text, the same finish reason, and [DONE]."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    expected = llm.chat(messages, greedy(24, ignore_eos=True), use_tqdm=False)[0]
    res = server.openai.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=24,
                                                temperature=0, extra_body={"ignore_eos": True})
    assert res.object == "chat.completion"
    assert res.choices[0].message.role == "assistant"
    assert res.choices[0].message.content == expected.text
    assert res.choices[0].finish_reason == "length"
    assert res.usage.prompt_tokens == len(expected.prompt_token_ids) and res.usage.completion_tokens == 24

    chunks = list(server.openai.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                                        temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    # Without max_tokens, chat generates up to the context (vLLM's behavior), then stops with "length".
    full = server.openai.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                 extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.usage.total_tokens == 1024
    raw = server.http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 3,
                                                         "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.rstrip().endswith("data: [DONE]")


def test_usage_in_streams(server: Server) -> None:
    """stream_options.include_usage adds a final chunk with empty choices and the same token counts as
    the non-streaming answer (what speculation drafted may differ: the controller decides by
    measured step times); the other chunks carry usage null."""
    kw: dict[str, Any] = dict(model=MODEL, prompt="Count: one two", max_tokens=10, temperature=0, n=2)
    plain = server.openai.completions.create(**kw)
    chunks = list(server.openai.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [getattr(chunks[-1].usage, k) for k in counts] == [getattr(plain.usage, k) for k in counts]
    assert chunks[-1].usage.completion_tokens_details is not None
    assert all(c.usage is None for c in chunks[:-1])
    texts = ["", ""]
    for c in chunks[:-1]:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in plain.choices]


def test_n_choices_and_seed(server: Server) -> None:
    """n=2 samples two different choices; with a seed they reproduce, and choice i uses seed + i
    (so choice 0 equals the n=1 answer with the same seed)."""
    kw: dict[str, Any] = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=123,
                              extra_body={"ignore_eos": True})
    a = server.openai.completions.create(n=2, **kw)
    b = server.openai.completions.create(n=2, **kw)
    assert len(a.choices) == 2
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text
    assert server.openai.completions.create(n=1, **kw).choices[0].text == a.choices[0].text
    assert server.openai.completions.create(n=1, **{**kw, "seed": 124}).choices[0].text == a.choices[1].text
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=16,
                temperature=1.0, seed=7, n=3)
    c1 = server.openai.chat.completions.create(**chat)
    c2 = server.openai.chat.completions.create(**chat)
    assert [c.message.content for c in c1.choices] == [c.message.content for c in c2.choices]
    assert len({c.message.content for c in c1.choices}) > 1


def test_stop_strings(server: Server) -> None:
    """A stop string (str or list) ends the text just before its first occurrence, finish_reason stop."""
    kw: dict[str, Any] = dict(model=MODEL, prompt="The quick brown fox", max_tokens=40, temperature=0,
                              extra_body={"ignore_eos": True})
    full = server.openai.completions.create(**kw).choices[0].text
    k = next(i for i in range(3, len(full) - 1) if full[i : i + 2].isprintable() and "\ufffd" not in full[i : i + 2])
    stop = full[k : k + 2]
    cut = full[: full.index(stop)]
    for s in (stop, [stop, "\x00never"]):
        res = server.openai.completions.create(stop=s, **kw)
        assert res.choices[0].text == cut and res.choices[0].finish_reason == "stop"
    streamed = list(server.openai.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_logprobs(server: Server) -> None:
    """Completions `logprobs: k` and chat `logprobs/top_logprobs` come in the OpenAI shapes: one entry
    per generated token, greedy picks the top alternative, offsets and bytes line up with the text."""
    res = server.openai.completions.create(model=MODEL, prompt="abc", max_tokens=8, temperature=0, logprobs=3,
                                           extra_body={"ignore_eos": True})
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    for chosen, tok, top in zip(lp.token_logprobs, lp.tokens, lp.top_logprobs):
        assert len(top) <= 3 and chosen <= 0
        assert chosen >= max(top.values()) - 1e-5  # greedy: the pick is the most likely token
    assert lp.text_offset[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))

    chat = server.openai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hey"}],
                                                 max_tokens=8, temperature=0, logprobs=True, top_logprobs=2,
                                                 extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 8
    assert all(len(e.top_logprobs) == 2 and e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-5)
               for e in content)
    raw = b"".join(bytes(e.bytes) for e in content)
    assert raw.decode("utf-8", errors="replace") == chat.choices[0].message.content
    streamed = list(server.openai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hey"}],
                                                          max_tokens=8, temperature=0, logprobs=True,
                                                          top_logprobs=2, stream=True,
                                                          extra_body={"ignore_eos": True}))
    tokens = [e.token for c in streamed if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert tokens == [e.token for e in content]


def test_echo_scores_the_prompt_as_the_engine_does(server: Server, llm: LLM) -> None:
    """What scoring harnesses send: `echo` with `logprobs` and max_tokens 0 or 1 (text and token-id
    prompts), and vLLM's `prompt_logprobs`: the prompt comes back with each token's logprob, the
    first one null, equal to the engine's own scoring; streams start with the prompt."""
    text = "The quick brown fox"
    ids = llm.tokenizer(text).input_ids
    ref = llm.generate(ids, SamplingParams(max_tokens=0, prompt_logprobs=2), use_tqdm=False)[0].prompt_logprobs
    want = [None] + [e.logprob for e in ref[1:]]
    for prompt in (text, ids):
        res = server.openai.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
        choice = res.choices[0]
        assert choice.text == text and choice.finish_reason == "length" and res.usage.completion_tokens == 0
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(want[1:], abs=1e-4)
        assert "".join(lp.tokens) == text and len(lp.tokens) == len(ids)
        assert all(len(top) <= 2 for top in lp.top_logprobs[1:])
    one = server.openai.completions.create(model=MODEL, prompt=text, max_tokens=1, echo=True, logprobs=0,
                                           temperature=0)
    lp = one.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and one.choices[0].text.startswith(text)
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(want[1:], abs=1e-4)
    vllm = server.http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "prompt_logprobs": 1,
                                                     "temperature": 0}).json()["choices"][0]
    assert vllm["prompt_logprobs"][0] is None and vllm["text"] == one.choices[0].text[len(text):]
    for entry, token, value in zip(vllm["prompt_logprobs"][1:], ids[1:], want[1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(value, abs=1e-4) and entry[str(token)]["rank"] >= 1
        assert any(v["rank"] == 1 for v in entry.values())
    two = server.openai.completions.create(model=MODEL, prompt=[text, "abc"], max_tokens=2, echo=True, n=2,
                                           temperature=0)
    assert [c.text[: len(p)] for c, p in zip(two.choices, [text, text, "abc", "abc"])] == [text, text, "abc", "abc"]
    streamed = list(server.openai.completions.create(model=MODEL, prompt=text, max_tokens=3, echo=True,
                                                     temperature=0, stream=True))
    assert streamed[0].choices[0].text.startswith(text)
    assert "".join(c.choices[0].text for c in streamed) == text + llm.generate(
        ids, greedy(3), use_tqdm=False)[0].text


def test_tokenize_and_detokenize(server: Server, llm: LLM) -> None:
    """/v1/tokenize gives the ids the engine uses (plain prompt, or chat template for messages);
    /v1/detokenize turns ids back into text."""
    tok = llm.tokenizer
    res = server.http.post("/v1/tokenize", json={"prompt": "héllo"}).json()
    generated = llm.generate("héllo", SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0]
    assert res["tokens"] == generated.prompt_token_ids and res["count"] == len(res["tokens"])
    messages = [{"role": "user", "content": "hi"}]
    res = server.http.post("/v1/tokenize", json={"messages": messages}).json()
    assert res["tokens"] == apply_chat_template(tok, messages)
    back = server.http.post("/v1/detokenize", json={"tokens": list(tok("héllo").input_ids)}).json()
    assert back == {"prompt": tok.decode(list(tok("héllo").input_ids))}
    bad = server.http.post("/v1/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


# -- bad input: the documented status and body, and the server stays up ---------------------------


def _post(server: Server, path: str, body: Any) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return server.http.post(path, content=body, headers={"content-type": "application/json"})
    return server.http.post(path, json=body)


LONG_PROMPT = "x" * 1100  # 1100 byte tokens > the 1024-token context

BAD_INPUTS = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", b"", 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": 3}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [[1, 2, 999999]]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": LONG_PROMPT}, 400, "prompt"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "no role"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": LONG_PROMPT}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "logprobs": True, "top_logprobs": 99}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True,
                              "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"model": "other", "messages": [{"role": "user", "content": "x"}], "stream": True},
     404, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_k": 10**30}, 400, "top_k"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b", "c"], "n": 128}, 400, "n"),  # > --max-waiting
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"five": 10}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"-5": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    # tools: a schema the grammar engine cannot compile, a tool_choice naming no given function, ...
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                                  "type": "object", "properties": {"a": {"type": "frobnicate"}}}}}]},
     400, "tools[0].function.parameters"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "sometimes"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}},
                                        {"type": "function", "function": {"name": "f"}}]},
     400, "tools[1].function.name"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "retrieval", "function": {"name": "f"}}]}, 400, "tools[0].type"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": "{not json"}}]}]},
     400, "messages[0].tool_calls[0].function.arguments"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "structured_outputs": {"structural_tag": {
        "structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}], "triggers": ["<g"]}}}, 400,
     "structured_outputs.structural_tag.structures[0].begin"),
    ("/v1/tokenize", {"prompt": 3}, 400, "prompt"),
    ("/v1/no-such-endpoint", {}, 404, None),
    # structured outputs: a constraint that does not compile is a 400 naming the field it came in
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "structured_outputs": {"regex": "(ab"}}, 400,
     "structured_outputs.regex"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "structured_outputs": {"grammar": "start: nowhere"}}, 400,
     "structured_outputs.grammar"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "structured_outputs": {"choice": []}}, 400,
     "structured_outputs.choice"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "structured_outputs": {}}, 400, "structured_outputs"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "guided_json": {"type": "object"}}, 400, "guided_json"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     400, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "x", "strict": True,
                                  "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}}},
     400, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "yaml"}}, 400, "response_format.type"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema"}}, 400, "response_format.json_schema"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "response_format": {"type": "json_object"},
                         "structured_outputs": {"regex": "a+"}}, 400, "structured_outputs"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_INPUTS, ids=[f"{b!r:.40}" for _, b, _, _ in BAD_INPUTS])
def test_bad_input_gets_openai_error(server: Server, path: str, body: Any, status: int, param: str | None) -> None:
    """Bad input is the client's error: the documented status with an OpenAI error body naming the
    field, never a 500, and the server keeps answering."""
    res = _post(server, path, body)
    assert res.status_code == status, res.text
    err = res.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    if param is not None:
        assert param in err["message"]
    assert server.http.get("/health").status_code == 200


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


def test_structured_outputs_over_http(server: Server, spec_server: Server) -> None:
    """response_format (json_schema, strict) on chat and completions, and structured_outputs
    (regex, choice) through the openai client: every answer follows its constraint, and the
    speculating server's greedy answers are the plain server's, streamed or not."""
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    answers = {}
    for name, srv in (("plain", server), ("spec", spec_server)):
        chat = srv.openai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Who?"}],
                                                  temperature=0, max_tokens=200, response_format=fmt)
        jsonschema.validate(json.loads(chat.choices[0].message.content), PERSON)
        assert chat.choices[0].finish_reason == "stop"
        done = srv.openai.completions.create(model=MODEL, prompt="A person:", temperature=0, max_tokens=200,
                                             extra_body={"response_format": {"type": "json_object"},
                                                         "structured_outputs": None})
        json.loads(done.choices[0].text)
        tagged = srv.openai.completions.create(model=MODEL, prompt="Say:", temperature=0, max_tokens=8, extra_body={
            "structured_outputs": {"structural_tag": {"structures": [{"begin": "<f>", "schema": PERSON, "end": "</f>"}],
                                                      "triggers": ["<f>"]}}})
        assert tagged.choices[0].finish_reason in ("stop", "length")
        regex = srv.openai.completions.create(model=MODEL, prompt="Code:", temperature=0, max_tokens=40,
                                              extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{3}"}})
        assert re.fullmatch("[A-Z]{3}-[0-9]{3}", regex.choices[0].text)
        stream = srv.openai.completions.create(model=MODEL, prompt="Pick:", temperature=0, max_tokens=20, stream=True,
                                               extra_body={"structured_outputs": {"choice": ["red", "green"]}})
        picked = "".join(c.choices[0].text for c in stream if c.choices)
        assert picked in ("red", "green")
        answers[name] = (chat.choices[0].message.content, done.choices[0].text, regex.choices[0].text, picked)
    assert answers["spec"] == answers["plain"]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                    "celsius": {"type": "boolean"}},
                   "required": ["city", "celsius"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}


def test_tool_calls_over_http(server: Server, spec_server: Server) -> None:
    """tool_choice required and named: the answer is calls whose arguments follow the function's
    schema, finish_reason "tool_calls"; a stream gives the same calls as delta.tool_calls; the
    speculating server's greedy answers are the plain server's; a conversation carrying the call
    and the tool's result goes on."""
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    answers: dict[str, list[Any]] = {}
    for name, srv in (("plain", server), ("spec", spec_server)):
        got = []
        for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
            res = srv.openai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, CLOCK],
                                                     tool_choice=choice, temperature=0, max_tokens=120,
                                                     parallel_tool_calls=False)
            c = res.choices[0]
            assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
            for call in c.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
                assert call.id and call.type == "function"
            if isinstance(choice, dict):
                assert [t.function.name for t in c.message.tool_calls] == ["get_time"]
            chunks = list(srv.openai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, CLOCK],
                                                             tool_choice=choice, temperature=0, max_tokens=120,
                                                             parallel_tool_calls=False, stream=True))
            streamed = [(d.function.name, d.function.arguments) for ch in chunks if ch.choices
                        for d in (ch.choices[0].delta.tool_calls or [])]
            assert streamed == [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
            got.append(streamed)
        auto = srv.openai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, CLOCK],
                                                  temperature=0, max_tokens=40)  # tool_choice auto: the lazy grammar
        got.append((auto.choices[0].message.content, auto.choices[0].finish_reason))
        call = res.choices[0].message.tool_calls[0]
        follow = srv.openai.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, tools=[CLOCK],
                                                    messages=[*messages, res.choices[0].message.model_dump(exclude_none=True),
                                                              {"role": "tool", "tool_call_id": call.id, "content": "12:00"}])
        assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
        answers[name] = got
    assert answers["spec"] == answers["plain"]


def test_bad_input_through_openai_client(server: Server) -> None:
    """The openai client sees those errors as its typed exceptions (400, 404)."""
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        server.openai.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert e.value.status_code == 400 and "temperature" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        server.openai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_oversized_body_is_413(server: Server) -> None:
    """A body over --max-body-bytes gets 413, whether Content-Length says so or a chunked body runs
    past the limit; a body just under it is served."""
    big = json.dumps({"model": MODEL, "prompt": "hi", "user": "u" * MAX_BODY}).encode()
    res = _post(server, "/v1/completions", big)
    assert res.status_code == 413 and res.json()["error"]["type"] == "invalid_request_error"

    def chunked() -> Iterator[bytes]:
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096]

    with httpx.Client(base_url=server.base, timeout=30) as fresh:
        res = fresh.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert res.status_code == 413
    ok = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, "user": "u" * (MAX_BODY - 200)}).encode()
    assert _post(server, "/v1/completions", ok).status_code == 200
    assert server.http.get("/health").status_code == 200


def test_queue_full_is_429(spec_server: Server) -> None:
    """With --max-num-seqs 1 --max-waiting 1, a burst of long requests overflows the waiting queue:
    some are refused with 429 (an OpenAI rate-limit error), the admitted ones complete normally, and
    the server serves again afterwards."""
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 1000, "ignore_eos": True}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=spec_server.base, timeout=60) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(8)))

    before = spec_server.metrics()['specserve_requests_total{status="error"}']
    responses = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    assert set(codes) == {200, 429}, codes
    assert all(r.json()["error"]["type"] == "rate_limit_error" for r in responses if r.status_code == 429)
    assert all(r.json()["usage"]["completion_tokens"] == 1000 for r in responses if r.status_code == 200)
    assert spec_server.metrics()['specserve_requests_total{status="error"}'] >= before + codes.count(429)
    assert spec_server.openai.completions.create(model=MODEL, prompt="abc", max_tokens=2).choices


# -- disconnects, metrics, concurrency ----------------------------------------------------------


def test_disconnect_mid_stream_frees_blocks(server: Server) -> None:
    """A client that goes away mid-stream aborts its request: once it is counted as aborted, /metrics
    shows the KV blocks back at the idle count and nothing running (the count waits for the engine)."""
    idle = server.metrics()
    assert idle["specserve_num_requests_running"] == 0
    body = {"model": MODEL, "prompt": "tell me everything", "max_tokens": 1000, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.base, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=body) as res:
            lines = res.iter_lines()
            for _ in range(3):
                next(lines)
            busy = server.metrics()
            assert busy["specserve_kv_blocks_used"] > idle["specserve_kv_blocks_used"]
            assert busy["specserve_num_requests_running"] == 1
    _wait_for_abort_count(server, idle['specserve_requests_total{status="abort"}'] + 1)
    now = server.metrics()
    assert now["specserve_kv_blocks_used"] == idle["specserve_kv_blocks_used"], server.log()
    assert now["specserve_num_requests_running"] == 0


def test_disconnect_while_waiting_for_a_json_answer(server: Server) -> None:
    """A non-streaming client that gives up (closed socket) aborts its request, all n choices of it:
    once the abort is counted, no KV block is in use and nothing runs."""
    aborted = server.metrics()['specserve_requests_total{status="abort"}']
    body = json.dumps({"model": MODEL, "prompt": "go on", "max_tokens": 1000, "n": 8, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer x\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as impatient:
        impatient.sendall(head + body)
        _wait_for(lambda: server.metrics()["specserve_num_requests_running"] == 8, server, "all 8 choices running")
    _wait_for_abort_count(server, aborted + 1)
    now = server.metrics()
    assert now["specserve_kv_blocks_used"] == 0 and now["specserve_num_requests_running"] == 0


def test_aclose_returns_once_the_engine_has_freed_the_blocks(tiny_llama: Path) -> None:
    """`aclose()` of a group's stream returns only after the engine thread has aborted every request
    of the group and published a snapshot that shows their blocks free: the server counts an abort
    after it, so its metrics never show an aborted request's blocks still in use. (Steps are slowed,
    so an abort that was only sent, not carried out, would be seen.)"""
    from specserve.server.engine_loop import AsyncEngine, EngineRequest

    inner = LLM(str(tiny_llama), max_model_len=1024).engine
    step = inner.step
    inner.step = lambda: (time.sleep(0.05), step())[1]  # type: ignore[method-assign]
    engine = AsyncEngine(inner, max_waiting=8)

    async def run() -> None:
        engine.start()
        params = SamplingParams(max_tokens=1000, ignore_eos=True)
        prompt = inner.tokenize("go on and on")
        stream = await engine.submit([EngineRequest(f"group-{i}", prompt, params) for i in range(8)])
        async for _ in stream:
            if engine.snapshot().stats.num_running == 8:
                break
        assert engine.snapshot().stats.kv_blocks_used > 0
        await stream.aclose()
        stats = engine.snapshot().stats
        assert stats.kv_blocks_used == 0 and stats.num_running == 0, stats

    try:
        asyncio.run(run())
    finally:
        engine.stop()


def test_stream_dropped_unread_aborts_its_requests(tiny_llama: Path) -> None:
    """A stream nobody reads or closes (its client left before the response began) aborts its
    requests when it is collected, instead of generating to max_tokens for nobody."""
    import gc

    from specserve.server.engine_loop import AsyncEngine, EngineRequest

    inner = LLM(str(tiny_llama), max_model_len=1024).engine
    aborted: list[str] = []
    abort = inner.abort_request
    inner.abort_request = lambda rid: (aborted.append(rid), abort(rid))[1]  # type: ignore[method-assign]
    engine = AsyncEngine(inner, max_waiting=8)
    ids = [f"dropped-{i}" for i in range(4)]

    async def run() -> None:
        engine.start()
        params = SamplingParams(max_tokens=1000, ignore_eos=True)
        stream = await engine.submit([EngineRequest(rid, inner.tokenize("go on and on"), params) for rid in ids])
        await asyncio.sleep(0.1)
        assert engine.snapshot().stats.num_running == 4
        del stream
        gc.collect()
        deadline = time.monotonic() + 5
        while engine.snapshot().stats.num_running or engine.snapshot().stats.kv_blocks_used:
            assert time.monotonic() < deadline, engine.snapshot()
            await asyncio.sleep(0.02)
        assert sorted(aborted) == ids  # aborted, not run to their length

    try:
        asyncio.run(run())
    finally:
        engine.stop()


def _wait_for(condition: Callable[[], bool], server: Server, what: str, timeout: float = 60.0) -> None:
    """Wait for a state of the server (polling it), failing with its log after `timeout` seconds:
    generous, since under load everything is slower and only the state matters."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not reached in {timeout} s\n{server.log()}"
        time.sleep(0.02)


def _wait_for_abort_count(server: Server, count: float) -> None:
    _wait_for(lambda: server.metrics()['specserve_requests_total{status="abort"}'] >= count, server,
              f"abort count {count}")


def test_metrics_exposition(server: Server) -> None:
    """/metrics is Prometheus text with the documented specserve_ series, moved by the traffic so far."""
    server.openai.completions.create(model=MODEL, prompt="one more", max_tokens=4, temperature=0)
    assert server.http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "top_p": 2}).status_code == 400
    text = server.http.get("/metrics")
    assert text.headers["content-type"].startswith("text/plain")
    m = server.metrics()
    assert m['specserve_requests_total{status="success"}'] > 0
    assert m['specserve_requests_total{status="error"}'] > 0
    assert m["specserve_prompt_tokens_total"] > 0 and m["specserve_generation_tokens_total"] > 0
    for hist in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert m[f"specserve_{hist}_count"] > 0
    assert m["specserve_kv_blocks_total"] > 0 and m["specserve_num_requests_waiting"] == 0
    assert 0 <= m["specserve_prefix_cache_hit_rate"] <= 1
    for name in ("spec_draft_tokens_total", "spec_accepted_tokens_total", "spec_verification_steps_total"):
        assert f"specserve_{name}" in m


def test_gateway_metrics(server: Server) -> None:
    """The gauges an inference gateway's endpoint picker reads (queue, running, KV usage as a 0-1
    fraction, block size) are served under the names its reference picker scrapes by default."""
    server.openai.completions.create(model=MODEL, prompt="warm", max_tokens=2, temperature=0)
    m = server.metrics()
    assert m["vllm:num_requests_waiting"] == m["specserve_num_requests_waiting"] == 0
    assert m["vllm:num_requests_running"] == m["specserve_num_requests_running"]
    used, total = m["specserve_kv_blocks_used"], m["specserve_kv_blocks_total"]
    assert m["vllm:kv_cache_usage_perc"] == m["specserve_kv_cache_usage_perc"] == pytest.approx(used / total)
    info = [k for k in m if k.startswith("vllm:cache_config_info")]
    assert info == [f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{int(total)}"}}']


def test_64_concurrent_streams(server: Server, llm: LLM) -> None:
    """64 clients streaming at once through the shared engine loop all complete without errors, and
    each greedy output is exactly the one a sequential (batch of one) run gives."""
    prompts = [f"Client {i}: say something" for i in range(8)]
    expected = [llm.generate(p, greedy(20, ignore_eos=True), use_tqdm=False)[0].text for p in prompts]

    async def one(client: AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await client.completions.create(model=MODEL, prompt=prompts[i % 8], max_tokens=20, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def main() -> list[tuple[str, str | None]]:
        async with AsyncOpenAI(base_url=f"{server.base}/v1", api_key="x", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    assert [r[1] for r in results] == ["length"] * 64
    assert [r[0] for r in results] == [expected[i % 8] for i in range(64)]
    assert server.metrics()["specserve_num_requests_running"] == 0


def test_sigterm_shuts_down_cleanly(spec_server: Server) -> None:
    """SIGTERM with a stream in flight: the stream gets --shutdown-timeout to finish, then ends with
    an error event (code server_shutting_down) and [DONE], never cut off mid-stream; /health says
    so meanwhile; the engine thread stops, no traceback is logged, and the process exits 0. (Runs
    last: it stops the spec server.)"""
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 1000, "stream": True, "ignore_eos": True}
    lines: list[str] = []
    with httpx.Client(base_url=spec_server.base, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=body) as res:
            it = res.iter_lines()
            lines.append(next(it))
            spec_server.proc.send_signal(signal.SIGTERM)
            with httpx.Client(base_url=spec_server.base, timeout=10) as fresh:  # a new connection, as a prober's
                _wait_for(lambda: fresh.get("/health").status_code == 503, spec_server, "/health 503 after SIGTERM")
                late = fresh.post("/v1/completions", json={"model": MODEL, "prompt": "late", "max_tokens": 2})
                assert late.status_code == 503 and late.json()["error"]["code"] == "server_shutting_down"
            lines.extend(it)
    events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last.get("error", {}).get("code") == "server_shutting_down" or last["choices"][0]["finish_reason"]
    assert spec_server.proc.wait(30) == 0, spec_server.log()
    log = spec_server.full_log()
    assert "engine stopped" in log and "Traceback" not in log, log


def test_building_on_a_passing_thread_leaves_no_openmp_pool(tmp_path: Path) -> None:
    """The server loads its model with build_on_passing_thread: the loader's OpenMP workers must be
    gone once it returns, or libgomp throttles the engine thread's pool (see its docstring). Run in a
    fresh process, so that pytest's own threads hold no pool; the last line checks the premise (a
    parallel op run on the calling thread does leave workers behind)."""
    import subprocess
    import sys

    import torch

    if torch.get_num_threads() < 2:
        pytest.skip("one thread: no OpenMP workers to leave behind")
    script = tmp_path / "pool.py"
    script.write_text(
        "import os, torch\n"
        "from specserve.server.engine_loop import build_on_passing_thread\n"
        "torch.set_num_threads(2)\n"
        "x = torch.randn(1 << 22)\n"
        "def threads(): return len(os.listdir('/proc/self/task'))\n"
        "before = threads()\n"
        "assert build_on_passing_thread(lambda: float(x.exp().sum())) > 0\n"
        "import time\n"
        "for _ in range(100):  # the pool's workers end just after the loader thread\n"
        "    if threads() == before: break\n"
        "    time.sleep(0.02)\n"
        "after_helper = threads()\n"
        "float(x.exp().sum())\n"
        "print(before, after_helper, threads())\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True)
    before, after_helper, after_direct = map(int, out.stdout.split())
    assert after_helper == before, "the loader thread's OpenMP pool outlived it"
    assert after_direct > before, "premise: a parallel op on this thread keeps worker threads"


def test_prompts_are_token_ids_before_they_reach_the_engine(tiny_llama: Path) -> None:
    """The input boundary: the HTTP layer tokenizes prompts and renders chat templates on its own
    tokenizer thread, and the engine is handed plain data (token ids and sampling parameters, which
    pickle as they are, the form they take to Ray replicas); the engine thread never calls the
    tokenizer to encode. The ids are the engine's own tokenization of the prompt."""
    import pickle
    import threading

    import httpx

    from specserve.server.app import ServerOptions, create_app
    from specserve.server.engine_loop import AsyncEngine

    llm = LLM(str(tiny_llama), max_model_len=1024)
    tok = llm.tokenizer
    encoded_on: list[str] = []
    real_call = type(tok).__call__

    class Recording(type(tok)):  # type: ignore[misc, valid-type]
        def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            encoded_on.append(threading.current_thread().name)
            return real_call(self, *args, **kwargs)

    tok.__class__ = Recording
    submitted: list[bytes] = []
    real_submit = AsyncEngine.submit

    async def submit(self, requests):  # type: ignore[no-untyped-def]
        submitted.extend(pickle.dumps(r) for r in requests)
        return await real_submit(self, requests)

    app = create_app(llm, ServerOptions(served_model_name=MODEL))
    greedy = {"model": MODEL, "max_tokens": 4, "temperature": 0}
    chat = [{"role": "user", "content": "hello there"}]

    async def run() -> None:
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                for body in ({**greedy, "prompt": "tell me"}, {**greedy, "messages": chat}):
                    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
                    res = await client.post(path, json=body)
                    assert res.status_code == 200, res.text

    AsyncEngine.submit = submit  # type: ignore[method-assign]
    try:
        asyncio.run(run())
    finally:
        AsyncEngine.submit = real_submit  # type: ignore[method-assign]
        tok.__class__ = Recording.__mro__[1]
    requests = [pickle.loads(b) for b in submitted]
    assert [r.prompt_token_ids for r in requests] == [
        llm.engine.tokenize("tell me"), apply_chat_template(tok, chat)]
    assert encoded_on and all(name.startswith("specserve-tokenizer") for name in encoded_on), encoded_on
