"""Clients someone else wrote, against a real `specserve serve`: the `openai` SDK's structured-output
parsing and a tool-calling round trip (streamed and not), `langchain-openai`'s structured output and
bound tools, and `lm-evaluation-harness`'s `local-completions` running a loglikelihood task and a
generation task to the end, its loglikelihoods equal to the engine's own scoring.

Nothing here reaches the network: the model is a tiny random one made by the test (its answers are
nonsense, but constrained answers are valid), the harness reads a local tokenizer and local data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator, Literal

import pytest
from pydantic import BaseModel

from specserve import LLM, SamplingParams

from serverproc import MODEL, Server


class Weather(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    celsius: bool


class Clock(BaseModel):
    zone: Literal["UTC", "CET"]


@pytest.fixture(scope="module")
def tiny_long(tiny_model_factory: Callable[..., Path]) -> Path:
    """The tiny model with room for tools described in a system message (byte tokens: ~1 per character)."""
    return tiny_model_factory("llama-4k", max_position_embeddings=4096)


@pytest.fixture(scope="module")
def server(tiny_long: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    logs = tmp_path_factory.mktemp("client-logs")
    srv = Server(tiny_long, logs / "server.log", "--spec", "auto")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def test_openai_parse_with_a_pydantic_model(server: Server) -> None:
    res = server.openai.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                               response_format=Weather, temperature=0, max_tokens=64)
    parsed = res.choices[0].message.parsed
    assert isinstance(parsed, Weather) and res.choices[0].finish_reason == "stop"


def test_openai_tool_round_trip(server: Server) -> None:
    """call -> tool result -> answer, with the SDK's strict function tools, not streamed and streamed
    (the SDK's stream helper assembles delta.tool_calls and parses the arguments)."""
    import openai

    tools = [openai.pydantic_function_tool(Weather, name="get_weather"), openai.pydantic_function_tool(Clock)]
    messages: list[dict] = [{"role": "user", "content": "Weather in Oslo?"}]
    first = server.openai.chat.completions.parse(model=MODEL, messages=messages, tools=tools, tool_choice="required",
                                                 temperature=0, max_tokens=200, parallel_tool_calls=False)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, (Weather, Clock))
    with server.openai.chat.completions.stream(model=MODEL, messages=messages, tools=tools, tool_choice="required",
                                               temperature=0, max_tokens=200, parallel_tool_calls=False) as stream:
        final = stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls[0]
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
    assert streamed.function.parsed_arguments == call.function.parsed_arguments
    messages += [choice.message.model_dump(exclude_none=True, exclude={"parsed"}),
                 {"role": "tool", "tool_call_id": call.id, "content": "-3 C, snow"}]
    answer = server.openai.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="none",
                                                   temperature=0, max_tokens=12)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    chunks = list(server.openai.chat.completions.create(model=MODEL, messages=messages, tools=tools,
                                                        tool_choice="none", temperature=0, max_tokens=12, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer.choices[0].message.content


def _langchain(server: Server):  # noqa: ANN202 - the client's own type
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=f"{server.base}/v1", api_key="x", model=MODEL, temperature=0, max_tokens=200,
                      max_retries=0, timeout=60)


def test_langchain_structured_output_and_tools(server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # any tiktoken download would fail here, offline
    chat = _langchain(server)
    for method in ("json_schema", "function_calling"):
        got = chat.with_structured_output(Weather, method=method).invoke("Weather in Rome?")
        assert isinstance(got, Weather), method
    # strict: the schemas forbid other keys (a random model fills whatever a schema allows)
    bound = chat.bind_tools([Weather, Clock], tool_choice="Clock", strict=True)
    msg = bound.invoke("What time is it?")
    assert [c["name"] for c in msg.tool_calls] == ["Clock"] and Clock(**msg.tool_calls[0]["args"])
    streamed = None
    for piece in bound.stream("What time is it?"):
        streamed = piece if streamed is None else streamed + piece
    assert streamed is not None and [c["name"] for c in streamed.tool_calls] == ["Clock"]
    assert streamed.tool_calls[0]["args"] == msg.tool_calls[0]["args"]


MC_DOCS = [
    {"question": "2 + 2 =", "choices": ["4", "5", "22"], "answer": 0},
    {"question": "The sky is", "choices": ["green", "blue"], "answer": 1},
    {"question": "Paris is in", "choices": ["France", "Peru", "Japan", "Chad"], "answer": 0},
    {"question": "Ice is", "choices": ["cold", "hot"], "answer": 0},
]
GEN_DOCS = [{"prompt": "Say hi:", "target": "hi"}, {"prompt": "Count: 1 2", "target": " 3"}]


def _write_tasks(root: Path) -> None:
    (root / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (root / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN_DOCS))
    (root / "specserve_mc.yaml").write_text(f"""task: specserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
""")
    (root / "specserve_gen.yaml").write_text(f"""task: specserve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""")


def test_lm_eval_local_completions(server: Server, tiny_long: Path, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness runs both tasks to the end and reports their metrics; every loglikelihood it got
    over HTTP (echo + logprobs, max_tokens 1, batched prompts) equals the engine's own scoring of
    the same tokens to 1e-4."""
    pytest.importorskip("lm_eval")
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    _write_tasks(tmp_path)
    results = simple_evaluate(
        model="local-completions",
        model_args={"base_url": f"{server.base}/v1/completions", "model": MODEL, "tokenizer_backend": "huggingface",
                    "tokenizer": str(tiny_long), "num_concurrent": 1, "max_retries": 1, "batch_size": 4},
        tasks=["specserve_mc", "specserve_gen"], task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True, bootstrap_iters=0,
    )
    assert results is not None
    assert 0.0 <= results["results"]["specserve_mc"]["acc,none"] <= 1.0
    assert 0.0 <= results["results"]["specserve_gen"]["exact_match,none"] <= 1.0
    samples = results["samples"]["specserve_mc"]
    assert len(samples) == len(MC_DOCS)

    llm = LLM(str(tiny_long))
    tok = llm.tokenizer
    checked = 0
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            harness_ll = resp[0][0]
            whole = tok.encode(context + continuation, add_special_tokens=False)
            ctxlen = len(tok.encode(context, add_special_tokens=False))
            scored = llm.generate(whole, SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)[0]
            own = sum(e.logprob for e in scored.prompt_logprobs[ctxlen:])  # type: ignore[index,union-attr]
            assert harness_ll == pytest.approx(own, abs=1e-4)
            checked += 1
    assert checked == sum(len(d["choices"]) for d in MC_DOCS)
