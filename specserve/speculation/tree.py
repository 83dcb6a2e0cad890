"""Draft token trees: what a drafter proposes for one request in one step.

Node i holds `tokens[i]`; `parents[i]` is the index of its parent node, or -1
when its parent is the root (the request's last token, whose K/V is computed in
the same step). Parents come before children (`parents[i] < i`), so a chain is
the tree with `parents == (-1, 0, 1, ...)`. Children of one node are listed in
the drafter's order of preference; verification tries them in that order.

`probs`, when given, is [n, vocab]: row i is the proposal distribution node i's
token was drawn from (the drafter's distribution at i's parent, after the same
logits processing the target uses). A drafter that picks tokens deterministically
(prompt lookup, top-k of a draft, ...) leaves it None; verification then treats
each node as a point-mass proposal, which is still lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    probs: torch.Tensor | None = None
    # The drafter's own estimate, per node, of the chance the node is right given its parent is
    # (suffix counts, ...), or None; the controller calibrates it against what verification shows.
    scores: tuple[float, ...] | None = field(default=None, compare=False)  # advisory: not part of equality

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"draft tree: {len(self.tokens)} tokens but {len(self.parents)} parents")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"draft tree: node {i} has parent {p}; parents must precede children")
        if self.scores is not None and len(self.scores) != len(self.tokens):
            raise ValueError(f"draft tree: {len(self.scores)} scores for {len(self.tokens)} nodes")
        if self.probs is not None and self.probs.shape[0] != len(self.tokens):
            raise ValueError(f"draft tree: probs has {self.probs.shape[0]} rows for {len(self.tokens)} nodes")

    @staticmethod
    def chain(tokens: list[int] | tuple[int, ...], probs: torch.Tensor | None = None,
              scores: list[float] | tuple[float, ...] | None = None) -> "DraftTree":
        return DraftTree(tuple(tokens), tuple(range(-1, len(tokens) - 1)), probs,
                         None if scores is None else tuple(scores))

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        """Depth of each node; children of the root have depth 1."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1 for the root), in order of preference."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def ancestor_mask(self) -> torch.Tensor:
        """[n + 1, n + 1] bool over (root, node 0, ..., node n-1): True where the column is the row
        itself or one of its ancestors. This is the attention mask among a request's new tokens."""
        n = len(self.tokens)
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        mask[:, 0] = True
        mask[0, 0] = True
        for i, p in enumerate(self.parents):
            row = i + 1
            if p >= 0:
                mask[row] = mask[p + 1]
            mask[row, row] = True
        return mask

    def truncated(self, max_nodes: int) -> "DraftTree":
        """The first `max_nodes` nodes (still a tree, since parents precede children)."""
        if len(self) <= max_nodes:
            return self
        probs = None if self.probs is None else self.probs[:max_nodes]
        scores = None if self.scores is None else self.scores[:max_nodes]
        return DraftTree(self.tokens[:max_nodes], self.parents[:max_nodes], probs, scores)

    def keep(self, nodes: list[int]) -> "DraftTree":
        """The subtree of `nodes` (each node's parent among them), in the original order."""
        chosen = sorted(nodes)
        if len(chosen) == len(self):
            return self
        new_index = {old: new for new, old in enumerate(chosen)}
        parents = []
        for old in chosen:
            p = self.parents[old]
            if p >= 0 and p not in new_index:
                raise ValueError(f"draft tree: node {old} kept without its parent {p}")
            parents.append(-1 if p < 0 else new_index[p])
        probs = None if self.probs is None else self.probs[chosen]
        scores = None if self.scores is None else tuple(self.scores[i] for i in chosen)
        return DraftTree(tuple(self.tokens[i] for i in chosen), tuple(parents), probs, scores)


EMPTY_TREE = DraftTree()


def replay(tree: DraftTree, emitted: list[int]) -> tuple[DraftTree, list[int]]:
    """What verifying `tree` would have accepted, judged by the tokens a step emitted with another
    tree: the part of `tree` those tokens can judge (nodes at depth <= len(emitted)) and, of it, the
    nodes on the emitted path, root to leaf.

    Exact for greedy requests (the emitted tokens are the target's argmax chain). For sampled ones,
    a deterministic node matches the emitted token with the chance it would have been accepted:
    with point-mass proposals, recursive rejection sampling accepts a child with token x exactly
    when the target's draw there is x (elder siblings rejected), so the emitted tokens give the
    same acceptance in distribution."""
    depths = tree.depths()
    judged = tree.keep([i for i, d in enumerate(depths) if d <= len(emitted)])
    accepted: list[int] = []
    node = -1
    for tok in emitted:
        match = next((c for c in judged.children(node) if judged.tokens[c] == tok), None)
        if match is None:
            break
        accepted.append(match)
        node = match
    return judged, accepted

