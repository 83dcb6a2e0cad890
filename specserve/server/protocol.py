"""Request bodies of the OpenAI-compatible API (pydantic), and how a body becomes sampling params.

Types are checked here (a wrong type is a 400 naming the field); ranges are checked by
`SamplingParams`, whose InvalidRequestError names the field too. Unknown fields are ignored, as
the OpenAI API and vLLM do; fields we cannot honour (tools, logit_bias, ...) are rejected.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from specserve.errors import InvalidRequestError
from specserve.sampling_params import SamplingParams

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_N = 128


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


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

    def check_supported(self) -> None:
        if self.logit_bias:
            raise InvalidRequestError("logit_bias", "is not supported")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options", "may only be set when stream is true")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(self, choice: int, max_tokens: int, logprobs: int | None) -> SamplingParams:
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
        if self.echo:
            raise InvalidRequestError("echo", "is not supported")
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

    def sampling_params(self, choice: int) -> SamplingParams:
        # OpenAI's default for completions is 16 tokens.
        return self._sampling_params(choice, 16 if self.max_tokens is None else self.max_tokens, self.logprobs)


class TextPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    role: StrictStr
    content: StrictStr | list[TextPart] | None = None
    name: str | None = None

    def to_template(self, index: int) -> dict[str, Any]:
        """The message as the chat template sees it: role and text content."""
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
        return message


class ResponseFormat(_Body):
    type: str = "text"


class ChatCompletionRequest(_SamplingFields):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, json_schema_extra={
        "examples": [{"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 16}]})

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: ResponseFormat | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise InvalidRequestError("tools", "tool calling is not supported")
        if self.response_format is not None and self.response_format.type != "text":
            raise InvalidRequestError("response_format", f"type {self.response_format.type!r} is not supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "needs logprobs: true")

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template(i) for i, m in enumerate(self.messages)]

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def sampling_params(self, choice: int, context_len: int) -> SamplingParams:
        # Like vLLM: without a limit, generate up to the context (the engine caps prompt + output there).
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(choice, context_len if limit is None else limit, logprobs)


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

