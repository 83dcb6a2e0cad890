"""Chat templates rendered as Hugging Face transformers renders them, without importing transformers
(its import is about 0.8 s of a server's start; rendering needs only jinja2).

The environment is the one `transformers.utils.chat_template_utils` builds: a sandbox that cannot
change the objects it is given, `trim_blocks` and `lstrip_blocks`, loop controls, a `{% generation %}`
tag (rendered as its body), `raise_exception`, `strftime_now`, `tojson` without HTML escaping, and
`dict`/`namespace` that refuse underscore names. Messages are handed over as plain JSON data with
None-valued keys dropped, and reasoning fields aliased under the names templates read. The parity
tests compare this renderer with transformers' on every template they have.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

# A message's reasoning, under the names templates read it by; the first is the standard one.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A template that cannot be compiled, or one that rejects a conversation (`raise_exception`)."""


def _plain(value: Any) -> Any:
    """`value` rebuilt from plain JSON types (what a template may see: no objects with methods)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):  # a pydantic model
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _messages(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, message in enumerate(conversation):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"messages[{i}] is not a dict")
        m = {k: v for k, v in _plain(message).items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


@lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (marks the assistant's tokens in training
        templates): rendered as its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        @staticmethod
        def _body(caller: Any) -> str:
            return str(caller())

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's own signature trick
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = Namespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from None


class ChatTemplate:
    """One model's chat template (or its named templates, as tokenizer_config.json may list them:
    "default" and "tool_use")."""

    def __init__(self, source: str | dict[str, str]) -> None:
        self.templates = dict(source) if isinstance(source, dict) else {"default": source}
        if not self.templates or not all(isinstance(t, str) for t in self.templates.values()):
            raise ChatTemplateError("chat_template must be a string or named strings")

    @property
    def source(self) -> str | dict[str, str]:
        """As the tokenizer's `chat_template` attribute gives it: the string, or the named strings."""
        return self.templates["default"] if list(self.templates) == ["default"] else dict(self.templates)

    def select(self, tools: list[dict[str, Any]] | None) -> str:
        if tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise ChatTemplateError(f"no 'default' among the named chat templates {sorted(self.templates)}")

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = False, **variables: Any) -> str:
        """The conversation as text. `variables` are the template's other inputs (bos_token,
        eos_token, ..., and any the caller adds)."""
        import jinja2

        template = _compile(self.select(tools))
        try:
            return str(template.render(messages=_messages(messages), tools=_plain(tools), documents=None,
                                       add_generation_prompt=add_generation_prompt, **_plain(variables)))
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(str(e)) from None
