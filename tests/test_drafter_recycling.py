"""Token Recycling drafter: the successor table is filled from the target's top-k and read back as
valid, budget-respecting trees shaped by the widths template. No models: pure table logic."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from specserve.sampling_params import SamplingParams
from specserve.speculation.drafter import DraftRequest, RequestView
from specserve.speculation.drafters.recycling import EMPTY, RecyclingDrafter
from specserve.speculation.tree import EMPTY_TREE, DraftTree

V = 100


def view(prompt: list[int], output: list[int] | None = None, rid: str = "r") -> RequestView:
    return RequestView(rid, tuple(prompt), tuple(output or ()), SamplingParams())


def propose(d: RecyclingDrafter, v: RequestView, budget: int) -> DraftTree:
    (tree,) = d.propose([DraftRequest(v, budget)])
    return tree


def teach(d: RecyclingDrafter, token: int, successors: list[int]) -> None:
    """Make the table hold `successors` (padded with other ids) for `token`, via observe()."""
    row = list(successors) + [t for t in range(V - 1, -1, -1) if t not in successors]
    d.observe(view([token]), EMPTY_TREE, torch.tensor([row[: d.topk]]))


def assert_valid(tree: DraftTree, budget: int) -> None:
    DraftTree(tree.tokens, tree.parents, tree.probs)  # re-runs DraftTree validation
    assert len(tree) <= budget
    assert tree.probs is None  # deterministic drafter
    for i, p in enumerate(tree.parents):
        assert -1 <= p < i
    for node in [-1, *range(len(tree))]:
        kids = [tree.tokens[c] for c in tree.children(node)]
        assert len(kids) == len(set(kids)), f"duplicate siblings under {node}: {kids}"


def full_table(d: RecyclingDrafter, seed: int = 0) -> None:
    """Every token gets k distinct random successors (some lists repeat tokens across rows)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.stack([torch.randperm(V, generator=g)[: d.topk] for _ in range(V)])
    for t in range(V):
        d.observe(view([t]), EMPTY_TREE, rows[t : t + 1])


# ---------------------------------------------------------------- construction


def test_constructor_rejects_bad_args_naming_the_field() -> None:
    """Protects: misconfiguration fails loudly at construction, saying which argument is wrong."""
    for kwargs, field in [
        (dict(vocab_size=0), "vocab_size"),
        (dict(vocab_size=True), "vocab_size"),
        (dict(vocab_size=10, topk=0), "topk"),
        (dict(vocab_size=10, topk=11), "topk"),
        (dict(vocab_size=10, topk=4, widths=()), "widths"),
        (dict(vocab_size=10, topk=4, widths=(5,)), "widths"),
        (dict(vocab_size=10, topk=4, widths=(2, 0)), "widths"),
        (dict(vocab_size=10, topk=4, widths=3), "widths"),
        (dict(vocab_size=10, expand="dfs"), "expand"),
        (dict(vocab_size=10, seed_from_prompt="yes"), "seed_from_prompt"),
    ]:
        with pytest.raises(ValueError, match=field):
            RecyclingDrafter(**kwargs)


def test_target_topk_asks_engine_for_k_ids_and_table_is_bounded() -> None:
    """Protects: the engine passes k ids per node, and the table is a fixed [vocab, k] int32 of -1s."""
    d = RecyclingDrafter(V, topk=5, widths=(3, 1))
    assert d.target_topk == 5
    assert d.succ.shape == (V, 5) and d.succ.dtype == np.int32
    assert (d.succ == EMPTY).all()
    assert RecyclingDrafter(V).widths == (4, 2, 2, 1, 1, 1)
    assert RecyclingDrafter(V, topk=2).widths == (2, 2, 2, 1, 1, 1)  # default template capped at k


# ---------------------------------------------------------------- propose / observe


def test_empty_table_gives_empty_tree() -> None:
    """Protects: nothing is proposed for a token never observed (no prompt fallback)."""
    d = RecyclingDrafter(V, seed_from_prompt=False)
    assert propose(d, view([1, 2, 3, 1, 2]), 8) == EMPTY_TREE
    d = RecyclingDrafter(V)  # with the fallback, but no bigram for the last token either
    assert propose(d, view([1, 2, 3]), 8) == EMPTY_TREE


def test_budget_zero_gives_empty_tree() -> None:
    """Protects: budget 0 means propose nothing, even with a full table."""
    d = RecyclingDrafter(V)
    full_table(d)
    assert propose(d, view([5]), 0) == EMPTY_TREE


def test_observed_top_tokens_are_proposed_in_order() -> None:
    """Protects: after observe(), the next propose from the same last token offers the target's top
    tokens as the root's children, in the target's order (newest observation replaces the old)."""
    d = RecyclingDrafter(V, topk=4, widths=(4,))
    d.observe(view([9], [7]), EMPTY_TREE, torch.tensor([[11, 12, 13, 14]]))
    tree = propose(d, view([1, 2], [7], rid="other"), 4)  # the table is shared across requests
    assert tree.tokens == (11, 12, 13, 14) and tree.parents == (-1, -1, -1, -1)
    d.observe(view([7]), EMPTY_TREE, torch.tensor([[20, 11, 21, 22]]))
    assert propose(d, view([7]), 4).tokens == (20, 11, 21, 22)


def test_observe_rows_for_tree_nodes_update_their_tokens() -> None:
    """Protects: row i+1 of target_top_ids becomes the successors of tree.tokens[i]; row 0 the root's."""
    d = RecyclingDrafter(V, topk=3)
    tree = DraftTree((10, 20, 30), (-1, 0, -1))
    ids = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [40, 41, 42]])
    d.observe(view([0, 5]), tree, ids)
    assert d.successors(5) == [1, 2, 3]
    assert d.successors(10) == [4, 5, 6]
    assert d.successors(20) == [7, 8, 9]
    assert d.successors(30) == [40, 41, 42]
    assert d.successors(0) == []  # untouched
    # A chain follows the stored rows: 5 -> 1 -> (nothing stored for 1).
    d2 = RecyclingDrafter(V, topk=3, widths=(1, 1, 1))
    d2.observe(view([5]), tree, ids)
    d2.observe(view([1]), EMPTY_TREE, torch.tensor([[10, 0, 0]]))
    assert propose(d2, view([5]), 3).tokens == (1, 10, 4)


def test_repeated_token_in_one_observe_keeps_the_root_row() -> None:
    """Protects: when the root token also appears as a node, the real-context (root) row wins."""
    d = RecyclingDrafter(V, topk=2)
    d.observe(view([5]), DraftTree((5, 5), (-1, 0)), torch.tensor([[1, 2], [3, 4], [6, 7]]))
    assert d.successors(5) == [1, 2]


def test_tree_follows_widths_template_when_budget_allows() -> None:
    """Protects: with a large budget and a full table, the tree is exactly the static template:
    depth d nodes have widths[d] children, depth is len(widths), children are the table's top ones."""
    widths = (4, 2, 2, 1)
    for expand in ("best_first", "bfs"):
        d = RecyclingDrafter(V, topk=6, widths=widths, expand=expand)
        full_table(d)
        tree = propose(d, view([3, 8]), 1000)
        assert_valid(tree, 1000)
        assert len(tree) == 4 + 4 * 2 + 8 * 2 + 16 * 1
        depths = tree.depths()
        assert max(depths) == len(widths)
        for node in [-1, *range(len(tree))]:
            kids = tree.children(node)
            depth = 0 if node < 0 else depths[node]
            expect = widths[depth] if depth < len(widths) else 0
            assert len(kids) == expect
            parent_tok = 8 if node < 0 else tree.tokens[node]
            assert [tree.tokens[c] for c in kids] == d.successors(parent_tok)[:expect]


@pytest.mark.parametrize("expand", ["best_first", "bfs"])
@pytest.mark.parametrize("budget", [1, 2, 3, 5, 8, 13, 32])
def test_budget_and_validity_with_duplicates_in_table(expand: str, budget: int) -> None:
    """Protects: trees never exceed the budget, stay within widths caps, list parents first and
    have no duplicate sibling tokens even when the table rows contain repeats."""
    d = RecyclingDrafter(V, topk=4, widths=(4, 2, 2, 1, 1, 1), expand=expand)
    full_table(d, seed=1)
    d.observe(view([8]), EMPTY_TREE, torch.tensor([[3, 3, 5, 3]]))  # repeats: dedup'd on read
    tree = propose(d, view([8]), budget)
    assert_valid(tree, budget)
    assert len(tree) == min(budget, 2 + 2 * 2 + 4 * 2 + 8 + 8 + 8)  # root has only 2 distinct
    assert [tree.tokens[c] for c in tree.children(-1)] == [3, 5][: len(tree.children(-1))]
    depths = tree.depths()
    assert max(depths) <= 6
    for i in range(len(tree)):
        cap = d.widths[depths[i]] if depths[i] < len(d.widths) else 0
        assert len(tree.children(i)) <= cap


def test_small_budget_shapes() -> None:
    """Protects: bfs fills level by level; best_first mixes top root candidates with a top-1 chain,
    and the first nodes of a bigger tree are the smaller tree (prefix-stable as budget grows)."""
    widths = (4, 2, 2, 1, 1, 1)
    bfs = RecyclingDrafter(V, topk=4, widths=widths, expand="bfs")
    full_table(bfs)
    t = propose(bfs, view([8]), 4)
    assert t.parents == (-1, -1, -1, -1)
    best = RecyclingDrafter(V, topk=4, widths=widths)
    full_table(best)
    t4 = propose(best, view([8]), 4)
    assert max(t4.depths()) >= 2 and len(t4.children(-1)) >= 2  # deep and wide with only 4 nodes
    assert t4.tokens[0] == best.successors(8)[0]
    t16 = propose(best, view([8]), 16)
    assert t16.tokens[:4] == t4.tokens and t16.parents[:4] == t4.parents
    # The top-1 chain is reached before low-ranked root siblings.
    assert max(propose(best, view([8]), 8).depths()) >= 3


def test_prompt_bigram_fallback_for_unobserved_tokens() -> None:
    """Protects: the warm start proposes the token that most recently followed the last token in the
    request's own tokens, only for tokens with no table entry, and its state is dropped in finish()."""
    d = RecyclingDrafter(V, topk=2, widths=(2, 1, 1))
    v = view([4, 5, 6, 4, 7, 9], [2, 4])
    tree = propose(d, v, 8)
    # 4 was last followed by 7, then 7 -> 9, then 9 -> 2 (from the output).
    assert tree.tokens == (7, 9, 2) and tree.parents == (-1, 0, 1)
    # Incremental: new output tokens update the index.
    tree = propose(d, view([4, 5, 6, 4, 7, 9], [2, 4, 8, 4]), 8)
    assert tree.tokens[0] == 8
    # An observed token uses the table instead of the bigram.
    d.observe(view([4]), EMPTY_TREE, torch.tensor([[30, 31]]))
    assert propose(d, view([4, 5, 6, 4, 7, 9], [2, 4, 8, 4]), 2).tokens == (30, 31)
    d.finish("r", v)
    assert d._bigrams == {}
    # Tokens that are not an extension of what was indexed (shorter, or a different token at the
    # last indexed position: the cheap check; the engine only appends) are re-indexed from scratch.
    d2 = RecyclingDrafter(V, topk=2, widths=(1,))
    assert propose(d2, view([1, 2, 1]), 1).tokens == (2,)
    assert propose(d2, view([3, 1, 3, 1]), 1).tokens == (3,)
    assert propose(d2, view([1, 4]), 1) == EMPTY_TREE
    assert propose(d2, view([1, 4, 1]), 1).tokens == (4,)
    assert RecyclingDrafter(V, seed_from_prompt=False).propose([DraftRequest(v, 8)]) == [EMPTY_TREE]


def test_out_of_range_ids_are_ignored_safely() -> None:
    """Protects: bad ids from the engine or a view never corrupt the table or crash propose:
    out-of-range rows/tokens are skipped, out-of-range candidates dropped, the table stays [V, k]."""
    d = RecyclingDrafter(V, topk=3)
    tree = DraftTree((V + 5, 7), (-1, 0))
    d.observe(view([-3]), tree, torch.tensor([[1, 2, 3], [4, 5, 6], [V, -1, 9]]))
    assert d.successors(7) == [9] and d.succ[7].tolist() == [9, EMPTY, EMPTY]
    assert (np.delete(d.succ, 7, axis=0) == EMPTY).all()
    assert d.succ.shape == (V, 3)
    assert propose(d, view([V + 1]), 4) == EMPTY_TREE
    assert propose(d, view([-1]), 4) == EMPTY_TREE
    # Fewer columns than k are padded; more are cut to k.
    d.observe(view([1]), EMPTY_TREE, torch.tensor([[2]]))
    assert d.succ[1].tolist() == [2, EMPTY, EMPTY]
    d.observe(view([1]), EMPTY_TREE, torch.tensor([[4, 5, 6, 7, 8]]))
    assert d.succ[1].tolist() == [4, 5, 6]
    d.observe(view([1]), EMPTY_TREE, None)  # target_topk unused by the engine: no-op
    with pytest.raises(ValueError, match="target_top_ids"):
        d.observe(view([1]), DraftTree((2,), (-1,)), torch.tensor([[4, 5, 6]]))


@pytest.mark.parametrize("seed", range(6))
def test_observing_a_steps_requests_at_once_writes_the_table_one_by_one_would(seed: int) -> None:
    """`observe_many` is one write for a step's rows: the table must be the one `observe` in
    order leaves, with tokens repeated within an observation (the root's row, then the earliest
    node's wins) and across observations (the later one's wins), rows with ids out of range, and
    observations with no rows."""
    rng = np.random.default_rng(seed)
    V, k = 40, 4
    batched, single = RecyclingDrafter(vocab_size=V, topk=k), RecyclingDrafter(vocab_size=V, topk=k)
    for _ in range(30):
        observations = []
        for r in range(int(rng.integers(1, 6))):
            root = int(rng.integers(-2, V))  # now and then out of range
            n = int(rng.integers(0, 4))
            tree = DraftTree(tuple(int(t) for t in rng.integers(0, 12, n)), tuple(range(-1, n - 1))) if n else EMPTY_TREE
            top = torch.from_numpy(rng.integers(0, V, (n + 1, k)))
            if rng.random() < 0.05:
                top[0, 0] = V + 3  # an id out of range: dropped from its row
            observations.append((view([root], [root] if rng.random() < 0.5 else []), tree,
                                 None if rng.random() < 0.1 else top))
        batched.observe_many(observations)
        for obs in observations:
            single.observe(*obs)
        assert np.array_equal(batched.succ, single.succ)
