"""Tokenizer loading, chat templates and incremental detokenization."""

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


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids for a conversation, ending with the assistant's turn prompt."""
    if not messages:
        raise InvalidRequestError("messages", "must contain at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise InvalidRequestError(f"messages[{i}]", "each message needs 'role' and 'content'")
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError("messages", "this model has no chat template; send a plain prompt instead")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


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
