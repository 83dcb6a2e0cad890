"""Speculative decoding options."""

from __future__ import annotations

from dataclasses import dataclass

SPEC_METHODS = ("none", "ngram", "suffix", "recycling", "draft-model", "layer-skip")


@dataclass(frozen=True)
class SpecConfig:
    """Which drafter, and how many draft tokens per request per step.

    method: none | ngram | suffix | recycling | draft-model | layer-skip
    num_tokens: draft tokens (tree nodes) each decoding request may get per step (K); 0 = plain decoding
    width: tree width where the drafter has one (ngram: distinct continuations; draft-model:
        candidates at the root)
    draft_model: model for `draft-model` (alias, .gguf or HF directory); must share the tokenizer
    draft_layers: how many of the target's first layers `layer-skip` drafts with (None: the
        measured default for the model, else half the layers)
    """

    method: str = "none"
    num_tokens: int = 4
    width: int = 1
    draft_model: str | None = None
    draft_layers: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"spec: unknown method {self.method!r}; choose one of {', '.join(SPEC_METHODS)}")
        if self.num_tokens < 0:
            raise ValueError(f"spec_tokens: must be >= 0, got {self.num_tokens}")
        if self.width < 1:
            raise ValueError(f"spec_width: must be >= 1, got {self.width}")
        if self.method == "draft-model" and not self.draft_model:
            raise ValueError("draft_model: --spec draft-model needs --draft-model PATH")
        if self.draft_layers is not None and self.draft_layers < 1:
            raise ValueError(f"draft_layers: must be >= 1, got {self.draft_layers}")

    @property
    def enabled(self) -> bool:
        return self.method != "none" and self.num_tokens > 0
