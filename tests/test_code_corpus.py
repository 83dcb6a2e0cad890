"""The draft head's code-editing training prompts: made from the given code's functions, never from
the benchmark's functions or in its wording (so `bench`'s code-edit stays held out), the same for
the same seed; a training mixture takes each part's first prompts in order, and a resumed run
over answers made from other prompts is an error naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specserve.bench.datasets import CODE_EDITS
from specserve.train.code_corpus import EDITS, CodeEditCorpus
from specserve.train.drafter import DrafterTrainer, TrainConfig, data_parts


def _body(name: str, lines: int) -> str:
    return f"def {name}(x, y):\n" + "".join(f"    x = x + {i}\n" for i in range(lines - 2)) + \
        "    return x is not None and y == 1\n"


def _tree(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "pkg" / "a.py").write_text("\n".join(_body(f"f{i}", 8) for i in range(30)))
    (root / "pkg" / "b.py").write_text("class C:\n" + "".join(
        "    " + line + "\n" for i in range(10) for line in _body(f"m{i}", 10).splitlines()))
    (root / "pkg" / "short.py").write_text(_body("tiny", 3) + _body("huge", 80))
    (root / "pkg" / "broken.py").write_text("def (:\n")
    (root / "tests" / "t.py").write_text(_body("in_tests", 8))
    return root


def test_prompts_come_from_the_given_functions_and_not_the_benchmark(tmp_path: Path) -> None:
    corpus = CodeEditCorpus(_tree(tmp_path))
    codes = list(corpus.functions())
    names = {c.split("(")[0].removeprefix("def ") for c in codes}
    assert names == {f"f{i}" for i in range(30)} | {f"m{i}" for i in range(10)}  # not too short/long, no tests/
    assert all(not c.startswith(" ") for c in codes), "methods are dedented"
    prompts = corpus.prompts(25, seed=3)
    assert len(prompts) == 25 and len(set(prompts)) == 25
    assert prompts == corpus.prompts(25, seed=3)
    assert prompts != corpus.prompts(25, seed=4)
    for p in prompts:
        assert p.split(" ")[0] in {e.split(" ")[0] for e in EDITS}
        assert not any(instruction in p for instruction in CODE_EDITS.values())
    fixes = [p for p in prompts if p.startswith(EDITS[3])]
    assert fixes and all("x is None" in p for p in fixes), "a fix prompt holds a mistake"
    assert all("x is not None" in p for p in prompts if p not in fixes)


def test_stdlib_default_yields_prompts() -> None:
    prompts = CodeEditCorpus().prompts(12)
    assert len(prompts) == 12 and all("```python\n" in p for p in prompts)


def test_data_mixtures_parse_and_name_the_field() -> None:
    assert data_parts("sharegpt", 7) == [("sharegpt", 7)]
    assert data_parts("sharegpt:640,code-edits:400", 9) == [("sharegpt", 640), ("code-edits", 400)]
    for bad in ("sharegpt:640,code-edits", "sharegpt:0,code-edits:3"):
        with pytest.raises(ValueError, match="^data: "):
            data_parts(bad, 5)
    with pytest.raises(ValueError, match="^data: "):
        TrainConfig(out="x", data="a:1,b")


def _jsonl(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def test_a_mixture_answers_each_part_in_turn_and_resume_checks_the_prompts(tiny_llama: Path,
                                                                           tmp_path: Path) -> None:
    a = _jsonl(tmp_path / "a.jsonl", [f"alpha {i}" for i in range(9)])
    b = _jsonl(tmp_path / "b.jsonl", [f"beta {i}" for i in range(9)])
    common = dict(out=str(tmp_path / "head"), model=str(tiny_llama), max_prompt_tokens=64, max_new_tokens=2,
                  gen_batch=4)
    first = DrafterTrainer(TrainConfig(data=str(a), num_prompts=3, **common))  # type: ignore[arg-type]
    path = first.answers()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    mixed = TrainConfig(data=f"{a}:3,{b}:2", num_prompts=5, **common)  # type: ignore[arg-type]
    DrafterTrainer(mixed).answers()  # resumes: answers the 2 of b after a's 3
    rows2 = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows2) == 5 and rows2[:3] == rows
    tok = first.llm.tokenizer
    texts = [tok.decode(r["prompt"]) for r in rows2]
    assert all("alpha" in t for t in texts[:3]) and all("beta" in t for t in texts[3:])
    other = TrainConfig(data=f"{b}:3,{a}:3", num_prompts=6, **common)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^data: .*answers other prompts"):
        DrafterTrainer(other).answers()
