"""Structured outputs: a request's constraint compiled to a token-level grammar (llguidance).

`GrammarCompiler` turns a `StructuredOutputsParams` into a `TokenGrammar`, one per request: the
request's position in its grammar, which says which tokens may come next (a bitmask over the
vocabulary), accepts tokens as they are emitted, and rolls back, so that speculation can walk a
draft tree from the request's position and come back. llguidance does the grammar work (JSON
schema, regex, Lark and GBNF compilation, the Earley parser, the token masks); this module only
adapts it to the engine's tensors and errors.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import llguidance
import numpy as np
import torch

from specserve.errors import InvalidRequestError
from specserve.sampling_params import StructuredOutputsParams

# Optional JSON whitespace off: the separators json.dumps writes, which models mostly produce.
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Optional JSON whitespace on: a space, or one or two line breaks and at most 20 spaces or tabs of
# indentation (llama.cpp's JSON grammars allow the same). Unbounded whitespace lets a model that
# has started to indent go on forever, and the output ends at max_tokens as invalid JSON.
DEFAULT_JSON_WHITESPACE = r"\x20|\x0A{1,2}[\x20\x09]{0,20}"


def bitmask_words(vocab_size: int) -> int:
    """32-bit words in one row of a token bitmask over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def allow_all(rows: int, vocab_size: int) -> torch.Tensor:
    """A [rows, words] int32 bitmask allowing every token; rows are filled where a grammar applies."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [rows, vocab] with every token whose bit is 0 in `bitmask` [rows, words] set to -inf
    (a new tensor). Bit j of word w is token 32 w + j; `bitmask` is on the CPU."""
    rows, vocab = logits.shape
    words = np.ascontiguousarray(bitmask.numpy(), dtype="<i4")  # little-endian: bytes in token order
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
    if bits.shape[1] < vocab:
        raise ValueError(f"a bitmask of {bits.shape[1]} tokens cannot mask {vocab} logits")
    allowed = torch.from_numpy(bits[:, :vocab]).to(logits.device, torch.bool)
    return logits.masked_fill(~allowed, float("-inf"))


class TokenGrammar:
    """One request's position in its grammar. Not shared between requests.

    `vocab_size`: the model's (its logits' width); `mask_size`: the tokens a bitmask row covers,
    the larger of the model's and the tokenizer's vocabularies (`allow_all(rows, mask_size)`)."""

    def __init__(self, matcher: Any, vocab_size: int, mask_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self.mask_size = mask_size

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of the [rows, words] int32 CPU bitmask."""
        view = bitmask[row]
        self._m.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())

    def accept(self, token: int) -> bool:
        """Advance past `token`; False (and no change) when the grammar forbids it here."""
        return self._m.try_consume_tokens([int(token)]) == 1

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0 and not self._m.rollback(num_tokens):
            raise RuntimeError(f"grammar could not roll back {num_tokens} tokens: {self._m.get_error()}")

    def forced(self) -> list[int]:
        """Tokens that spell the text the grammar forces from here (its canonical tokenization: the
        model may spell the same text otherwise, so these are drafts, not certainties)."""
        return list(self._m.compute_ff_tokens())

    @property
    def done(self) -> bool:
        """Whether the grammar is complete and admits nothing more but the end of sequence."""
        return bool(self._m.is_stopped())


class GrammarCompiler:
    """Compiles constraints for one tokenizer. A constraint's compiled matcher is kept (up to
    `cache_size` of them, least recently used dropped) and copied for each request that uses it."""

    def __init__(self, tokenizer: Any, vocab_size: int, cache_size: int = 128) -> None:
        """tokenizer: an llguidance `LLTokenizer` (see `from_tokenizer`); vocab_size: the model's."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.mask_size = max(vocab_size, int(tokenizer.vocab_size))
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str, bool, str | None], Any] = OrderedDict()

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int] | set[int]) -> "GrammarCompiler":
        """For a fast tokenizer (ours, on the `tokenizers` library, or transformers') and a model with
        `vocab_size` logits (which may be larger or smaller than the tokenizer's vocabulary: the mask
        covers both). About a second."""
        import copy

        import llguidance

        n_vocab = max(vocab_size, len(tokenizer))
        eos = sorted(eos_token_ids) or tokenizer.eos_token_id
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("structured outputs need a fast tokenizer (a tokenizer.json)")
        backend = copy.copy(backend)  # llguidance reads the whole tokenizer, without padding or truncation
        backend.no_padding()
        backend.no_truncation()
        return cls(llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos), vocab_size)

    def compile(self, c: StructuredOutputsParams) -> TokenGrammar:
        """A fresh position at the start of the constraint's grammar. Raises InvalidRequestError
        naming `c.field` when the schema, regex or grammar is not one."""
        key = (c.kind, self._text(c), c.disable_any_whitespace, c.whitespace_pattern)
        template = self._cache.get(key)
        if template is None:
            template = self._build(c)
            self._cache[key] = template
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return TokenGrammar(template.deep_copy(), self.vocab_size, self.mask_size)

    @staticmethod
    def _text(c: StructuredOutputsParams) -> str:
        if c.kind == "json":
            return c.json  # type: ignore[return-value]
        if c.kind == "json_object":
            return '{"type": "object"}'
        if c.kind == "choice":
            return json.dumps(list(c.choice or ()))
        return getattr(c, c.kind)

    def _build(self, c: StructuredOutputsParams) -> Any:
        text = self._text(c)
        try:
            if c.kind in ("json", "json_object"):
                overrides = _COMPACT_JSON if c.disable_any_whitespace else {
                    "whitespace_flexible": True, "whitespace_pattern": c.whitespace_pattern or DEFAULT_JSON_WHITESPACE}
                grammar = llguidance.LLMatcher.grammar_from_json_schema(text, overrides=overrides)
            else:
                grammar = llguidance.grammar_from(c.kind, text)  # type: ignore[arg-type]  # regex, choice, grammar
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(c.field, _first_line(str(e))) from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise InvalidRequestError(c.field, _first_line(error))
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(c.field, _first_line(matcher.get_error()))
        return matcher


def _first_line(message: str) -> str:
    """The grammar engine's error, short enough for an HTTP error body."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    text = " ".join(lines[:4])
    return text if len(text) <= 400 else text[:397] + "..."
