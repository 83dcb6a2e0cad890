"""Tokenizer loading, chat templates, prompts to token ids (PromptEncoder) and incremental
detokenization."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specserve.chat_template import ChatTemplate, ChatTemplateError

from specserve.errors import InvalidRequestError

# Prompt tokens kept as left context so that the first output token decodes with its leading space.
_CONTEXT_TOKENS = 5


_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def load_tokenizer(path: Path) -> Any:
    """The tokenizer of a model directory. With a tokenizer.json (every fast tokenizer) it is our
    `Tokenizer`, on the `tokenizers` library: importing transformers alone is 0.8 s of a server's
    start. A directory with only a slow (SentencePiece/Python) tokenizer goes to transformers'
    AutoTokenizer."""
    if (Path(path) / "tokenizer.json").is_file():
        return Tokenizer.from_dir(Path(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


# The files of a model directory that map text to token ids (not its weights, which may be GBs;
# not a chat_template.jinja, which only renders messages).
_TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "vocab", "merges", "added_tokens")


class TokenizerCache:
    """Tokenizers loaded once per content, for a target and its draft models: a draft model's
    directory maps text to ids as its target's does, file for file, as a rule (the Qwen2.5-Coder
    0.5B's tokenizer.json is the 1.5B's), and loading it again took 0.5 s of the default server's
    start. Directories are told apart by the bytes of the files that make the ids; a separate
    chat_template.jinja is not one of them (the 0.5B's differs from the 1.5B's), so a directory
    that differs only there gets the tokenizer loaded first, with its template: the target's, which
    is loaded first, and a draft model's template is never rendered."""

    def __init__(self) -> None:
        self._loaded: dict[str, Any] = {}

    def __call__(self, path: Path) -> Any:
        key = self.digest(Path(path))
        if key not in self._loaded:
            self._loaded[key] = load_tokenizer(path)
        return self._loaded[key]

    @staticmethod
    def digest(path: Path) -> str:
        h = hashlib.sha256()
        for f in sorted(p for p in path.iterdir()
                        if p.is_file() and (p.name.startswith(_TOKENIZER_FILES) or p.suffix in (".model", ".tiktoken"))):
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
        return h.hexdigest()


@dataclass(frozen=True)
class Encoding:
    """What calling a tokenizer gives (the field callers read of a transformers BatchEncoding)."""

    input_ids: list[int]


def _clean_up_spaces(text: str) -> str:
    """transformers' `clean_up_tokenization` (for WordPiece-style decoders)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


class Tokenizer:
    """A fast tokenizer as transformers' PreTrainedTokenizerFast sets one up from a directory
    (tokenizer.json, tokenizer_config.json, chat_template.jinja), with the part of its interface the
    engine and its users call: encoding, decoding, special tokens, vocabularies, chat templates. The
    parity tests hold it to transformers token for token and template for template."""

    def __init__(self, backend: Any, config: dict[str, Any], chat_template: str | dict[str, str] | None) -> None:
        self.backend_tokenizer = backend
        self.init_kwargs = config
        self._template = ChatTemplate(chat_template) if chat_template else None
        self._special: dict[str, str] = {}
        for name in _SPECIAL_TOKEN_NAMES:
            value = config.get(name)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                self._special[name] = value
        self._setup_backend(config)
        self._clean_up = bool(config.get("clean_up_tokenization_spaces", False)) and \
            type(backend.model).__name__ != "BPE"  # transformers ignores it for BPE (it would corrupt output)

    @classmethod
    def from_dir(cls, path: Path) -> "Tokenizer":
        from tokenizers import Tokenizer as Backend

        path = Path(path)
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        template: str | dict[str, str] | None = None
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        elif (path / "chat_template.json").is_file():
            template = json.loads((path / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
        elif config.get("chat_template") is not None:
            template = config["chat_template"]
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = {t["name"]: t["template"] for t in template}
        return cls(Backend.from_file(str(path / "tokenizer.json")), config, template)

    def _setup_backend(self, config: dict[str, Any]) -> None:
        """What transformers does to the backend at load: no padding or truncation, the config's
        added tokens and named special tokens present, and a BOS/EOS post-processor where the config
        asks for one (or the file has none)."""
        from tokenizers import AddedToken, processors

        b = self.backend_tokenizer
        b.no_padding()
        b.no_truncation()
        present = {t.content for t in b.get_added_tokens_decoder().values()}
        missing = []
        for _, t in sorted(config.get("added_tokens_decoder", {}).items(), key=lambda kv: int(kv[0])):
            if t["content"] not in present:
                missing.append(AddedToken(t["content"], single_word=t.get("single_word", False),
                                          lstrip=t.get("lstrip", False), rstrip=t.get("rstrip", False),
                                          normalized=t.get("normalized", True), special=t.get("special", False)))
                present.add(t["content"])
        for content in self._special.values():
            if content not in present:
                missing.append(AddedToken(content, special=True))
                present.add(content)
        if missing:
            b.add_tokens(missing)
        if "add_bos_token" in config or "add_eos_token" in config or b.post_processor is None:
            bos = self._special.get("bos_token") if config.get("add_bos_token") else None
            eos = self._special.get("eos_token") if config.get("add_eos_token") else None
            single = f"{bos + ':0 ' if bos else ''}$A:0{' ' + eos + ':0' if eos else ''}"
            pair = f"{single}{' ' + bos + ':1' if bos else ''} $B:1{' ' + eos + ':1' if eos else ''}"
            special = [(t, b.token_to_id(t)) for t in (bos, eos) if t]
            b.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)

    # Encoding and decoding.
    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoding:
        return Encoding(self.encode(text, add_special_tokens=add_special_tokens))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: int | list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend_tokenizer.decode([ids] if isinstance(ids, int) else list(ids),
                                             skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self._clean_up else text

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def convert_ids_to_tokens(self, ids: int | list[int]) -> Any:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> Any:
        def one(token: str) -> int | None:
            found = self.backend_tokenizer.token_to_id(token)
            return found if found is not None else self.unk_token_id

        return one(tokens) if isinstance(tokens, str) else [one(t) for t in tokens]

    # Vocabularies and special tokens.
    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (as transformers counts it)."""
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=False))

    def __len__(self) -> int:
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=True))

    def get_vocab(self) -> dict[str, int]:
        return dict(self.backend_tokenizer.get_vocab(with_added_tokens=True))

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        return dict(sorted(self.backend_tokenizer.get_added_tokens_decoder().items()))

    def get_added_vocab(self) -> dict[str, int]:
        return {t.content: i for i, t in self.added_tokens_decoder.items()}

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return dict(self._special)

    @property
    def all_special_ids(self) -> list[int]:
        return [i for i, t in self.added_tokens_decoder.items() if t.special]

    def _special_id(self, name: str) -> int | None:
        token = self._special.get(name)
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    bos_token = property(lambda self: self._special.get("bos_token"))
    eos_token = property(lambda self: self._special.get("eos_token"))
    unk_token = property(lambda self: self._special.get("unk_token"))
    pad_token = property(lambda self: self._special.get("pad_token"))
    bos_token_id = property(lambda self: self._special_id("bos_token"))
    eos_token_id = property(lambda self: self._special_id("eos_token"))
    unk_token_id = property(lambda self: self._special_id("unk_token"))
    pad_token_id = property(lambda self: self._special_id("pad_token"))

    # Chat templates.
    @property
    def chat_template(self) -> str | dict[str, str] | None:
        return None if self._template is None else self._template.source

    @chat_template.setter
    def chat_template(self, source: str | dict[str, str] | None) -> None:
        self._template = ChatTemplate(source) if source else None

    def apply_chat_template(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            tokenize: bool = True, add_generation_prompt: bool = False,
                            **variables: Any) -> str | list[int]:
        """As transformers' method of the name: the special tokens' names are the template's
        variables too (`variables` win)."""
        if self._template is None:
            raise ChatTemplateError("this tokenizer has no chat template")
        text = self._template.render(conversation, tools, add_generation_prompt, **{**self._special, **variables})
        return self.encode(text, add_special_tokens=False) if tokenize else text


# Tokens that end a turn in the chat formats of the families served (llama.cpp stops on the same
# "end of generation" set): a model may end with any of them, not only its declared eos id (Qwen2.5
# declares <|im_end|> and also ends with <|endoftext|>; Llama 3 ends turns with <|eot_id|>).
END_OF_GENERATION = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|end|>",
                     "<end_of_turn>", "<|return|>", "<|call|>")


def end_of_generation_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of END_OF_GENERATION tokens that are added (special) tokens of `tokenizer`."""
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    return frozenset(int(added[t]) for t in END_OF_GENERATION if t in added)


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of the tokens a tokenizer added to its vocabulary (the chat format's markers, tool
    calls, end of turn, END_OF_GENERATION's among them: where BPE tokenizers put them, at the end)
    and its eos id."""
    ids = {int(i) for i in (getattr(tokenizer, "added_tokens_decoder", None) or {})}
    eos = getattr(tokenizer, "eos_token_id", None)
    return frozenset(ids | ({eos} if isinstance(eos, int) else set()))


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]],
                        tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids for a conversation, ending with the assistant's turn prompt; `tools` (OpenAI's
    function definitions) go to a template that renders them."""
    if not messages:
        raise InvalidRequestError("messages", "must contain at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise InvalidRequestError(f"messages[{i}]", "each message needs 'role' and 'content'")
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError("messages", "this model has no chat template; send a plain prompt instead")
    extra = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    return tokenizer(text, add_special_tokens=False).input_ids


class PromptEncoder:
    """Prompts to the token ids an engine is given, and token ids back to text: the tokenizer side of
    input processing, run in the caller's process (the server's, the pool's), so what crosses to the
    engine core is data (token ids, sampling parameters). Every failure is an InvalidRequestError
    naming the field. Not for concurrent use from several threads (a tokenizer's call may change its
    settings): the server runs it on one thread."""

    def __init__(self, tokenizer: Any | None, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def tokenize(self, text: str, field: str = "prompt") -> list[int]:
        """Token ids of `text`, exactly as a text prompt is tokenized for generation."""
        if self.tokenizer is None:
            raise InvalidRequestError(field, "this model has no tokenizer; pass token ids instead")
        return list(self.tokenizer(text).input_ids)

    def prompt(self, prompt: str | list[int]) -> list[int]:
        """A completion prompt's token ids: text tokenized, ids checked against the vocabulary."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            ids = self.tokenize(prompt)
            if not ids:
                raise InvalidRequestError("prompt", "tokenizes to zero tokens")
            return ids
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt", "must not be empty")
        self.check_token_ids(ids)
        return ids

    def chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """A conversation's token ids through the model's chat template, ending with the assistant's
        turn prompt (with `tools` for a template that renders them)."""
        if self.tokenizer is None:
            raise InvalidRequestError("messages", "this model has no tokenizer")
        try:
            return list(apply_chat_template(self.tokenizer, messages, tools))
        except InvalidRequestError:
            raise
        except Exception as e:  # noqa: BLE001 - a template that rejects the conversation (jinja raise_exception)
            raise InvalidRequestError("messages", f"the chat template rejected the conversation: {e}") from None

    def decode(self, ids: list[int], field: str = "tokens") -> str:
        self.check_token_ids(ids, field)
        if self.tokenizer is None:
            raise InvalidRequestError(field, "this model has no tokenizer")
        try:
            return str(self.tokenizer.decode(ids))
        except Exception as e:  # noqa: BLE001 - ids the tokenizer does not know
            raise InvalidRequestError(field, f"cannot decode: {e}") from None

    def check_token_ids(self, ids: list[int], field: str = "prompt") -> None:
        """Raise InvalidRequestError naming `field` unless every id is in the vocabulary."""
        vocab = self.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(field, f"token ids must be integers in [0, {vocab})")


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, emitting only complete characters.

    Decodes a short window (a few tokens before the last emitted one, and the
    new ones) and keeps the part past what was already emitted, so that
    multi-token characters and leading spaces come out right.
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int]) -> None:
        self._tok = tokenizer
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        if len(full) <= len(prefix_text) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix_text) :]
        self._prefix = self._read
        self._read = len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Whatever is left undecoded (e.g. an incomplete character at the end)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        delta = full[len(prefix_text) :] if len(full) > len(prefix_text) else ""
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True) if ids else ""
