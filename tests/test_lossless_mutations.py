"""The exact-distribution checks can fail: each verification rule below is broken on purpose, and
at least one chain check and one tree check must then reject the outputs.

The checks are the suite's own (tests/test_spec_decoding.py, tests/test_structured.py): the engine
sampling 3,000 requests with a chain drafter (a draft model) and a tree drafter (n-gram), free and
under a grammar, every request counted; and the verifier alone on chains and multi-sample trees
drawn from a known proposal. A check "rejects" when a request errors or ends short, an output the
target (or its grammar) forbids appears, or Pearson's test gives p <= 0.001.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from specserve import SamplingParams
from specserve.speculation import grammar as tree_grammar
from specserve.speculation import verifier as verifier_module
from specserve.speculation.verifier import Verifier
from specserve.structured import GrammarCompiler, allow_all

from test_spec_decoding import SAMPLING_CASES, _spec, chi2_pvalue, exact_distribution, sample_counts
from test_structured import (
    GRAMMAR_SAMPLING, allowed_next, constrained_counts, constrained_exact, verifier_counts, verifier_exact,
)

Check = Callable[[], float]  # a p-value; 0 when an output the target forbids appears


@pytest.fixture(scope="module")
def checks(small_vocab: tuple[Path, Path], tiny_vocab_compiler: GrammarCompiler) -> dict[str, dict[str, Check]]:
    target, draft = small_vocab

    def free(case: str) -> Check:
        method, k, width, params, *stop = SAMPLING_CASES[case]
        return lambda: chi2_pvalue(sample_counts(target, _spec(method, k, width, draft, *stop), params, 3000)[0],
                                   exact_distribution(target, params), 3000)

    def constrained(case: str) -> Check:
        def run() -> float:
            counts, _ = constrained_counts(target, _spec(*GRAMMAR_SAMPLING[case], draft), 3000)
            if any(t not in allowed_next(k[:i]) for k in counts for i, t in enumerate(k)):
                return 0.0
            return chi2_pvalue(counts, constrained_exact(target, SamplingParams(max_tokens=6, temperature=1.0)), 3000)
        return run

    def verifier(shape: str, grammar: bool) -> Check:
        return lambda: chi2_pvalue(verifier_counts(tiny_vocab_compiler, 6000, shape, grammar),
                                   verifier_exact(grammar), 6000)

    return {
        "chain": {"engine draft-model": free("chain-draft-model-t1"),
                  "engine draft-model, grammar": constrained("chain-draft-model"),
                  "verifier, grammar": verifier("chain", True),
                  "verifier": verifier("chain", False)},
        "tree": {"engine n-gram": free("tree-ngram-t1"),
                 "engine n-gram, grammar": constrained("tree-ngram"),
                 "verifier multi-sample, grammar": verifier("tree", True),
                 "verifier multi-sample": verifier("tree", False)},
    }


@pytest.fixture(scope="module")
def small_vocab(tiny_model_factory) -> tuple[Path, Path]:
    from test_spec_decoding import VOCAB

    opts = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, initializer_range=0.15)
    return (tiny_model_factory("v4-target", **opts, seed=3),
            tiny_model_factory("v4-draft", **opts, seed=4, num_hidden_layers=1))


@pytest.fixture(scope="module")
def tiny_vocab_compiler(tiny_llama: Path) -> GrammarCompiler:
    from specserve import LLM
    from test_spec_decoding import VOCAB

    return GrammarCompiler(LLM(str(tiny_llama)).engine.grammar_compiler.tokenizer, vocab_size=VOCAB)


def _accept_q_over_p(p: torch.Tensor, q: torch.Tensor | None, x: int) -> torch.Tensor:
    return (1.0 if q is None else q[x]) / p[x].clamp_min(1e-30)


def _root_only(tree, grammar) -> torch.Tensor:
    bitmask = allow_all(len(tree) + 1, grammar.vocab_size)
    grammar.fill(bitmask, 0)
    return bitmask


def _drop_forbidden(tree, grammar):  # right for deterministic drafts, wrong for sampled ones
    return tree.keep([i for i, ok in enumerate(tree_grammar.walk(tree, grammar)) if ok])


def _break(monkeypatch: pytest.MonkeyPatch, rule: str) -> None:
    if rule == "accept with min(1, q/p)":
        monkeypatch.setattr(Verifier, "_acceptance", staticmethod(_accept_q_over_p))
    elif rule == "always accept":
        monkeypatch.setattr(Verifier, "_acceptance", staticmethod(lambda p, q, x: torch.tensor(1.0)))
    elif rule == "resample from the target, not the residual":
        monkeypatch.setattr(Verifier, "_residual", staticmethod(lambda p, q, x: p))
    elif rule == "mask only the grammar's root row":
        monkeypatch.setattr(verifier_module, "masks", _root_only)
        monkeypatch.setattr("specserve.speculation.speculator.prune", lambda tree, g: tree)
        monkeypatch.setattr(tree_grammar, "prune", lambda tree, g: tree)
    elif rule == "drop forbidden sampled nodes":
        monkeypatch.setattr("specserve.speculation.speculator.prune", _drop_forbidden)
        monkeypatch.setattr(tree_grammar, "prune", _drop_forbidden)
    else:
        raise AssertionError(rule)


RULES = ["accept with min(1, q/p)", "always accept", "resample from the target, not the residual",
         "mask only the grammar's root row", "drop forbidden sampled nodes"]


def _rejects(check: Check) -> bool:
    try:
        return check() <= 0.001
    except AssertionError:  # a request errored, ended short, or went uncounted
        return True


@pytest.mark.parametrize("rule", RULES)
def test_a_broken_rule_fails_a_chain_check_and_a_tree_check(checks, monkeypatch, rule: str) -> None:
    _break(monkeypatch, rule)
    for shape in ("chain", "tree"):
        caught = next((name for name, check in checks[shape].items() if _rejects(check)), None)
        assert caught is not None, f"no {shape} check notices {rule!r}"
