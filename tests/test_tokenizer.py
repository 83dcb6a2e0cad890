"""The engine's tokenizer (on the `tokenizers` library, without transformers) is transformers'
PreTrainedTokenizerFast token for token and template for template: encoding with and without
special tokens, decoding with and without them, special tokens and vocabularies, chat templates
with tools, named templates, the jinja features templates use. And a model loads and chats without
importing transformers (its import is 0.8 s of a server's start)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from specserve.chat_template import ChatTemplateError
from specserve.tokenizer import Tokenizer, load_tokenizer

TEXTS = ["Hello world!", "  def f(x):\n\treturn x**2  # ünïcødé 你好 🤖", "<|im_start|>user\nhi<|im_end|>", "",
         "a" * 50, " don't  , . ?", "</s><s> mixed <s>"]
MESSAGES = [{"role": "system", "content": "You are X."}, {"role": "user", "content": "Write code"},
            {"role": "assistant", "content": "ok", "tool_calls": None, "reasoning_content": "think"},
            {"role": "user", "content": "more \u00e9"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]

# Features chat templates on the Hub use, each compared with transformers' rendering.
TEMPLATES = {
    "namespace_loopcontrols": (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{{ ns.n }}:{{ m.role }}:{{ m.content }}\n{% if loop.index > 3 %}{% break %}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"),
    "tojson_tools": (
        "{% if tools %}{% for t in tools %}{{ t | tojson(indent=2) }}{{ t.function | tojson(sort_keys=true) }}"
        "{% endfor %}{% endif %}{% for m in messages %}{{ bos_token }}{{ m['content'] | trim }}{{ eos_token }}"
        "{% endfor %}"),
    "generation_tag_reasoning": (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.thinking }}|{{ m.content }}"
        "{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}"),
    "dict_and_whitespace": (
        "{%- set d = dict(a=1, b=[1, 2]) -%}\n  {{ d.b[1] }}\n{% for m in messages -%}\n    {{ m.role }}\n"
        "{%- endfor %}\n{{ (1, 2) }}\n    {% if messages %}indented block tags{% endif %}\n  {% for x in [1] %}\n{{ x }}\n"
        "  {% endfor %}\n"),
}


def _pair(path: Path) -> tuple[Any, Tokenizer]:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path)), Tokenizer.from_dir(path)


def _bundled_tokenizer_dir() -> Path:
    from specserve.model.gguf_model import gguf_tokenizer_dir
    from specserve.model.loader import find_bundled_gguf

    return gguf_tokenizer_dir(find_bundled_gguf("smollm2-135m"))


@pytest.fixture(scope="module", params=["tiny", "bundled"])
def pair(request: pytest.FixtureRequest, tiny_llama: Path) -> tuple[Any, Tokenizer]:
    return _pair(tiny_llama if request.param == "tiny" else _bundled_tokenizer_dir())


def test_encoding_and_decoding_match_transformers(pair: tuple[Any, Tokenizer]) -> None:
    hf, ours = pair
    for text in TEXTS:
        for special in (True, False):
            assert ours(text, add_special_tokens=special).input_ids == hf(text, add_special_tokens=special).input_ids
        ids = hf(text).input_ids + [hf.eos_token_id]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


def test_special_tokens_and_vocabularies_match_transformers(pair: tuple[Any, Tokenizer]) -> None:
    hf, ours = pair
    for attr in ("vocab_size", "bos_token", "eos_token", "pad_token", "unk_token", "bos_token_id", "eos_token_id",
                 "pad_token_id", "unk_token_id", "special_tokens_map", "chat_template"):
        assert getattr(ours, attr) == getattr(hf, attr), attr
    assert len(ours) == len(hf)
    assert ours.get_added_vocab() == hf.get_added_vocab()
    assert ours.get_vocab() == hf.get_vocab()
    assert ours.convert_tokens_to_ids(["<s>", "</s>", "a"]) == hf.convert_tokens_to_ids(["<s>", "</s>", "a"])


def test_the_bundled_models_chat_template_matches_transformers() -> None:
    hf, ours = _pair(_bundled_tokenizer_dir())
    for tools in (None, TOOLS):
        for gen in (True, False):
            want = hf.apply_chat_template(MESSAGES, tools=tools, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(MESSAGES, tools=tools, tokenize=False, add_generation_prompt=gen) == want
            assert ours.apply_chat_template(MESSAGES, tools=tools, add_generation_prompt=gen) == \
                hf.apply_chat_template(MESSAGES, tools=tools, add_generation_prompt=gen, return_dict=False)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_template_features_render_as_in_transformers(name: str, tiny_llama: Path) -> None:
    hf, ours = _pair(tiny_llama)
    hf.chat_template = ours.chat_template = TEMPLATES[name]
    for tools in (None, TOOLS):
        want = hf.apply_chat_template(MESSAGES, tools=tools, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(MESSAGES, tools=tools, tokenize=False, add_generation_prompt=True) == want


def test_named_templates_tool_use_is_taken_with_tools(tiny_llama: Path, tmp_path: Path) -> None:
    d = tmp_path / "named"
    d.mkdir()
    for f in tiny_llama.iterdir():
        if f.name.startswith("tokenizer"):
            (d / f.name).write_bytes(f.read_bytes())
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "plain:{{ messages[0].content }}"},
                               {"name": "tool_use", "template": "tools:{{ tools[0].function.name }}"}]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    hf, ours = _pair(d)
    for tools in (None, TOOLS):
        want = hf.apply_chat_template(MESSAGES, tools=tools, tokenize=False)
        assert ours.apply_chat_template(MESSAGES, tools=tools, tokenize=False) == want
    assert ours.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False) == "tools:get_weather"


def test_template_errors_and_the_sandbox(tiny_llama: Path) -> None:
    ours = load_tokenizer(tiny_llama)
    ours.chat_template = "{{ raise_exception('no system role, please') }}"
    with pytest.raises(ChatTemplateError, match="no system role"):
        ours.apply_chat_template(MESSAGES, tokenize=False)
    ours.chat_template = "{% for m in messages %}"  # does not compile
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ours.apply_chat_template(MESSAGES, tokenize=False)
    ours.chat_template = "{{ messages.append(1) }}"  # the sandbox keeps the conversation read-only
    with pytest.raises(ChatTemplateError, match="unsafe|not safely|access"):
        ours.apply_chat_template(MESSAGES, tokenize=False)
    ours.chat_template = "{% set ns = namespace(_x=1) %}"
    with pytest.raises(ChatTemplateError, match="_x"):
        ours.apply_chat_template(MESSAGES, tokenize=False)


def test_a_model_loads_and_chats_without_importing_transformers(tiny_llama: Path) -> None:
    code = (
        "import sys\n"
        "from specserve import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_llama)!r})\n"
        "llm.chat([[{'role': 'user', 'content': 'hi'}]], SamplingParams(max_tokens=4))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_a_tokenizer_is_loaded_once_per_content_not_per_directory(tiny_llama: Path, tmp_path: Path) -> None:
    """A draft model's directory that holds its target's tokenizer files gets the target's
    tokenizer object (TokenizerCache); one whose tokenizer differs in a byte gets its own; the
    weights and a chat_template.jinja beside them are not what tells them apart."""
    import shutil

    from specserve.tokenizer import TokenizerCache

    copy, changed = tmp_path / "copy", tmp_path / "changed"
    for d in (copy, changed):
        shutil.copytree(tiny_llama, d)
    (copy / "model.safetensors").write_bytes(b"other weights")
    (copy / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")  # a draft's template is never rendered
    config = json.loads((changed / "tokenizer_config.json").read_text())
    config["model_max_length"] = 12345
    (changed / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizers = TokenizerCache()
    first = tokenizers(tiny_llama)
    assert tokenizers(copy) is first
    assert tokenizers(changed) is not first
    assert tokenizers(changed).encode("a b c") == first.encode("a b c")


def test_a_draft_model_with_another_vocabulary_is_refused_and_one_with_the_same_shares_it(
        tiny_llama: Path, tiny_model_factory: Any, tmp_path: Path) -> None:
    """The draft model's tokenizer must be the target's (drafts are token ids): one whose vocabulary
    differs (two tokens' ids swapped) is refused when the engine is built; one with the same files
    is loaded once, and the check against the target's compares no vocabularies."""
    import shutil

    from specserve.entrypoints.llm import LLM

    draft = tiny_model_factory("draft", seed=1, num_hidden_layers=1)
    swapped = tmp_path / "swapped"
    shutil.copytree(draft, swapped)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="tokenizer differs"):
        LLM(str(tiny_llama), speculative=dict(method="draft-model", draft_model=str(swapped)))
    llm = LLM(str(tiny_llama), speculative=dict(method="draft-model", draft_model=str(draft)))
    assert llm.tokenizer is llm._tokenizers(draft)
