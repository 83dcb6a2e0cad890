"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from specserve.errors import InvalidRequestError

MAX_LOGPROBS = 20
# Sampling runs in float32: a nonzero value below its smallest normal number underflows (to a
# subnormal or to 0), and one above its largest overflows to infinity.
FLOAT32_TINY = 1.1754943508222875e-38
FLOAT32_MAX = 3.4028234663852886e38


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the output: to a JSON schema (`json`), any JSON object (`json_object`), a regular
    expression, one of several strings (`choice`), or a context-free grammar (`grammar`, Lark or
    GBNF). Exactly one is given. vLLM's `structured_outputs` fields, with the same names.

    `json` may be a dict or its JSON text; it is kept as text, properties in the order given (the
    output follows that order). JSON may hold a space or a line break and up to 20 characters of
    indentation between tokens (`whitespace_pattern`, a regex, sets another rule);
    `disable_any_whitespace` allows none (then `", "` and `": "` separate). `field` names where the
    request put the constraint, for errors (set by the server when it came as `response_format`).
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    field: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        base = self.field or "structured_outputs"
        if len(given) != 1:
            raise InvalidRequestError(
                base, f"give exactly one of {', '.join(STRUCTURED_KINDS)}; got {', '.join(given) or 'none'}"
            )
        kind = given[0]
        if not self.field:
            object.__setattr__(self, "field", f"{base}.{kind}")
        if kind == "json":
            object.__setattr__(self, "json", _schema_text(self.json, self.field))
        elif kind == "choice":
            choices = (self.choice,) if isinstance(self.choice, str) else self.choice
            if not isinstance(choices, (list, tuple)) or not choices or any(
                not isinstance(c, str) or not c for c in choices
            ):
                raise InvalidRequestError(self.field, "must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(choices))
        elif kind in ("regex", "grammar") and (not isinstance(getattr(self, kind), str) or not getattr(self, kind)):
            raise InvalidRequestError(self.field, "must be a non-empty string")
        if kind == "json_object" and self.json_object is not True:
            raise InvalidRequestError(self.field, "must be true or left out")
        json_kind = kind in ("json", "json_object")
        if self.whitespace_pattern is not None and (
            not json_kind or self.disable_any_whitespace or not isinstance(self.whitespace_pattern, str)
        ):
            raise InvalidRequestError(
                "structured_outputs.whitespace_pattern",
                "is a regex string, for json or json_object without disable_any_whitespace",
            )

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))


def _schema_text(schema: Any, name: str) -> str:
    """A JSON schema as JSON text, checked to be a JSON object (the schema's meaning is checked
    when it is compiled)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise InvalidRequestError(name, f"is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise InvalidRequestError(name, f"must be a JSON schema (a JSON object), got {type(schema).__name__}")
    return json.dumps(schema, ensure_ascii=False)


@dataclass(frozen=True)
class SamplingParams:
    """What to generate and how to pick each token.

    temperature 0 is greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable
    those filters. Penalties follow the OpenAI (presence, frequency: over the
    output so far) and CTRL/transformers (repetition: over prompt and output)
    definitions. `logprobs=n` returns the sampled token's log-probability and
    the n most likely alternatives under the model's raw distribution; `prompt_logprobs=n` the same
    for every prompt token after the first (computed in the prefill; such a request does not read
    the prefix cache, whose blocks hold K/V but no logits). `max_tokens=0` computes the prompt and
    ends ("length") without generating: for scoring with `prompt_logprobs`.
    `logit_bias` (token id -> bias in [-100, 100], a dict or (id, bias) pairs) is added to the
    logits before penalties, temperature and filters, as the OpenAI API and vLLM add it; -100
    bans a token in practice, +100 all but forces it.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        bias = self.logit_bias or ()
        pairs = bias.items() if isinstance(bias, dict) else bias
        try:
            object.__setattr__(self, "logit_bias", tuple(sorted((k, v) for k, v in pairs)))
        except (TypeError, ValueError):
            raise InvalidRequestError("logit_bias", "must map token ids to numbers") from None
        # Accept a bare string or any sequence for the tuple fields.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(name, msg)

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 0:
            raise bad("max_tokens", f"must be an integer >= 0, got {self.max_tokens!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, f"must be a finite number, got {value!r}")
        if not self.temperature >= 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature!r}")
        _check_float32("temperature", self.temperature, "use 0 for greedy decoding")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", f"must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if not self.repetition_penalty > 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        # Seen tokens' logits are multiplied by the penalty or by its inverse: both must be float32 numbers.
        _check_float32("repetition_penalty", self.repetition_penalty, "1 disables it")
        _check_float32("repetition_penalty", 1.0 / self.repetition_penalty, "1 disables it")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty!r}")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            isinstance(self.prompt_logprobs, bool) or not isinstance(self.prompt_logprobs, int)
            or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise bad("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "every stop string must be a non-empty string")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "token ids must be >= 0")
        for token, value in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise bad("logit_bias", f"keys must be token ids (integers >= 0), got {token!r}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise bad("logit_bias", f"the bias of token {token} must be a number in [-100, 100], got {value!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def needs_filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0



def _check_float32(name: str, value: float, hint: str) -> None:
    """Raise InvalidRequestError unless `value` is 0 or a normal float32 number (sampling runs in
    float32: 1e-45 would become 0 and 1e39 infinity, and the probabilities NaN)."""
    if value != 0 and not FLOAT32_TINY <= abs(value) <= FLOAT32_MAX:
        raise InvalidRequestError(
            name, f"{value!r} cannot be represented in float32, in which sampling runs "
            f"(nonzero magnitudes must lie in [{FLOAT32_TINY:.3g}, {FLOAT32_MAX:.3g}]); {hint}"
        )
