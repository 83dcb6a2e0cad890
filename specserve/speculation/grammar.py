"""Draft trees seen through a request's grammar (structured outputs under speculation).

The grammar sits at the request's position (the root). Walking the tree moves it along each
node's path and back (accept / roll back), so:

- `prune`: nodes the grammar forbids are dropped with their subtrees before verification. A node
  drawn from a proposal distribution (the tree has `probs`) is kept as a leaf instead: rejection
  sampling must still see it rejected (p(x) = 0 under the masked target), or the residual
  distribution it leaves would differ and the output would no longer follow the target's.
- `masks`: the tokens allowed at the root and after every node, one bitmask row per logits row,
  so that the target is constrained at every verified node and at the bonus token exactly as
  plain constrained decoding constrains it.
- `extend_forced`: the text the grammar forces after the tree's main path (JSON keys, braces,
  quotes) appended as a chain of draft nodes, in the grammar's canonical tokenization.

Every function leaves the grammar where it found it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specserve.speculation.tree import DraftTree
from specserve.structured import TokenGrammar, allow_all


def _paths(tree: DraftTree) -> list[list[int]]:
    out: list[list[int]] = []
    for i, p in enumerate(tree.parents):
        out.append((out[p] if p >= 0 else []) + [i])
    return out


def walk(tree: DraftTree, grammar: TokenGrammar, at_node: Callable[[int], None] | None = None) -> list[bool]:
    """Which nodes the grammar allows (their whole path is grammatical); `at_node(i)` is called with
    the grammar positioned after node i, for every allowed node."""
    allowed: list[bool] = []
    stack: list[int] = []  # nodes consumed, root to current
    try:
        for i, path in enumerate(_paths(tree)):
            parent = tree.parents[i]
            if parent >= 0 and not allowed[parent]:
                allowed.append(False)
                continue
            common = 0
            while common < len(stack) and common < len(path) - 1 and stack[common] == path[common]:
                common += 1
            grammar.rollback(len(stack) - common)
            del stack[common:]
            for node in path[common:-1]:  # ancestors: allowed, so they are accepted again
                if not grammar.accept(tree.tokens[node]):
                    raise RuntimeError(f"grammar refused node {node} on a second walk")
                stack.append(node)
            ok = grammar.accept(tree.tokens[i])
            allowed.append(ok)
            if ok:
                stack.append(i)
                if at_node is not None:
                    at_node(i)
    finally:
        grammar.rollback(len(stack))
    return allowed


def prune(tree: DraftTree, grammar: TokenGrammar) -> DraftTree:
    """The tree without the nodes the grammar forbids (see the module notes for trees with probs)."""
    if not len(tree):
        return tree
    allowed = walk(tree, grammar)
    if all(allowed):
        return tree
    if tree.probs is None:
        keep = [i for i, ok in enumerate(allowed) if ok]
    else:  # a forbidden node stays, as a leaf, where its parent is allowed
        keep = [i for i, p in enumerate(tree.parents) if p < 0 or allowed[p]]
    return tree.keep(keep)


def masks(tree: DraftTree, grammar: TokenGrammar) -> torch.Tensor:
    """[len(tree) + 1, words] bitmask: row 0 the tokens allowed at the root, row i + 1 after node i.
    Rows no token is ever drawn from (after a forbidden node, or once the grammar is complete and
    the request stops) allow everything."""
    bitmask = allow_all(len(tree) + 1, grammar.mask_size)
    grammar.fill(bitmask, 0)
    walk(tree, grammar, lambda i: grammar.fill(bitmask, i + 1))
    dead = ~bitmask.any(dim=1)
    bitmask[dead] = -1
    return bitmask


def extend_forced(tree: DraftTree, grammar: TokenGrammar, budget: int) -> tuple[DraftTree, int]:
    """The tree with the grammar's forced tokens after its main path (the first child at each
    depth; the root when the tree is empty) appended as a chain, within `budget` nodes in all.
    Returns the tree and how many nodes were appended (after the tree's own nodes, so their
    indices follow the drafter's)."""
    room = budget - len(tree)
    if room <= 0:
        return tree, 0
    path: list[int] = []
    node = -1
    while True:
        kids = tree.children(node)
        if not kids:
            break
        node = kids[0]
        path.append(node)
    consumed = 0
    try:
        for n in path:
            if not grammar.accept(tree.tokens[n]):
                return tree, 0
            consumed += 1
        if grammar.done:
            return tree, 0
        forced = []
        for t in grammar.forced()[:room]:
            if t >= grammar.vocab_size:
                break
            forced.append(t)
    finally:
        grammar.rollback(consumed)
    if not forced:
        return tree, 0
    n = len(tree)
    parents = tree.parents + tuple([node] + list(range(n, n + len(forced) - 1)))
    probs = tree.probs
    if probs is not None:  # a point-mass proposal is a one-hot row
        extra = torch.zeros(len(forced), probs.shape[1], dtype=probs.dtype, device=probs.device)
        extra[torch.arange(len(forced)), torch.tensor(forced)] = 1.0
        probs = torch.cat([probs, extra])
    scores = None if tree.scores is None else tree.scores + (1.0,) * len(forced)
    return DraftTree(tree.tokens + tuple(forced), parents, probs, scores), len(forced)
