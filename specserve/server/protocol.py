"""Request bodies of the OpenAI-compatible API (pydantic), and how a body becomes sampling params.

Types are checked here (a wrong type is a 400 naming the field); ranges are checked by
`SamplingParams`, whose InvalidRequestError names the field too. Unknown fields are ignored, as
the OpenAI API and vLLM do; fields we cannot honour (suffix, ...) are rejected.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from specserve.errors import InvalidRequestError
from specserve.sampling_params import SamplingParams, StructuredOutputsParams
from specserve.server.tools import CallSyntax, Function, ToolPlan, check_schema, structural_tag_grammar

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_N = 128


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)

    name: StrictStr = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's response_format: text, json_object (any JSON object) or json_schema."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    type: StrictStr = "text"
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "structural_tag":  # vLLM's: the structures and triggers sit beside the type
            return structural_tag_grammar(self.model_extra or {}, "response_format")
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True, field="response_format")
        if self.type != "json_schema":
            raise InvalidRequestError(
                "response_format.type",
                f"must be 'text', 'json_object', 'json_schema' or 'structural_tag', got {self.type!r}"
            )
        if self.json_schema is None:
            raise InvalidRequestError("response_format.json_schema", "is required when type is 'json_schema'")
        schema = self.json_schema.schema_ if self.json_schema.schema_ is not None else {}
        if self.json_schema.strict:
            problem = strict_schema_problem(schema)
            if problem is not None:
                raise InvalidRequestError("response_format.json_schema.schema", f"with strict: true, {problem}")
        return StructuredOutputsParams(json=schema, field="response_format.json_schema.schema")  # type: ignore[arg-type]


def strict_schema_problem(schema: Any, where: str = "the schema") -> str | None:
    """What OpenAI's strict mode refuses in a schema, or None: every object must list all its
    properties as required and set additionalProperties to false."""
    if isinstance(schema, list):
        return next((p for i, s in enumerate(schema) if (p := strict_schema_problem(s, f"{where}[{i}]"))), None)
    if not isinstance(schema, dict):
        return None
    if schema.get("type") == "object" or "properties" in schema:
        if schema.get("additionalProperties") is not False:
            return f"{where} must set additionalProperties to false"
        missing = [k for k in schema.get("properties", {}) if k not in schema.get("required", [])]
        if missing:
            return f"{where} must list every property as required (missing {', '.join(missing)})"
    for key, sub in schema.items():
        if key in ("properties", "$defs", "definitions") and isinstance(sub, dict):
            for name, s in sub.items():
                if (p := strict_schema_problem(s, f"{where}.{key}.{name}")) is not None:
                    return p
        elif key in ("items", "anyOf", "allOf", "oneOf", "prefixItems"):
            if (p := strict_schema_problem(sub, f"{where}.{key}")) is not None:
                return p
    return None


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` request field (one of json, regex, choice, grammar, json_object)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)

    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    structural_tag: Any = None

    def constraint(self) -> StructuredOutputsParams:
        if self.structural_tag is not None:
            return structural_tag_grammar(self.structural_tag, "structured_outputs.structural_tag")
        return StructuredOutputsParams(
            json=self.json_, regex=self.regex, choice=None if self.choice is None else tuple(self.choice),  # type: ignore[arg-type]
            grammar=self.grammar, json_object=bool(self.json_object),
            disable_any_whitespace=self.disable_any_whitespace, whitespace_pattern=self.whitespace_pattern,
        )


# vLLM's fields before v0.12, now `structured_outputs`: refused by name rather than ignored, since
# ignoring one would return unconstrained text.
_REMOVED_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                   "guided_grammar": "grammar", "guided_whitespace_pattern": "whitespace_pattern"}


class _SamplingFields(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI, then extensions)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX - MAX_N)
    stop: StrictStr | list[StrictStr] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and this many alternatives
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extensions (vLLM / llama.cpp)
    top_k: int | None = Field(None, le=INT32_MAX)  # larger means "no limit" anyway; keeps tensors in range
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: Any = None

    def check_supported(self) -> None:
        self._logit_bias()
        for old, new in _REMOVED_GUIDED.items():
            if getattr(self, old) is not None:
                raise InvalidRequestError(old, f"was removed (as in vLLM 0.12); use structured_outputs.{new}")
        if self.structured_outputs is not None and self.response_format is not None and (
            self.response_format.type != "text"
        ):
            raise InvalidRequestError("structured_outputs",
                                      "give either response_format or structured_outputs, not both")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options", "may only be set when stream is true")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def constraint(self) -> StructuredOutputsParams | None:
        """The structured-output constraint the request asks for, if any (checked, not compiled)."""
        if self.structured_outputs is not None:
            return self.structured_outputs.constraint()
        return None if self.response_format is None else self.response_format.constraint()

    def _logit_bias(self) -> dict[int, float]:
        """logit_bias with its keys as token ids (the OpenAI API sends them as strings)."""
        out: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise InvalidRequestError("logit_bias", f"key {key!r} is not a token id") from None
            if token < 0:
                raise InvalidRequestError("logit_bias", f"key {key!r} is not a token id")
            if not -100 <= value <= 100:
                raise InvalidRequestError("logit_bias", f"the bias of token {token} must be in [-100, 100], got {value}")
            out[token] = value
        return out

    def _prompt_logprobs(self) -> int | None:
        """How many alternatives the engine computes for each prompt token (None: no prompt logprobs)."""
        return self.prompt_logprobs

    def _sampling_params(self, choice: int, max_tokens: int, logprobs: int | None,
                         constraint: StructuredOutputsParams | None = None) -> SamplingParams:
        """Params for choice `choice` (0..n-1): with a seed, choice i draws with seed + i, so the
        choices differ and each reproduces."""
        set_fields: dict[str, Any] = {
            name: value
            for name, value in (
                ("temperature", self.temperature),
                ("top_p", self.top_p),
                ("top_k", self.top_k),
                ("min_p", self.min_p),
                ("presence_penalty", self.presence_penalty),
                ("frequency_penalty", self.frequency_penalty),
                ("repetition_penalty", self.repetition_penalty),
            )
            if value is not None
        }
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens,
            seed=None if self.seed is None else self.seed + choice,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            structured_outputs=constraint or self.constraint(),
            logit_bias=self._logit_bias(),
            prompt_logprobs=self._prompt_logprobs(),
            **set_fields,
        )


TokenPrompt = list[StrictInt]


class CompletionRequest(_SamplingFields):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, json_schema_extra={
        "examples": [{"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}]})

    prompt: StrictStr | list[StrictStr] | TokenPrompt | list[TokenPrompt]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise InvalidRequestError("suffix", "is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of", "is not supported (only best_of == n)")

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (a string, a list of strings, token ids, or lists of them)."""
        p = self.prompt
        if isinstance(p, str):
            out: list[str | list[int]] = [p]
        elif p and isinstance(p[0], int):
            out = [p]  # type: ignore[list-item]
        else:
            out = list(p)  # type: ignore[arg-type]
        if not out:
            raise InvalidRequestError("prompt", "must not be empty")
        return out

    def _prompt_logprobs(self) -> int | None:
        """echo with logprobs: the prompt's tokens come back with their logprobs, as OpenAI's legacy
        completions and vLLM return them (with vLLM's prompt_logprobs too, the larger k)."""
        echoed = self.logprobs if self.echo else None
        asked = [k for k in (self.prompt_logprobs, echoed) if k is not None]
        return max(asked) if asked else None

    def sampling_params(self, choice: int) -> SamplingParams:
        # OpenAI's default for completions is 16 tokens.
        return self._sampling_params(choice, 16 if self.max_tokens is None else self.max_tokens, self.logprobs)


class TextPart(_Body):
    type: str
    text: str | None = None


class CalledFunction(_Body):
    name: StrictStr
    arguments: StrictStr | dict[str, Any] = "{}"


class MessageToolCall(_Body):
    id: str | None = None
    type: StrictStr = "function"
    function: CalledFunction


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    role: StrictStr
    content: StrictStr | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers

    def to_template(self, index: int) -> dict[str, Any]:
        """The message as the chat template sees it: role and text content, an assistant's tool
        calls (arguments as objects, as templates render them), a tool result's call id."""
        if isinstance(self.content, list):
            for part in self.content:
                if part.type != "text" or part.text is None:
                    raise InvalidRequestError(f"messages[{index}].content", f"unsupported content part type {part.type!r}")
            text = "\n".join(part.text for part in self.content)  # type: ignore[misc]
        else:
            text = self.content or ""
        message: dict[str, Any] = {"role": self.role, "content": text}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [self._call(index, j, c) for j, c in enumerate(self.tool_calls)]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    @staticmethod
    def _call(index: int, j: int, call: MessageToolCall) -> dict[str, Any]:
        args: Any = call.function.arguments
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise InvalidRequestError(f"messages[{index}].tool_calls[{j}].function.arguments",
                                          "is not valid JSON") from None
        return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": args}}


class FunctionDef(_Body):
    name: StrictStr
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Body):
    type: StrictStr = "function"
    function: FunctionDef


class NamedFunction(_Body):
    name: StrictStr


class NamedToolChoice(_Body):
    type: StrictStr = "function"
    function: NamedFunction


TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class ChatCompletionRequest(_SamplingFields):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, json_schema_extra={
        "examples": [{"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 16}]})

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: StrictStr | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "needs logprobs: true")
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if limit is not None and limit < 1:  # 0 scores a prompt: a completions feature (echo, prompt_logprobs)
            raise InvalidRequestError(self.max_tokens_field, f"must be an integer >= 1, got {limit}")
        self._check_tools()

    def _check_tools(self) -> None:
        choice = self.tool_choice
        if isinstance(choice, str) and choice not in ("none", "auto", "required"):
            raise InvalidRequestError("tool_choice", f"must be 'none', 'auto', 'required' or a named function, got {choice!r}")
        if not self.tools:
            if choice not in (None, "none"):
                raise InvalidRequestError("tool_choice", "needs tools")
            return
        names: set[str] = set()
        for i, tool in enumerate(self.tools):
            if tool.type != "function":
                raise InvalidRequestError(f"tools[{i}].type", f"must be 'function', got {tool.type!r}")
            name = tool.function.name
            if not TOOL_NAME.match(name):
                raise InvalidRequestError(f"tools[{i}].function.name",
                                          "must be 1-64 letters, digits, underscores, dots or dashes")
            if name in names:
                raise InvalidRequestError(f"tools[{i}].function.name", f"{name!r} is given twice")
            names.add(name)
            schema = self._parameters(tool)
            check_schema(schema, f"tools[{i}].function.parameters")
            if tool.function.strict and (problem := strict_schema_problem(schema)) is not None:
                raise InvalidRequestError(f"tools[{i}].function.parameters", f"with strict: true, {problem}")
        if isinstance(choice, NamedToolChoice):
            if choice.type != "function":
                raise InvalidRequestError("tool_choice.type", f"must be 'function', got {choice.type!r}")
            if choice.function.name not in names:
                raise InvalidRequestError("tool_choice", f"names function {choice.function.name!r}, which is not in tools")
        if self.tool_choice != "none" and (self.structured_outputs is not None or (
                self.response_format is not None and self.response_format.type != "text")):
            raise InvalidRequestError("tool_choice", "cannot be combined with response_format or structured_outputs; "
                                                     "set tool_choice to 'none'")

    @staticmethod
    def _parameters(tool: ToolDef) -> dict[str, Any]:
        return tool.function.parameters if tool.function.parameters is not None else {"type": "object", "properties": {}}

    def tool_plan(self, syntax: CallSyntax, special: frozenset[str] = frozenset()) -> ToolPlan | None:
        """How calls are constrained (None: no tools, or tool_choice 'none'); after check_supported."""
        if not self.tools or self.tool_choice == "none":
            return None
        functions = tuple(Function(t.function.name, self._parameters(t), t.function.description) for t in self.tools)
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            named = tuple(f for f in functions if f.name == choice.function.name)
            return ToolPlan(named, "function", False, syntax, special)
        return ToolPlan(functions, choice or "auto", self.parallel_tool_calls, syntax, special)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates render them (OpenAI's shape)."""
        if not self.tools:
            return None
        return [{"type": "function", "function": {k: v for k, v in (
            ("name", t.function.name), ("description", t.function.description),
            ("parameters", self._parameters(t))) if v is not None}} for t in self.tools]

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template(i) for i, m in enumerate(self.messages)]

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def sampling_params(self, choice: int, context_len: int, tools: ToolPlan | None = None) -> SamplingParams:
        # Like vLLM: without a limit, generate up to the context (the engine caps prompt + output there).
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(choice, context_len if limit is None else limit, logprobs,
                                     None if tools is None else tools.constraint())


class TokenizeRequest(_Body):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False,
                              json_schema_extra={"examples": [{"prompt": "Hello world"}]})

    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("prompt", "give exactly one of 'prompt' and 'messages'")
        if self.messages is not None and not self.messages:
            raise InvalidRequestError("messages", "must contain at least one message")


class DetokenizeRequest(_Body):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, json_schema_extra={"examples": [{"tokens": [1, 2, 3]}]})

    model: str | None = None
    tokens: list[StrictInt]

