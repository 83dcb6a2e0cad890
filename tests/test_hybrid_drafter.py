"""Merging drafters' trees: earlier trees win the budget, shared prefixes are stored once, the
result is a valid tree, and trees with proposal probabilities are never mixed."""

from __future__ import annotations

import torch

from specserve.speculation.drafters.hybrid import merge_trees
from specserve.speculation.tree import DraftTree


def paths(tree: DraftTree) -> set[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    for tok, p in zip(tree.tokens, tree.parents):
        out.append((out[p] if p >= 0 else ()) + (tok,))
    return set(out)


def test_shared_prefixes_are_stored_once() -> None:
    a = DraftTree.chain([5, 6, 7])
    b = DraftTree.chain([5, 6, 9])
    merged = merge_trees([a, b], budget=10)
    assert len(merged) == 4
    assert paths(merged) == paths(a) | paths(b)


def test_earlier_trees_take_the_budget_first() -> None:
    a = DraftTree.chain([1, 2, 3])
    b = DraftTree((8, 9, 4), (-1, -1, 0))
    merged = merge_trees([a, b], budget=4)
    assert merged.tokens[:3] == (1, 2, 3)
    assert len(merged) == 4 and merged.tokens[3] == 8
    # a node whose parent did not fit is dropped with it
    assert (8, 4) not in paths(merged)


def test_empty_and_probabilistic_trees() -> None:
    assert len(merge_trees([DraftTree(), DraftTree()], budget=4)) == 0
    q = torch.full((2, 4), 0.25)
    sampled = DraftTree.chain([1, 2], probs=q)
    merged = merge_trees([DraftTree(), sampled, DraftTree.chain([3])], budget=4)
    assert merged is sampled or (merged.tokens == sampled.tokens and merged.probs is not None)
