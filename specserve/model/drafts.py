"""Finding a draft model for a target among the GGUF files a user keeps (`--draft-model auto`).

A draft model must map text to the same token ids as the target and should be a smaller model of
the same family, trained on the same data (the 0.5B Qwen2.5-Coder's drafts for the 1.5B are
accepted at about 0.8 a token: BENCHMARKS.md, session 20). Among the GGUF files of the models directory, the candidates are those
with the target's architecture and family name (`general.basename`, where both files have one), the
same vocabulary byte for byte (tokenizer model, pre-tokenizer, every token), and at most
MAX_SHARE of the target's parameters; the largest of them is the draft. Whether its drafts pay is
then measured by the engine, request by request (a draft that loses is not run).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specserve.model.gguf_file import GGUFError, GGUFFile, StringArray
from specserve.model.loader import gguf_behind

# Where `fetch.sh` and users keep GGUF files, unless SPECSERVE_MODELS says otherwise.
DEFAULT_MODELS_DIR = Path("~/.cache/specserve-models")
# A draft at most this share of the target's parameters (a draft token must cost far less than a
# target step to pay; the 0.5B Qwen2.5-Coder's file holds 0.35 of the 1.5B's numbers).
MAX_SHARE = 0.5


def models_dir() -> Path:
    """The directory searched for draft models: $SPECSERVE_MODELS, else ~/.cache/specserve-models."""
    return Path(os.environ.get("SPECSERVE_MODELS") or DEFAULT_MODELS_DIR).expanduser()


@dataclass(frozen=True)
class _Identity:
    """What decides whether two GGUF files can draft for each other, and how large one is."""

    architecture: str
    family: str | None
    vocabulary: tuple[str, str, bytes]  # tokenizer model, pre-tokenizer, the tokens' bytes
    parameters: int

    @classmethod
    def of(cls, path: Path) -> "_Identity | None":
        try:
            f = GGUFFile(path)
        except (GGUFError, OSError):
            return None
        tokens = f.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, StringArray):
            return None
        return cls(
            architecture=str(f.get("general.architecture", "")),
            family=f.get("general.basename"),
            vocabulary=(str(f.get("tokenizer.ggml.model", "")), str(f.get("tokenizer.ggml.pre", "")), f.raw(tokens)),
            parameters=sum(int(np.prod(t.shape)) for t in f.tensors.values()),
        )

    def drafts_for(self, target: "_Identity") -> bool:
        same_family = self.family is None or target.family is None or self.family == target.family
        return (self.architecture == target.architecture and same_family and self.vocabulary == target.vocabulary
                and self.parameters <= MAX_SHARE * target.parameters)


def draft_for(model: str, load_format: str = "auto", directory: Path | None = None) -> Path | None:
    """The draft model found for `model` (an alias or a path, as the engine takes it): for a GGUF
    target, `find_draft_model`; none for other targets."""
    target = gguf_behind(model, load_format) if load_format != "dummy" else None
    return find_draft_model(target, directory) if target is not None else None


def find_draft_model(target: Path, directory: Path | None = None) -> Path | None:
    """The GGUF file in `directory` (default `models_dir()`) that drafts for the GGUF `target`: the
    largest candidate (module docstring), or None."""
    directory = models_dir() if directory is None else directory
    if target.suffix != ".gguf" or not directory.is_dir():
        return None
    me = _Identity.of(target)
    if me is None:
        return None
    found: list[tuple[int, Path]] = []
    for path in sorted(directory.glob("*.gguf")):
        if not path.is_file() or path.resolve() == target.resolve():
            continue
        other = _Identity.of(path)
        if other is not None and other.drafts_for(me):
            found.append((other.parameters, path))
    return max(found, key=lambda c: c[0])[1] if found else None
