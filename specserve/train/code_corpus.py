"""Code-editing prompts for training a draft head, made from Python source files on this machine.

A coder model's users hand it code and ask for the code back changed (type hints, docstrings,
renames, a fix): the answer copies most of its input, and a head learns to copy only from
answers like these. `bench` measures that workload on HumanEval's functions with four
instructions (`specserve.bench.datasets.CodeEdit`); the training prompts here come from other code
(the standard library's own modules, or any directory of `.py` files) and other wording, so the
benchmark stays held out.

Every function or method of 6..40 lines is a candidate; the candidates are shuffled with the seed
and each is given one of `EDITS` in turn (and, for "fix", one small mutation from `_MUTATIONS`).
"""

from __future__ import annotations

import ast
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

# Instructions in the wording of the training prompts (the benchmark words its own differently).
EDITS: tuple[str, ...] = (
    "Annotate this function's parameters and return value with Python type hints.",
    "Write a short Google-style docstring for this function; leave the code itself as it is.",
    "Give the local variables and parameters clearer, more descriptive names.",
    "Something in this function is wrong. Find the mistake and correct it.",
    "Add comments that explain the less obvious lines.",
    "Add argument checks at the top of the function that raise ValueError or TypeError for bad input.",
    "Use f-strings wherever this code formats or concatenates strings, and tidy the formatting.",
    "Add logging: create a module logger and log a debug message when the function starts and returns.",
    "Reduce the nesting of this function with early returns, keeping its behaviour identical.",
    "Convert the comments and docstring to reStructuredText style and add :param: and :returns: fields.",
)
_FIX = 3

_REPLIES: tuple[str, ...] = (
    "Reply with the full modified code in a single Python code block.",
    "Show the whole function after the change, in one ```python block, without explanation.",
    "Return the complete edited code only.",
    "Output the entire updated function.",
)

# Small mistakes for the "fix" instruction: the first that applies to the function's body.
_MUTATIONS: tuple[tuple[str, str], ...] = (
    (" is not None", " is None"), (" not in ", " in "), (" and ", " or "), (" >= ", " > "), (" <= ", " < "),
    (" == ", " != "), ("[1:]", "[2:]"), (" + 1", " - 1"), ("return True", "return False"), (" - 1", " + 1"),
)

_SKIP_PARTS = frozenset({"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo",
                         "__pycache__", "ensurepip", "pydoc_data"})


@dataclass(frozen=True)
class CodeEditCorpus:
    """Code-editing prompts from the `.py` files under `root` (default: this interpreter's standard
    library). `min_lines`/`max_lines` bound a function's length."""

    root: Path | None = None
    min_lines: int = 6
    max_lines: int = 40
    max_chars: int = 2400

    def __post_init__(self) -> None:
        if self.min_lines < 1 or self.max_lines < self.min_lines:
            raise ValueError(f"max_lines: must be >= min_lines >= 1, got {self.min_lines}..{self.max_lines}")

    def functions(self) -> Iterator[str]:
        """The source of every function of the right length, file by file in sorted order."""
        root = self.root or Path(sysconfig.get_paths()["stdlib"])
        if not root.is_dir():
            raise ValueError(f"root: {root} is not a directory")
        for path in sorted(root.rglob("*.py")):
            if _SKIP_PARTS.intersection(path.relative_to(root).parts) or path.name.startswith("test_"):
                continue
            try:
                text = path.read_text(encoding="utf-8")
                tree = ast.parse(text)
            except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
                continue
            lines = text.splitlines()
            for node in ast.walk(tree):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.end_lineno is None:
                    continue
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                body = lines[first - 1 : node.end_lineno]
                if not self.min_lines <= len(body) <= self.max_lines:
                    continue
                indent = min(len(s) - len(s.lstrip()) for s in body if s.strip())
                code = "\n".join(s[indent:] for s in body).strip()
                if len(code) <= self.max_chars:
                    yield code

    def prompts(self, n: int, seed: int = 0) -> list[str]:
        """`n` prompts (fewer if the files hold fewer functions): the functions shuffled with `seed`,
        the i-th given edit i mod len(EDITS); a "fix" whose function has no mutation to put in is
        skipped."""
        codes = sorted(set(self.functions()))
        rng = random.Random(seed)
        rng.shuffle(codes)
        out: list[str] = []
        for i, code in enumerate(codes):
            if len(out) >= n:
                break
            kind = i % len(EDITS)
            if kind == _FIX:
                bug = next(((a, b) for a, b in _MUTATIONS if a in code), None)
                if bug is None:
                    continue
                code = code.replace(bug[0], bug[1], 1)
            out.append(f"{EDITS[kind]} {_REPLIES[rng.randrange(len(_REPLIES))]}\n\n```python\n{code}\n```")
        return out
