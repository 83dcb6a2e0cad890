"""Several drafters at once: their trees merged into one, within the same budget.

Exact-copy drafters (n-gram, suffix) are right for long stretches when the
output repeats its context and silent otherwise; token recycling always has a
guess. Merging their trees lets one verification try both: nodes of the first
drafter's tree come first, then the next drafter's nodes are added where their
paths are new, until the budget is spent. Shared prefixes are stored once.
"""

from __future__ import annotations

import torch

from specserve.speculation.drafter import Drafter, DraftRequest, RequestView
from specserve.speculation.tree import EMPTY_TREE, DraftTree


def merge_trees(trees: list[DraftTree], budget: int) -> DraftTree:
    """Union of deterministic trees, earlier trees first, at most `budget` nodes.

    Trees carrying proposal probabilities cannot be merged (their nodes were drawn from different
    distributions); then the first non-empty tree is returned as it is.
    """
    non_empty = [t for t in trees if len(t) > 0]
    if not non_empty:
        return EMPTY_TREE
    if any(t.probs is not None for t in non_empty):
        return non_empty[0].truncated(budget)
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
    for tree in non_empty:
        mapped: list[int | None] = []
        for tok, parent in zip(tree.tokens, tree.parents):
            mp = -1 if parent < 0 else mapped[parent]
            if mp is None:  # its parent did not fit
                mapped.append(None)
                continue
            node = index.get((mp, tok))
            if node is None and len(tokens) < budget:
                node = len(tokens)
                tokens.append(tok)
                parents.append(mp)
                index[(mp, tok)] = node
            mapped.append(node)
    return DraftTree(tuple(tokens), tuple(parents))


class HybridDrafter(Drafter):
    def __init__(self, drafters: list[Drafter]) -> None:
        if not drafters:
            raise ValueError("spec: a hybrid drafter needs at least one drafter")
        self.drafters = drafters
        self.target_topk = max(d.target_topk for d in drafters)
        self.runs_a_model = any(d.runs_a_model for d in drafters)
        self.stops_by_value = all(d.stops_by_value or not d.runs_a_model for d in drafters)

    @property  # type: ignore[override]
    def catch_up_seconds(self) -> float:
        return sum(d.catch_up_seconds for d in self.drafters)

    def catch_up_cost(self, view: RequestView) -> float:
        return sum(d.catch_up_cost(view) for d in self.drafters)

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        per_drafter = [d.propose(requests) for d in self.drafters]
        return [merge_trees([trees[i] for trees in per_drafter], r.budget) for i, r in enumerate(requests)]

    def observe(self, view: RequestView, tree: DraftTree, target_top_ids: torch.Tensor | None) -> None:
        for d in self.drafters:
            top = None
            if target_top_ids is not None and d.target_topk > 0:
                top = target_top_ids[:, : d.target_topk]
            d.observe(view, tree, top)

    def finish(self, request_id: str, view: RequestView) -> None:
        for d in self.drafters:
            d.finish(request_id, view)
