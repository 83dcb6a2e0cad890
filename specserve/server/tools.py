"""Tool calling on the chat side: how the model's chat template writes a call, the grammar that
constrains calls, and the parser that turns the model's text back into OpenAI `tool_calls`.

A template that renders tools itself carries its call syntax: Qwen2.5 / Hermes templates write
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, Llama 3.x templates a bare
`{"name": ..., "parameters": {...}}`. A template without tools gets the Hermes syntax and the
tools described in a system message (`fallback_messages`), tool results as user turns.

Constraints go through the grammar engine as a Lark grammar (one `%json` schema per function):
`required` and a named function force one call (or several, with parallel_tool_calls) and nothing
else; `auto` leaves text free until the model writes the call's trigger, then forces the rest of
the call's opening and constrains the arguments by the function's schema (llguidance's lazy
structural tags). The engine sees only a grammar: speculation stays lossless as with any
structured output.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import llguidance

from specserve.errors import InvalidRequestError
from specserve.sampling_params import StructuredOutputsParams


@dataclass(frozen=True)
class Function:
    name: str
    parameters: dict[str, Any]
    description: str | None = None


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the OpenAI API sends it

    def openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class CallSyntax:
    """How a model writes one call: `trigger` opens it; the JSON object with "name" and the
    arguments under `args_key` starts at the trigger (`json_at_trigger`) or after it; `close`
    follows the object; calls are separated by `separator`."""

    name: str
    trigger: str
    args_key: str
    json_at_trigger: bool
    close: str
    separator: str
    # other ways models write the same call, parsed (never forced): (opening, JSON at it, closing)
    lenient: tuple[tuple[str, bool, str], ...] = ()

    def openers(self) -> tuple[tuple[str, bool, str], ...]:
        return ((self.trigger, self.json_at_trigger, self.close), *self.lenient)

    def begin(self, function: str) -> str:
        """The call's text up to its arguments."""
        head = f'{{"name": {json.dumps(function)}, "{self.args_key}": '
        return head if self.json_at_trigger else f"{self.trigger}\n{head}"

    @property
    def end(self) -> str:
        """The call's text after its arguments."""
        return "}" + (f"\n{self.close}" if self.close else "")

    def text(self, function: str, arguments: str) -> str:
        return self.begin(function) + arguments + self.end


# As llama.cpp's Hermes parser does, a call object in a ```json fence or bare is a call too (small
# Qwen2.5-Coder models often write it so when the choice is theirs).
HERMES = CallSyntax("hermes", "<tool_call>", "arguments", False, "</tool_call>", "\n",
                    lenient=(("```json", False, "```"), ('{"name"', True, "")))
LLAMA3_JSON = CallSyntax("llama3_json", '{"name"', "parameters", True, "", "; ")


def special_markers(syntax: CallSyntax, tokenizer: Any) -> frozenset[str]:
    """The syntax's markers that are one added token of `tokenizer` (Qwen2.5's <tool_call>)."""
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    return frozenset(m for m in (syntax.trigger, syntax.close) if m and m in added)


def syntax_for(template: str | None) -> tuple[CallSyntax, bool]:
    """The call syntax for a chat template, and whether the template renders tools itself."""
    t = template or ""
    if "tools" in t and "<tool_call>" in t:
        return HERMES, True
    if "tools" in t and ("<|python_tag|>" in t or '"parameters": dictionary' in t):
        return LLAMA3_JSON, True
    return HERMES, False


FALLBACK_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)


def fallback_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation with tools for a template that knows none: the tools described in the system
    message (Hermes style), earlier calls written into the assistant's text, tool results as user
    turns."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [HERMES.text(c["function"]["name"], json.dumps(c["function"]["arguments"], ensure_ascii=False))
                     for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(filter(None, [m.get("content") or "", *calls]))})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content", "name")})
    if not tools:
        return out
    described = FALLBACK_INSTRUCTIONS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{described}"}
    else:
        out.insert(0, {"role": "system", "content": described})
    return out


def check_schema(schema: dict[str, Any], field_name: str) -> None:
    """InvalidRequestError naming `field_name` when the grammar engine cannot compile `schema`."""
    try:
        llguidance.JsonCompiler().compile(json.dumps(schema))
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(field_name, f"cannot be compiled as a JSON schema: {e}") from None


# Arguments as templates render them (tojson: ", " and ": ", no other whitespace), so that a model
# that has started a call cannot wander off into whitespace.
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _compact(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": {**COMPACT, **schema.get("x-guidance", {})}}


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools: the syntax calls are written in and how they are constrained.
    `special`: the syntax's markers (trigger, close) that are one added token of the tokenizer; the
    grammar names those tokens (the model writes them as one token; as text they would be refused)."""

    functions: tuple[Function, ...]
    choice: str  # "auto", "required" or "function" (named: functions holds it alone)
    parallel: bool
    syntax: CallSyntax
    special: frozenset[str] = frozenset()

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f.name for f in self.functions)

    def parser(self) -> "ToolCallParser":
        """A parser for one choice's text under this plan."""
        return ToolCallParser(self.syntax, self.names)

    def _lit(self, text: str) -> str:
        """A Lark literal: `text` quoted, with the special markers in it as token references."""
        for marker in sorted(self.special, key=len, reverse=True):
            if marker in text:
                head, _, tail = text.partition(marker)
                return " ".join(p for p in (self._lit(head) if head else "", marker, self._lit(tail) if tail else "") if p)
        return json.dumps(text)

    def _body(self, f: Function) -> str:
        """A call to `f` after its trigger: the rest of its opening, the arguments, its end."""
        s = self.syntax
        rest = s.begin(f.name)[len(s.trigger) :]  # the opening starts with the trigger
        parts = [self._lit(rest) if rest else "", f"%json {json.dumps(_compact(f.parameters))}", self._lit(s.end)]
        return " ".join(p for p in parts if p)

    def constraint(self) -> StructuredOutputsParams:
        """The grammar the output must follow (Lark, for llguidance)."""
        s, n = self.syntax, len(self.functions)
        trigger = self._lit(s.trigger)
        if self.choice == "auto":  # free text; once the trigger is written, a call (llguidance's structural tags)
            lines = ["%llguidance {}", f"start: ({' | '.join(f'tag_{i}' for i in range(n))})* tag_end",
                     "tag_end: TAG_TEXT", "TAG_TEXT: /(.|\\n)*/"]
            for i, f in enumerate(self.functions):
                if s.trigger in self.special:
                    lines.append(f"tag_{i}: TAG_TEXT {trigger} {self._body(f)}")
                else:  # a lazy lexeme: the text up to the first occurrence of the trigger
                    lines.append(f"tag_{i}_trig[lazy]: TAG_TEXT {trigger}")
                    lines.append(f"tag_{i}: tag_{i}_trig {self._body(f)}")
        else:
            # a line break may follow the last call before the end (models end "</tool_call>\n<eos>" too)
            sep = json.dumps(s.separator)
            lines = [f"start: call ({sep} call)* \"\\n\"?" if self.parallel else "start: call \"\\n\"?",
                     f"call: {' | '.join(f'f{i}' for i in range(n))}"]
            lines += [f"f{i}: {trigger} {self._body(f)}" for i, f in enumerate(self.functions)]
        return StructuredOutputsParams(grammar="\n".join(lines) + "\n", field="tools")


def structural_tag_grammar(spec: Any, field_name: str) -> StructuredOutputsParams:
    """vLLM's structural tag (`{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`, as
    an object or its JSON text): free text, where each structure opens at its trigger and its
    content follows its JSON schema."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError as e:
            raise InvalidRequestError(field_name, f"is not valid JSON: {e}") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("structures"), list) or not spec["structures"]:
        raise InvalidRequestError(field_name, "must be an object with a non-empty 'structures' list")
    triggers = spec.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise InvalidRequestError(field_name, "must have a non-empty 'triggers' list of non-empty strings")
    tags = []
    for i, st in enumerate(spec["structures"]):
        where = f"{field_name}.structures[{i}]"
        if not isinstance(st, dict) or not isinstance(st.get("begin"), str) or not isinstance(st.get("end", ""), str):
            raise InvalidRequestError(where, "needs 'begin' and 'end' strings")
        schema = st.get("schema", st.get("parameters", {}))
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"{where}.schema", "must be a JSON schema (an object)")
        check_schema(schema, f"{where}.schema")
        trigger = next((t for t in triggers if st["begin"].startswith(t)), None)
        if trigger is None:
            raise InvalidRequestError(f"{where}.begin", "must start with one of the triggers")
        tags.append(llguidance.StructTag(trigger=trigger, begin=st["begin"], grammar=schema, end=st.get("end", "")))
    return StructuredOutputsParams(grammar=llguidance.StructTag.to_grammar(tags, assume_special=False), field=field_name)


class ToolCallParser:
    """Turns a choice's text into content and tool calls, fed piece by piece (a stream) or at once.
    Text that may still become a call's trigger is held back; a call is given out once its JSON
    object is complete; a trigger not followed by a call object is content."""

    def __init__(self, syntax: CallSyntax, names: frozenset[str]) -> None:
        self._syntax = syntax
        self._names = names
        self._buf = ""
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, list[ToolCall]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        openers = self._syntax.openers()
        while self._buf:
            found = [(at, i) for i, (opening, _, _) in enumerate(openers) if (at := self._buf.find(opening)) >= 0]
            if not found:
                keep = 0 if final else max(_partial_suffix(self._buf, o) for o, _, _ in openers)
                content.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                break
            at, which = min(found)
            content.append(self._buf[:at])
            self._buf = self._buf[at:]
            parsed = self._call(openers[which], final)
            if parsed is None:  # not complete yet
                break
            call, used = parsed
            if call is None:  # the opening began no call: it is text
                opening = openers[which][0]
                content.append(opening)
                self._buf = self._buf[len(opening) :]
                continue
            calls.append(call)
            rest = self._buf[used:].lstrip()  # the separator before another call is not content
            sep = self._syntax.separator.strip()
            self._buf = rest[len(sep) :].lstrip() if sep and rest.startswith(sep) else rest
        self.calls += len(calls)
        return "".join(content), calls

    def _call(self, opener: tuple[str, bool, str], final: bool) -> tuple[ToolCall | None, int] | None:
        """The call at the start of the buffer: (call, characters used); (None, 0) when the opening
        begins none; None when more text may still complete it."""
        opening, json_at_opening, close = opener
        buf = self._buf
        start = 0 if json_at_opening else len(opening)
        while start < len(buf) and buf[start].isspace():
            start += 1
        if start >= len(buf):
            return (None, 0) if final else None
        if buf[start] != "{":
            return None, 0
        try:
            obj, end = json.JSONDecoder().raw_decode(buf, start)
        except ValueError:
            return (None, 0) if final else None
        if not isinstance(obj, dict) or obj.get("name") not in self._names:
            return None, 0
        args = obj.get(self._syntax.args_key, obj.get("arguments", obj.get("parameters", {})))
        if not isinstance(args, dict):
            return None, 0
        if close:
            rest = buf[end:].lstrip()
            if rest.startswith(close):
                end = len(buf) - len(rest) + len(close)
            elif not final and len(rest) < len(close) and close.startswith(rest):
                return None  # the closing may still come
        return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False)), end


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (text to hold back)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parse_tool_calls(text: str, parser: ToolCallParser) -> tuple[str | None, list[ToolCall]]:
    """A whole output's content (None when only calls) and its calls, with a fresh `parser`."""
    head, calls = parser.feed(text)
    tail, more = parser.finish()
    content = (head + tail).strip()
    return (content or None) if calls or more else (head + tail), calls + more
