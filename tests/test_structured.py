"""Structured outputs: every output follows its constraint (JSON schema, regex, choice, grammar);
with speculation, greedy and seeded outputs are token for token those without it, sampled outputs
follow the constrained target's exact distribution, and a tree node the grammar forbids is never
verified as a draft. Bad constraints are errors naming the field, raised before anything is queued."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from specserve import LLM, InvalidRequestError, SamplingParams, StructuredOutputsParams
from specserve.speculation import grammar as tree_grammar
from specserve.speculation.tree import DraftTree
from specserve.structured import GrammarCompiler, allow_all, apply_bitmask

from conftest import EOS_ID, shuffle_grants
from test_spec_decoding import VOCAB, _spec, chi2_pvalue, exact_distribution, sample_counts

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "bc", "def"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
REGEX = r"(ab|cd)+-[0-9]{2,4}"
CHOICES = ("yes", "no", "maybe later")
GRAMMAR = 'start: "(" item ("," item)* ")"\nitem: /[a-c]{1,3}/'

CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "json-compact": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "grammar": StructuredOutputsParams(grammar=GRAMMAR),
}


def valid(kind: str, text: str) -> bool:
    if kind.startswith("json"):
        try:
            value = json.loads(text)
        except ValueError:
            return False
        if kind == "json_object":
            return isinstance(value, dict)
        try:
            jsonschema.validate(value, SCHEMA)
        except jsonschema.ValidationError:
            return False
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"\([a-c]{1,3}(,[a-c]{1,3})*\)", text) is not None


PROMPTS = ["Fill in the form:", "abc", "Answer yes or no", "(a,b"]


def params(c: StructuredOutputsParams, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 400, "temperature": 0, **kw}, structured_outputs=c)


@pytest.fixture(scope="module")
def plain(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama))


@pytest.fixture(scope="module")
def plain_outputs(plain: LLM) -> dict[str, list[list[int]]]:
    return {k: [o.token_ids for o in plain.generate(PROMPTS, params(c), use_tqdm=False)]
            for k, c in CONSTRAINTS.items()}


def test_plain_constrained_outputs_follow_their_constraint(plain: LLM) -> None:
    """A random model left alone writes bytes at random; constrained, every output is valid
    (greedy, sampled, with penalties), ends with finish_reason stop, and frees its blocks."""
    for kind, c in CONSTRAINTS.items():
        for kw in (dict(temperature=0), dict(temperature=1.0, seed=3), dict(temperature=0.8, top_p=0.9,
                                                                           repetition_penalty=1.3)):
            for o in plain.generate(PROMPTS, params(c, **kw), use_tqdm=False):
                assert o.finish_reason == "stop" and valid(kind, o.text), (kind, kw, o.text)
    assert plain.engine.blocks.num_used_blocks == 0
    unconstrained = plain.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)
    assert not any(valid("regex", o.text) for o in unconstrained)  # the constraint is what makes them valid


SPECS = {
    "ngram": dict(method="ngram", num_tokens=4, controller="fixed"),
    "suffix": dict(method="suffix", num_tokens=6, controller="fixed"),
    "draft-model-self": dict(method="draft-model", num_tokens=4, controller="fixed"),
    "layer-skip": dict(method="layer-skip", num_tokens=3, controller="fixed", draft_layers=1),
    "auto": "auto",
}


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_speculation_with_a_grammar_matches_plain(tiny_llama: Path, plain_outputs, name: str) -> None:
    """Greedy constrained outputs with any drafter, under chunked prefill and grants that change
    every step, are token for token the plain constrained outputs; drafts were verified, some
    forced by the grammar, and no block leaks."""
    spec = SPECS[name]
    if isinstance(spec, dict) and spec["method"] == "draft-model":
        spec = {**spec, "draft_model": str(tiny_llama)}
    llm = LLM(str(tiny_llama), speculative=spec, max_num_batched_tokens=24)
    if name != "auto":
        shuffle_grants(llm, seed=5)
    for kind, c in CONSTRAINTS.items():
        outs = llm.generate(PROMPTS, params(c), use_tqdm=False)
        assert [o.token_ids for o in outs] == plain_outputs[kind], kind
    stats = llm.engine.speculation_stats()
    assert llm.engine.draft_totals.proposed > 0
    assert stats.forced_drafted > 0 and stats.forced_accepted > 0
    assert llm.engine.blocks.num_used_blocks == 0


def test_seeded_sampling_with_a_grammar_is_the_same_with_speculation(tiny_llama: Path, plain: LLM) -> None:
    """A seeded constrained request draws the same tokens with drafts as without."""
    p = params(CONSTRAINTS["json"], temperature=1.0, seed=11)
    expected = [o.token_ids for o in plain.generate(PROMPTS, p, use_tqdm=False)]
    llm = shuffle_grants(LLM(str(tiny_llama), speculative=dict(method="draft-model", num_tokens=4, controller="fixed",
                                                               draft_model=str(tiny_llama))))
    assert [o.token_ids for o in llm.generate(PROMPTS, p, use_tqdm=False)] == expected


def test_preemption_keeps_the_grammar_where_the_output_is(tiny_llama: Path, plain: LLM) -> None:
    """Recompute preemption replays the output's K/V, not its grammar: outputs are unchanged."""
    p = params(CONSTRAINTS["json-compact"], max_tokens=70)
    expected = [o.token_ids for o in plain.generate(PROMPTS, p, use_tqdm=False)]
    llm = LLM(str(tiny_llama), speculative=dict(method="ngram", num_tokens=4, controller="fixed"),
              num_kv_blocks=24, block_size=4)
    assert [o.token_ids for o in llm.generate(PROMPTS, p, use_tqdm=False)] == expected
    assert llm.engine.stats().num_preemptions > 0


# -- the tree through the grammar ---------------------------------------------------------------


@pytest.fixture(scope="module")
def compiler(plain: LLM) -> GrammarCompiler:
    return plain.engine.grammar_compiler


@pytest.fixture(scope="module")
def ids(plain: LLM):
    return plain.engine.tokenize


def test_prune_drops_forbidden_nodes_and_keeps_sampled_ones_as_leaves(compiler: GrammarCompiler, ids) -> None:
    """Deterministic nodes the grammar forbids go with their subtrees; a node drawn from a proposal
    (probs) stays, as a leaf, so rejection sampling still rejects it; the grammar ends where it was."""
    g = compiler.compile(StructuredOutputsParams(regex=REGEX))
    a, b, c, x = ids("a")[0], ids("b")[0], ids("c")[0], ids("x")[0]
    tree = DraftTree((a, x, b, c, a), (-1, -1, 0, 1, 2))  # a-b-a allowed, x-c forbidden at x
    assert tree_grammar.prune(tree, g) == DraftTree((a, b, a), (-1, 0, 1))
    probs = torch.full((5, 258), 1 / 258)
    kept = tree_grammar.prune(DraftTree(tree.tokens, tree.parents, probs), g)
    assert kept.tokens == (a, x, b, a) and kept.parents == (-1, -1, 0, 2) and kept.probs.shape[0] == 4
    assert g.accept(b) is False and g.accept(a) is True  # the walks left the grammar at the start


def test_masks_constrain_every_row_of_the_tree(compiler: GrammarCompiler, ids) -> None:
    """Row 0 allows what the grammar allows at the root; row i + 1 what it allows after node i's
    path (checked against a grammar walked to that point by hand)."""
    g = compiler.compile(StructuredOutputsParams(regex=REGEX))
    tree = DraftTree(tuple(ids("aba")) + tuple(ids("c")), (-1, 0, 1, -1))
    bitmask = tree_grammar.masks(tree, g)
    logits = apply_bitmask(torch.zeros(5, 258), bitmask)
    for row, prefix in enumerate(["", "a", "ab", "aba", "c"]):
        ref = compiler.compile(StructuredOutputsParams(regex=REGEX))
        for t in (ids(prefix) if prefix else []):
            assert ref.accept(t)
        one = allow_all(1, ref.mask_size)
        ref.fill(one, 0)
        expected = torch.isfinite(apply_bitmask(torch.zeros(1, 258), one))[0]
        assert torch.equal(torch.isfinite(logits[row]), expected), prefix
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == sorted(ids("-ac"))  # after "ab"


def test_forced_text_is_drafted_after_the_main_path(compiler: GrammarCompiler, ids, plain: LLM) -> None:
    """Where the grammar forces text (a choice's tail, a JSON key), it is appended to the main path."""
    g = compiler.compile(StructuredOutputsParams(choice=CHOICES))
    tree, count = tree_grammar.extend_forced(DraftTree(tuple(ids("ma")), (-1, 0)), g, budget=20)
    assert count == len("ybe later") and plain.tokenizer.decode(list(tree.tokens)) == "maybe later"
    assert tree.parents == tuple(range(-1, len(tree) - 1))
    short, count = tree_grammar.extend_forced(DraftTree(tuple(ids("ma")), (-1, 0)), g, budget=4)
    assert count == 2 and len(short) == 4


# -- the exact distribution with a grammar on a tiny vocabulary -------------------------------------

# Tokens 2 and 3 of the 4-token models are the bytes "!" and '"'. The grammar: every "!" is followed
# by '"', at least three units long, so within three tokens the end of sequence is never allowed.
TINY_REGEX = '("|!"){3,}'
BANG, QUOTE = 2, 3


def allowed_next(prefix: tuple[int, ...]) -> set[int]:
    return {QUOTE} if prefix and prefix[-1] == BANG else {BANG, QUOTE}


def constrained_exact(target: Path, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """The target's distribution over three tokens, each step masked by hand to `allowed_next`."""
    free = exact_distribution(target, params, n_tokens=3)  # unconstrained P(t1, t2, t3)
    out: dict[tuple[int, ...], float] = {}
    for seq in free:
        p = 1.0
        for i in range(3):
            prefix, t = seq[:i], seq[i]
            cond = {u: sum(v for k, v in free.items() if k[: i + 1] == prefix + (u,)) for u in range(VOCAB)}
            total = sum(cond[u] for u in allowed_next(prefix))
            p *= cond[t] / total if t in allowed_next(prefix) else 0.0
        out[seq] = p
    return out


@pytest.fixture(scope="module")
def tiny_vocab(tiny_model_factory) -> tuple[Path, Path]:
    opts = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, initializer_range=0.15)
    return (tiny_model_factory("v4-target", **opts, seed=3),
            tiny_model_factory("v4-draft", **opts, seed=4, num_hidden_layers=1))


GRAMMAR_SAMPLING = {
    "chain-draft-model": ("draft-model", 3, 1),  # drafts drawn from q: forbidden ones stay as leaves
    "tree-ngram": ("ngram", 4, 3),
}


def constrained_counts(target: Path, spec: dict, n: int) -> tuple[dict, LLM]:
    p = SamplingParams(max_tokens=6, temperature=1.0, structured_outputs=StructuredOutputsParams(regex=TINY_REGEX))
    return sample_counts(target, spec, p, n)


@pytest.mark.parametrize("case", list(GRAMMAR_SAMPLING))
def test_constrained_speculative_sampling_matches_exact_distribution(tiny_vocab, case: str) -> None:
    target, draft = tiny_vocab
    n = 3000
    counts, llm = constrained_counts(target, _spec(*GRAMMAR_SAMPLING[case], draft), n)
    totals = llm.engine.draft_totals
    assert totals.proposed > 0 and 0 < totals.accepted < totals.proposed, "needs both accepts and rejections"
    assert all(t in allowed_next(k[:i]) for k in counts for i, t in enumerate(k))
    exact = constrained_exact(target, SamplingParams(max_tokens=6, temperature=1.0))
    assert chi2_pvalue(counts, exact, n) > 0.001


# -- the verifier alone: a chain drawn from a known proposal, a grammar whose mask depends on the path


TWO_UNITS = '(!"|"[!"]){2,}'  # "!" must be followed by '"'; nothing may end within two tokens
TARGET = torch.log(torch.tensor([[0.2, 0.2, 0.2, 0.4], [0.25, 0.25, 0.4, 0.1], [0.25, 0.25, 0.25, 0.25]]))
PROPOSAL = torch.tensor([[0.3, 0.0, 0.6, 0.1], [0.1, 0.2, 0.5, 0.2]])  # much of it on forbidden tokens


def masked(row: torch.Tensor, allowed: set[int]) -> torch.Tensor:
    mask = torch.full_like(row, float("-inf"))
    mask[list(allowed)] = 0
    return (row + mask).softmax(-1)


def sampled_draft(shape: str, gen: torch.Generator) -> DraftTree:
    """A draft drawn from PROPOSAL: a 2-node chain, or a tree of two root children drawn i.i.d.
    (SpecInfer's multi-sample draft) with one child each."""
    def draw(depth: int) -> int:
        return int(torch.multinomial(PROPOSAL[depth], 1, generator=gen))

    if shape == "chain":
        return DraftTree.chain([draw(0), draw(1)], PROPOSAL.clone())
    a, b = draw(0), draw(0)
    return DraftTree((a, b, draw(1), draw(1)), (-1, -1, 0, 1), PROPOSAL[[0, 0, 1, 1]].clone())


def verifier_counts(tiny_vocab_compiler: GrammarCompiler, n: int, shape: str = "chain",
                    constrained: bool = True) -> dict[tuple[int, int], int]:
    """(y1, y2) over n verifications of a draft drawn from PROPOSAL (`sampled_draft`), under the
    TWO_UNITS grammar or none; where fewer than two tokens come out, y2 is drawn as plain
    (constrained) decoding would draw it."""
    from specserve.engine.sequence import Sequence
    from specserve.speculation.verifier import Verifier

    gen = torch.Generator().manual_seed(0)
    verifier = Verifier(gen)
    constraint = StructuredOutputsParams(regex=TWO_UNITS) if constrained else None
    sp = SamplingParams(temperature=1.0, max_tokens=4, structured_outputs=constraint)
    counts: dict[tuple[int, int], int] = {}
    for _ in range(n):
        g = tiny_vocab_compiler.compile(constraint) if constraint is not None else None
        seq = Sequence("r", [0], sp, 0.0, max_total_len=10, grammar=g)
        tree = sampled_draft(shape, gen)
        if g is not None:
            tree = tree_grammar.prune(tree, g)
        rows = TARGET[[0] + tree.depths()]
        tokens = verifier.verify(seq, tree, rows).tokens
        if len(tokens) < 2:
            allowed = allowed_after(tokens[0], constrained)
            tokens = tokens + [int(torch.multinomial(masked(TARGET[1], allowed), 1, generator=gen))]
        key = (tokens[0], tokens[1])
        counts[key] = counts.get(key, 0) + 1
    return counts


def allowed_after(y1: int | None, constrained: bool) -> set[int]:
    if not constrained:
        return set(range(VOCAB))
    if y1 is None:
        return {BANG, QUOTE}
    return {QUOTE} if y1 == BANG else {BANG, QUOTE}


@pytest.fixture(scope="module")
def tiny_vocab_compiler(plain: LLM) -> GrammarCompiler:
    """The byte tokenizer's grammar compiler for a model with four logits (tokens 0-3)."""
    return GrammarCompiler(plain.engine.grammar_compiler.tokenizer, vocab_size=VOCAB)


def verifier_exact(constrained: bool = True) -> dict[tuple[int, int], float]:
    p1 = masked(TARGET[0], allowed_after(None, constrained))
    out = {}
    for y1 in range(VOCAB):
        p2 = masked(TARGET[1], allowed_after(y1, constrained))
        for y2 in range(VOCAB):
            out[(y1, y2)] = float(p1[y1] * p2[y2])
    return out


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("constrained", [True, False], ids=["grammar", "free"])
def test_verifier_samples_the_target_exactly_from_sampled_drafts(tiny_vocab_compiler, shape: str,
                                                                 constrained: bool) -> None:
    """Recursive rejection sampling of a chain or a multi-sample tree drawn from PROPOSAL, against
    the (grammar-masked) target, draws exactly from it, though much of the proposal's mass is on
    forbidden tokens. Dropping a forbidden sampled node instead of rejecting it moves P(y1 = "!")
    from 1/3 to about 0.43; masking only the root lets "!!" through (tests/test_lossless_mutations.py
    breaks these rules on purpose)."""
    n = 6000
    counts = verifier_counts(tiny_vocab_compiler, n, shape, constrained)
    assert chi2_pvalue(counts, verifier_exact(constrained), n) > 0.001


# -- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, field", [
    (dict(), "structured_outputs"),
    (dict(regex="a", choice=["a"]), "structured_outputs"),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(json="[1, 2]"), "structured_outputs.json"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(choice=["a", ""]), "structured_outputs.choice"),
    (dict(regex=""), "structured_outputs.regex"),
    (dict(json_object=True, regex="x", field="response_format"), "response_format"),
])
def test_malformed_constraints_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        StructuredOutputsParams(**kwargs)
    assert e.value.field == field


@pytest.mark.parametrize("constraint, field", [
    (StructuredOutputsParams(regex="(ab"), "structured_outputs.regex"),
    (StructuredOutputsParams(json={"type": "nonsense"}), "structured_outputs.json"),
    (StructuredOutputsParams(json={"type": "nonsense"}, field="response_format.json_schema.schema"),
     "response_format.json_schema.schema"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), "structured_outputs.grammar"),
    (StructuredOutputsParams(grammar="root ::= [a-"), "structured_outputs.grammar"),
])
def test_uncompilable_constraints_fail_before_queueing(plain: LLM, constraint, field: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        plain.engine.add_request("abc", SamplingParams(structured_outputs=constraint))
    assert e.value.field == field and e.value.message
    assert not plain.engine.has_unfinished_requests()


def test_a_complete_grammar_ends_the_request_even_with_ignore_eos(tiny_llama: Path, plain: LLM) -> None:
    """With ignore_eos, a constrained request still ends when its grammar is complete."""
    o = plain.generate("x", params(CONSTRAINTS["choice"], ignore_eos=True, max_tokens=50), use_tqdm=False)[0]
    assert o.text in CHOICES and o.finish_reason == "stop" and EOS_ID not in o.token_ids


# -- the bundled model ---------------------------------------------------------------------------


@pytest.mark.slow
def test_bundled_model_structured_outputs_are_valid_and_lossless(bundled_model_dir: Path) -> None:
    """SmolLM2 answering chat prompts under JSON schemas, a regex and a choice: every answer is
    valid, and with `--spec suffix` and `--spec auto` token for token the answer without speculation
    (benchmarks/structured_outputs.py runs thirty such requests)."""
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}, "hobbies": {
                                                   "type": "array", "items": {"type": "string", "maxLength": 20},
                                                   "maxItems": 3}},
              "required": ["name", "age", "hobbies"], "additionalProperties": False}
    asks = [
        ("Describe a fictional person as JSON.", StructuredOutputsParams(json=person), "json"),
        ("Give any JSON object about a cat.", StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
         "json_object"),
        ("Write a date in 2026.", StructuredOutputsParams(regex=r"2026-[01][0-9]-[0-3][0-9]"), "date"),
        ("Is the sky blue? Answer yes or no.", StructuredOutputsParams(choice=("yes", "no")), "choice"),
    ]
    convs = [[{"role": "user", "content": q}] for q, _, _ in asks]
    ps = [SamplingParams(max_tokens=160, temperature=0, structured_outputs=c) for _, c, _ in asks]
    outputs = {}
    for spec in ("none", "suffix", "auto"):
        llm = LLM(str(bundled_model_dir), speculative=spec)
        outputs[spec] = llm.chat(convs, ps, use_tqdm=False)
    for i in (0, 2, 3):  # bounded by their constraints (an object of any JSON may ramble to max_tokens)
        assert outputs["none"][i].finish_reason == "stop"
    jsonschema.validate(json.loads(outputs["none"][0].text), person)
    if outputs["none"][1].finish_reason == "stop":
        assert isinstance(json.loads(outputs["none"][1].text), dict)
    assert re.fullmatch(r"2026-[01][0-9]-[0-3][0-9]", outputs["none"][2].text)
    assert outputs["none"][3].text in ("yes", "no")
    for spec in ("suffix", "auto"):
        assert [o.token_ids for o in outputs[spec]] == [o.token_ids for o in outputs["none"]], spec
