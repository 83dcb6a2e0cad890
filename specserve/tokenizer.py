"""Tokenizer loading, chat templates, prompts to token ids (PromptEncoder) and incremental
detokenization."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specserve.errors import InvalidRequestError

# Prompt tokens kept as left context so that the first output token decodes with its leading space.
_CONTEXT_TOKENS = 5


def load_tokenizer(path: Path) -> Any:
    """The tokenizer of a model directory. With a tokenizer.json (every fast tokenizer) it is loaded
    as PreTrainedTokenizerFast, the class AutoTokenizer returns for it too, without AutoTokenizer's
    registry of every model's tokenizer class (56 MB resident for the bundled model's)."""
    if (Path(path) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


# Tokens that end a turn in the chat formats of the families served (llama.cpp stops on the same
# "end of generation" set): a model may end with any of them, not only its declared eos id (Qwen2.5
# declares <|im_end|> and also ends with <|endoftext|>; Llama 3 ends turns with <|eot_id|>).
END_OF_GENERATION = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|end|>",
                     "<end_of_turn>", "<|return|>", "<|call|>")


def end_of_generation_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of END_OF_GENERATION tokens that are added (special) tokens of `tokenizer`."""
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    return frozenset(int(added[t]) for t in END_OF_GENERATION if t in added)


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
