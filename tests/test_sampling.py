"""Sampling: filters mask exactly what they define, penalties change logits as defined, draws follow
the processed distribution, seeds reproduce, logprobs are the model's."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specserve.model import cpu_ops, ops
from specserve.speculation.verifier import Verdict
from specserve.speculation.sampler import (Sampler, apply_filters, apply_penalties, chunked_topk_ids, row_argmax,
                                          row_topk_ids)
from specserve.engine.sequence import Sequence
from specserve.sampling_params import SamplingParams


def make_seq(params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None) -> Sequence:
    s = Sequence("r", prompt or [0], params, 0.0, max_total_len=100)
    s.output_token_ids = list(output or [])
    return s


LOGITS = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]]))


def kept(params: SamplingParams) -> list[int]:
    out = apply_filters(LOGITS.clone(), [params])
    return torch.nonzero(torch.isfinite(out[0])).flatten().tolist()


def test_top_k_keeps_k_most_likely() -> None:
    assert kept(SamplingParams(top_k=2)) == [0, 1]
    assert kept(SamplingParams(top_k=0)) == [0, 1, 2, 3, 4]


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    assert kept(SamplingParams(top_p=0.69)) == [0, 1]  # 0.4 + 0.3 reaches 0.69
    assert kept(SamplingParams(top_p=0.71)) == [0, 1, 2]
    assert kept(SamplingParams(top_p=0.1)) == [0]  # the top token always stays


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    assert kept(SamplingParams(min_p=0.5)) == [0, 1]  # threshold 0.2
    assert kept(SamplingParams(min_p=0.24)) == [0, 1, 2, 3]  # threshold 0.096


def test_filters_apply_per_row() -> None:
    logits = LOGITS.repeat(3, 1)
    out = apply_filters(logits, [SamplingParams(top_k=1), SamplingParams(), SamplingParams(top_p=0.69)])
    assert torch.isfinite(out).sum(dim=1).tolist() == [1, 5, 2]


def test_penalties_follow_definitions() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    # token 0 appears twice in the output, token 1 once in the prompt.
    rep = apply_penalties(logits.clone(), [[1]], [[0, 0]], [SamplingParams(repetition_penalty=2.0)])
    assert rep.tolist() == [[1.0, -4.0, 1.0, 0.5]]  # positive logits divided, negative multiplied
    freq = apply_penalties(logits.clone(), [[1]], [[0, 0]], [SamplingParams(frequency_penalty=0.5)])
    assert freq.tolist() == [[1.0, -2.0, 1.0, 0.5]]  # 2.0 - 0.5 * count 2; the prompt doesn't count
    pres = apply_penalties(logits.clone(), [[1]], [[0, 0]], [SamplingParams(presence_penalty=0.5)])
    assert pres.tolist() == [[1.5, -2.0, 1.0, 0.5]]


def test_greedy_is_argmax_and_penalty_changes_it() -> None:
    sampler = Sampler(torch.device("cpu"))
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    assert sampler(logits, [make_seq(SamplingParams(temperature=0))]).token_ids == [0]
    penalized = make_seq(SamplingParams(temperature=0, repetition_penalty=1.5), output=[0])
    assert sampler(logits, [penalized]).token_ids == [1]


def test_logit_bias_is_added_before_penalties_and_temperature() -> None:
    """The bias moves greedy picks (-100 bans the argmax, +100 forces a token) and sampled draws
    follow softmax((logits + bias) / T)."""
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    assert sampler(logits, [make_seq(SamplingParams(temperature=0, logit_bias={0: -100}))]).token_ids == [1]
    assert sampler(logits, [make_seq(SamplingParams(temperature=0, logit_bias={2: 100.0}))]).token_ids == [2]
    rows = [SamplingParams(temperature=0.5, logit_bias={0: 1.0, 2: -0.5}), SamplingParams(temperature=0.5)]
    out = Sampler.processed_logits(logits.repeat(2, 1), rows, [[0], [0]], [[], []])
    assert torch.allclose(out[0], (logits[0] + torch.tensor([1.0, 0.0, -0.5]) - 4.0) / 0.5)
    assert torch.allclose(out[1], (logits[0] - 3.0) / 0.5)  # the other row unbiased
    n = 20000
    seqs = [make_seq(SamplingParams(temperature=1.0, logit_bias={1: 2.0})) for _ in range(n)]
    tokens = sampler(logits.repeat(n, 1), seqs).token_ids
    expected = (logits[0] + torch.tensor([0.0, 2.0, 0.0])).double().softmax(-1) * n
    assert chisquare([tokens.count(t) for t in range(3)], expected.tolist()).pvalue > 0.001


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5), SamplingParams(temperature=1.0, top_p=0.8),
     SamplingParams(temperature=1.0, top_k=3)],
    ids=["t1", "t0.5", "top_p", "top_k"],
)
def test_draws_follow_the_processed_distribution(params: SamplingParams) -> None:
    n = 20000
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = LOGITS.repeat(n, 1)
    seqs = [make_seq(params) for _ in range(n)]
    tokens = torch.tensor(sampler(logits, seqs).token_ids)
    expected = apply_filters(LOGITS / params.temperature, [params]).softmax(-1)[0]
    support = expected > 0
    counts = torch.bincount(tokens, minlength=5).double()
    assert counts[~support].sum() == 0, "drew a token the filters removed"
    exp = expected[support].double()
    stat = chisquare(counts[support].numpy(), (exp / exp.sum() * counts.sum()).numpy())
    assert stat.pvalue > 0.001, stat


def test_seeded_rows_reproduce_in_any_position() -> None:
    params = SamplingParams(temperature=1.0, seed=7)
    logits = torch.randn(1, 50).repeat(4, 1)
    draws_a, draws_b = [], []
    a = [make_seq(params)]
    b = [make_seq(SamplingParams(temperature=1.0)) for _ in range(3)] + [make_seq(params)]
    for _ in range(10):
        draws_a.append(Sampler(torch.device("cpu"), seed=1)(logits[:1], a).token_ids[0])
        draws_b.append(Sampler(torch.device("cpu"), seed=2)(logits, b).token_ids[3])
        a[0].output_token_ids.append(draws_a[-1])
        b[3].output_token_ids.append(draws_b[-1])
    assert draws_a == draws_b
    assert len(set(draws_a)) > 1  # each output position draws afresh


def test_logprobs_are_raw_model_logprobs() -> None:
    sampler = Sampler(torch.device("cpu"))
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    out = sampler(logits, [make_seq(SamplingParams(temperature=0, logprobs=2, repetition_penalty=1.3))])
    lp = out.logprobs[0]
    ref = torch.log_softmax(logits, -1)[0]
    assert lp is not None and lp.token_id == 1
    assert math.isclose(lp.logprob, ref[1].item(), rel_tol=1e-6)
    assert [t for t, _ in lp.top] == [1, 2]
    assert [v for _, v in lp.top] == pytest.approx([ref[1].item(), ref[2].item()])


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(frequency_penalty=3.0), "frequency_penalty"),
        (dict(presence_penalty=-2.5), "presence_penalty"),
        (dict(logprobs=21), "logprobs"),
        (dict(stop=[""]), "stop"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={"5": 1.0}), "logit_bias"),
        (dict(logit_bias={5: 101}), "logit_bias"),
        (dict(logit_bias={5: float("nan")}), "logit_bias"),
        (dict(logit_bias=[1, 2]), "logit_bias"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    from specserve.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}:")


def test_row_argmax_is_torch_argmax_ties_and_nan_included() -> None:
    """Greedy choices and exponential races all go through row_argmax (numpy's on the CPU): the
    first of tied maxima, a NaN counted as the largest, exactly as torch.argmax picks."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 49152, generator=g)
    x[1, [7, 900, 40000]] = 9.0  # ties: the first wins
    x[2] = float("-inf")  # a row masked whole
    x[3, 5] = float("nan")
    x[4] = torch.round(x[4])  # many ties at the top
    x[5, -1] = float("inf")
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    assert torch.equal(row_argmax(x[:, ::2]), x[:, ::2].argmax(dim=-1))  # a strided view


@pytest.mark.parametrize("vocab", [49152, 151936, 258])
def test_row_topk_ids_are_topks(vocab: int) -> None:
    """Both top-k searches recycling learns from (the native pass and the two-stage one in torch
    operators) give torch.topk's indices, largest first, also when the largest values crowd into
    one chunk or a row is mostly masked."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, vocab, generator=g)
    x[1, 128:136] += 50.0  # all of the top 8 in one chunk of 64
    x[2, : vocab - 20] = float("-inf")  # only 20 tokens allowed
    x[3, ::64] += 10.0  # the top 8 in 8 different chunks, among many chunk maxima close to them
    for k in (1, 8):
        assert torch.equal(row_topk_ids(x, k), x.topk(k, dim=-1).indices)
        assert torch.equal(chunked_topk_ids(x, k), x.topk(k, dim=-1).indices)


@pytest.mark.parametrize("isa", ops.ISAS)
def test_the_native_row_topk_is_topk_in_every_variant(isa: str) -> None:
    """The native top-k of every kernel variant this CPU runs: torch.topk's indices for distinct
    values (every k up to the limit, rows of any length, the vector loops' tails, rows strided in a
    wider tensor, mostly masked rows); among equal values the lower index first; NaN below every
    number; a k out of range refused by name."""
    if isa not in ops.runnable_isas():
        pytest.skip(f"this CPU does not run {isa}")
    i = ops.isa_id(isa)
    g = torch.Generator().manual_seed(7)
    for n in (1, 7, 16, 17, 100, 49152):
        x = torch.randn(3, n, generator=g)
        for k in sorted({1, min(n, 2), min(n, 8), min(n, 33), min(n, cpu_ops.ROW_TOPK_MAX)}):
            assert torch.equal(torch.ops.specserve.row_topk(x, k, i), x.topk(k, dim=-1).indices), (n, k)
    wide = torch.randn(4, 1000, generator=g)
    view = wide[:, 3:903]  # rows 1000 floats apart
    assert torch.equal(torch.ops.specserve.row_topk(view, 5, i), view.topk(5, dim=-1).indices)
    masked = torch.full((2, 300), float("-inf"))
    masked[0, 250] = 1.0
    assert torch.ops.specserve.row_topk(masked, 3, i)[0, 0].item() == 250
    ties = torch.zeros(1, 64)
    ties[0, [5, 40, 41]] = 2.0
    assert torch.ops.specserve.row_topk(ties, 5, i).tolist() == [[5, 40, 41, 0, 1]]
    nan = torch.arange(40, dtype=torch.float32)[None].clone()
    nan[0, [0, 39, 20]] = float("nan")
    assert torch.ops.specserve.row_topk(nan, 3, i).tolist() == [[38, 37, 36]]
    with pytest.raises(RuntimeError, match="row_topk: k must be"):
        torch.ops.specserve.row_topk(x, 0, i)
    with pytest.raises(RuntimeError, match="row_topk: k must be"):
        torch.ops.specserve.row_topk(torch.randn(2, 4), 5, i)


@pytest.mark.parametrize("isa", ops.ISAS)
def test_the_native_row_argmax_is_numpys_in_every_variant(isa: str) -> None:
    """The native argmax of every kernel variant this CPU runs (its columns split among the threads
    from 4096 on): numpy's index for every row (the vector loops' tails, ties within and across the
    split, a NaN in either part, rows masked whole, rows strided in a wider tensor), and beside it
    whether the value there is finite."""
    if isa not in ops.runnable_isas():
        pytest.skip(f"this CPU does not run {isa}")
    i = ops.isa_id(isa)
    g = torch.Generator().manual_seed(3)
    for n in (1, 7, 16, 17, 100, 4095, 4096, 49152):
        x = torch.randn(7, n, generator=g)
        x[1] = torch.round(x[1])  # ties at the top
        x[2, [0, n - 1]] = 50.0  # the same maximum at both ends: the first
        x[3] = float("-inf")
        x[4, n // 2] = float("nan")
        x[4, 0] = float("inf")  # a NaN beats everything, also an earlier +inf
        x[5, n - 1] = float("nan")
        x[6, n // 3] = float("inf")
        out = torch.ops.specserve.row_argmax(x, i)
        want = np.argmax(x.numpy(), axis=-1)
        assert out[0].tolist() == want.tolist(), n
        assert out[1].tolist() == [int(np.isfinite(x[r, want[r]].item())) for r in range(7)], n
    wide = torch.randn(3, 9000, generator=g)
    view = wide[:, 5:8805]  # rows 9000 floats apart
    assert torch.ops.specserve.row_argmax(view, i)[0].tolist() == np.argmax(view.numpy(), axis=-1).tolist()
    assert torch.ops.specserve.row_argmax(torch.randn(0, 10), i).shape == (2, 0)


def test_greedy_choice_is_row_argmax_and_row_errors_in_one_pass() -> None:
    """The one-pass greedy pick (the sampler's and the verifier's for greedy rows) gives every row
    the token `row_argmax` gives (the first of tied maxima; the first NaN) and the error `row_errors`
    gives: NaN, +inf or an all -inf row breaks it, -inf entries beside finite ones do not."""
    from specserve.speculation.sampler import greedy_choice, row_argmax, row_errors

    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 50, generator=g)
    x[1, 7] = float("nan")
    x[2, 3] = float("inf")
    x[3] = float("-inf")
    x[4, :10] = float("-inf")
    x[5, 4] = x[5, 9] = x[5].max() + 1.0  # a tie: the first wins
    x[6, 2] = float("nan")
    x[6, 5] = float("inf")
    x[7, [3, 8]] = float("nan")  # the first NaN
    params = [SamplingParams(temperature=0)] * 9
    for t in (x, x.double()):
        tokens, errors = greedy_choice(t, params)
        assert tokens == row_argmax(t).tolist()
        assert errors == row_errors(t, params)
        assert [e is not None for e in errors] == [False, True, True, True, False, False, True, True, False]
        assert tokens[5] == 4 and tokens[7] == 3


def test_one_argmax_pass_over_a_step_gives_every_request_its_row_by_row_verdict() -> None:
    """Speculator._argmax_verdicts (greedy requests with nothing that changes their logits: one
    argmax over all the step's rows) equals sampling each plain row and verifying each tree apart,
    with ties, a row of NaN (that request alone fails) and trees with siblings; a request that asks
    for logprobs sends the whole step the row-by-row way."""
    from specserve.speculation.speculator import SampleItem, Speculator
    from specserve.speculation.tree import DraftTree
    from specserve.speculation.verifier import Verifier

    g = torch.Generator().manual_seed(0)
    vocab = 40
    trees = {0: None, 1: DraftTree.chain([3, 5, 7]), 2: DraftTree((3, 4, 5, 6), (-1, -1, 0, 1)), 3: None,
             4: DraftTree.chain([1]), 5: DraftTree((2, 3, 2), (-1, 0, 0))}
    items, drafts, start = [], {}, 0
    for i, tree in trees.items():
        count = 1 + (len(tree) if tree is not None else 0)
        items.append(SampleItem(i, make_seq(SamplingParams(temperature=0), output=[i]), (start, count)))
        start += count
        if tree is not None:
            drafts[i] = tree
    for trial in range(30):
        # few distinct values: ties; the trees' tokens often the argmax: accepted runs
        logits = torch.randint(0, 4, (start, vocab), generator=g).float()
        for it in items:
            if it.index in drafts and trial % 2:
                tree, (first, _) = drafts[it.index], it.rows
                for n, (tok, parent) in enumerate(zip(tree.tokens, tree.parents)):
                    logits[first + 1 + parent, tok] = 9.0
        if trial % 3 == 0:  # a NaN in any row, a tree's own rows too: that request fails (not reached or not)
            logits[trial % start, 5] = float("nan")
        fast = Speculator._argmax_verdicts(items, drafts, logits)
        assert set(fast) == set(trees)
        for it in items:
            first, count = it.rows
            if it.index in drafts:
                slow = Verifier(torch.Generator()).verify(it.row, drafts[it.index], logits[first : first + count])
            else:
                out = Sampler(torch.device("cpu"))(logits[first : first + 1], [it.row])
                slow = Verdict([], out.token_ids, out.logprobs, out.errors[0]) if out.errors[0] is None else \
                    Verdict([], [], [], out.errors[0])
            assert fast[it.index] == slow, (trial, it.index)
    asks = SampleItem(6, make_seq(SamplingParams(temperature=0, logprobs=1)), (start, 1))
    assert Speculator._argmax_verdicts([*items, asks], drafts, torch.zeros(start + 1, vocab)) == {}
