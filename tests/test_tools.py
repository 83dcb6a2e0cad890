"""Tool calling's chat side: calls parsed out of text the same whether it comes whole or piece by
piece; the `auto` grammar leaves text free until a call opens and then admits only the given
functions with schema-valid arguments; templates that render tools get them, others the fallback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from specserve.server.tools import (
    HERMES, LLAMA3_JSON, Function, ToolCallParser, ToolPlan, fallback_messages, parse_tool_calls, syntax_for,
)
from specserve.structured import GrammarCompiler, allow_all
from specserve.tokenizer import PromptEncoder, load_tokenizer

NAMES = frozenset({"get_weather", "get_time"})
WEATHER = Function("get_weather", {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                                   "required": ["city"], "additionalProperties": False})
CLOCK = Function("get_time", {"type": "object", "properties": {}, "additionalProperties": False})
TWO_CALLS = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_parser_finds_calls_whole_and_streamed_alike() -> None:
    content, calls = parse_tool_calls(TWO_CALLS, ToolCallParser(HERMES, NAMES))
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    parser = ToolCallParser(HERMES, NAMES)
    pieces = [parser.feed(ch) for ch in TWO_CALLS] + [parser.finish()]
    streamed = [c for _, cs in pieces for c in cs]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    text = "".join(t for t, _ in pieces)
    assert text.strip() == "Let me look." and "<tool" not in text  # a forming trigger is held back, then dropped
    # the first call is given out as soon as it is complete, before the second one arrives
    first_done = next(i for i, (_, cs) in enumerate(pieces) if cs)
    assert first_done < TWO_CALLS.index("get_time")


@pytest.mark.parametrize("text", ["a <tool_call> that is not JSON", '<tool_call>\n{"name": "rm_rf", "arguments": {}}',
                                  "x < y and <tool", '<tool_call>\n{"name": "get_time", "arguments": [1]}'])
def test_text_that_is_no_call_stays_content(text: str) -> None:
    assert parse_tool_calls(text, ToolCallParser(HERMES, NAMES)) == (text, [])


@pytest.mark.parametrize("text", ['```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Rome"}\n}\n```',
                                  'Calling: {"name": "get_weather", "arguments": {"city": "Rome"}}'])
def test_calls_written_in_a_fence_or_bare_are_calls(text: str) -> None:
    """As llama.cpp's Hermes parser reads them (models choose these forms under tool_choice auto)."""
    whole = parse_tool_calls(text, ToolCallParser(HERMES, NAMES))
    assert [(c.name, json.loads(c.arguments)) for c in whole[1]] == [("get_weather", {"city": "Rome"})]
    assert whole[0] in (None, "Calling:")
    parser = ToolCallParser(HERMES, NAMES)
    pieces = [parser.feed(ch) for ch in text] + [parser.finish()]
    assert [c.arguments for _, cs in pieces for c in cs] == [whole[1][0].arguments]


def test_llama3_json_calls() -> None:
    text = '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Rome"}}'
    content, calls = parse_tool_calls(text, ToolCallParser(LLAMA3_JSON, NAMES))
    assert content is None and [c.name for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1].arguments) == {"city": "Rome"}


def _walk(compiler: GrammarCompiler, grammar: str, tok: Any, text: str) -> tuple[Any, list[int]]:
    from specserve.sampling_params import StructuredOutputsParams

    g = compiler.compile(StructuredOutputsParams(grammar=grammar))
    ids = tok(text, add_special_tokens=False).input_ids
    for t in ids:
        assert g.accept(t), f"{tok.decode([t])!r} refused after {text!r}"
    return g, ids


def _allowed(g: Any, tok: Any, char: str) -> bool:
    mask = allow_all(1, g.mask_size)
    g.fill(mask, 0)
    t = tok(char, add_special_tokens=False).input_ids[0]
    return bool((int(mask[0, t // 32]) >> (t % 32)) & 1)


def test_auto_grammar_is_free_text_until_a_call_opens(tiny_llama: Path) -> None:
    tok = load_tokenizer(tiny_llama)
    compiler = GrammarCompiler.from_tokenizer(tok, len(tok), {tok.eos_token_id})
    grammar = ToolPlan((WEATHER, CLOCK), "auto", True, HERMES).constraint().grammar
    g, _ = _walk(compiler, grammar, tok, "Sure, ")
    assert all(_allowed(g, tok, c) for c in "X{<\n")  # free text
    g, _ = _walk(compiler, grammar, tok, TWO_CALLS + "\nDone.")  # calls inside text, text after them
    g, _ = _walk(compiler, grammar, tok, 'Ok <tool_call>\n{"name": "get_')
    assert _allowed(g, tok, "w") and _allowed(g, tok, "t") and not _allowed(g, tok, "x")  # only given functions
    g, _ = _walk(compiler, grammar, tok, 'Ok <tool_call>\n{"name": "get_weather", "arguments": {"city": "')
    assert _allowed(g, tok, "P") and _allowed(g, tok, "R") and not _allowed(g, tok, "B")  # the schema's values


def test_required_grammar_admits_calls_only(tiny_llama: Path) -> None:
    tok = load_tokenizer(tiny_llama)
    compiler = GrammarCompiler.from_tokenizer(tok, len(tok), {tok.eos_token_id})
    one = ToolPlan((WEATHER, CLOCK), "required", False, HERMES).constraint().grammar
    g, _ = _walk(compiler, one, tok, "")
    assert _allowed(g, tok, "<") and not _allowed(g, tok, "S")  # no text before the call
    g, _ = _walk(compiler, one, tok, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert _allowed(g, tok, "\n") and not _allowed(g, tok, "<") and not _allowed(g, tok, "S")  # no second call
    g, _ = _walk(compiler, one, tok, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n')
    assert g.done  # one call (and a line break), then only the end of sequence
    many = ToolPlan((WEATHER, CLOCK), "required", True, HERMES).constraint().grammar
    g, _ = _walk(compiler, many, tok, TWO_CALLS[TWO_CALLS.index("<"):])
    assert not g.done  # parallel: another call may follow


HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "Call as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_a_template_with_tools_renders_them_and_others_get_the_fallback(tiny_llama: Path) -> None:
    tok = load_tokenizer(tiny_llama)
    assert syntax_for(tok.chat_template) == (HERMES, False)
    assert syntax_for(HERMES_TEMPLATE) == (HERMES, True)
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": CLOCK.parameters}}]
    history = [{"role": "user", "content": "Time?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    enc = PromptEncoder(tok, len(tok))
    fallback = tok.decode(enc.chat(fallback_messages(history, tools)))
    assert '"name": "get_time"' in fallback and "<tool_response>\n12:00\n</tool_response>" in fallback
    assert fallback.index("<tools>") < fallback.index("Time?")  # the tools come first, in the system turn
    tok.chat_template = HERMES_TEMPLATE
    native = tok.decode(enc.chat(history, tools))
    assert native.startswith("<tools>") and '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>' in native
    assert "<tool>12:00" in native  # the template's own rendering of the result


def test_structural_tag_constrains_what_follows_its_trigger(tiny_llama: Path) -> None:
    from specserve.server.tools import structural_tag_grammar

    tok = load_tokenizer(tiny_llama)
    compiler = GrammarCompiler.from_tokenizer(tok, len(tok), {tok.eos_token_id})
    spec = {"structures": [{"begin": "<function=get_weather>", "schema": WEATHER.parameters, "end": "</function>"}],
            "triggers": ["<function="]}
    grammar = structural_tag_grammar(json.dumps(spec), "structured_outputs.structural_tag").grammar
    g, _ = _walk(compiler, grammar, tok, 'Checking. <function=get_weather>{"city": "Rome"}</function> Done.')
    g, _ = _walk(compiler, grammar, tok, 'x <function=get_weather>{"city": "')
    assert _allowed(g, tok, "R") and not _allowed(g, tok, "B")
