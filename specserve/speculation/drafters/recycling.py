"""Token Recycling: draft from the target's own discarded top-k candidates.

Luo et al. 2024, "Turning Trash into Treasure: Accelerating Inference of Large
Language Models with Token Recycling". The drafter keeps one adjacency matrix
`succ[vocab_size, topk]` (int32, -1 = empty) holding, for each token, the top-k
next tokens the target model predicted the last time that token was verified.
Every verification refreshes it (`observe`): the target's top-k at the root
(after the request's last token) and at each draft node (after that node's
token) replace the stored rows of those tokens, newest wins. `propose` grows a
tree from the request's last token by following the table through a static
template of per-depth branching factors (`widths`).

The table is global: one per drafter, shared by every request, as in the
paper. Its size is fixed at vocab_size * topk * 4 bytes (49152 x 8 -> 1.5 MB).

Tree shape. `widths[d]` caps how many children a node at depth d gets (the
root is depth 0), and the tree is at most `len(widths)` deep (default
`DEFAULT_WIDTHS` = (4, 2, 2, 1, 1, 1), capped at topk). With the default
`expand="best_first"` the nodes of that template are taken in order of a fixed
prior score (the product, along the node's path, of a per-rank acceptance prior
`0.5 / (rank + 1) ** 2`: top-1 candidates are accepted far more often than
lower ranks), so a small budget yields a top-1 chain plus the best alternatives
near the root rather than only the first level; when the
budget covers the whole template the result is the full template. With
`expand="bfs"` nodes are taken level by level (the paper's plain BFS order).
Either way nodes are emitted parents-first, siblings in preference order,
without duplicate sibling tokens, and the tree is cut at `budget` nodes.

Warm start (`seed_from_prompt`): a token whose row was never written has no
candidates in the table; for such a token the drafter falls back to the token
that most recently followed it in the request's own tokens (prompt + output), a
bigram index kept incrementally per request (O(new tokens) per step, dropped in
`finish`).

Threading: `propose`, `observe` and `finish` are meant to be called from one
thread (the engine's step loop calls them all); there is no lock.

Cost: `observe` is one host copy of the [n + 1, topk] id tensor plus a numpy
row assignment (a Python loop only when ids are out of range or a token repeats).
`propose` reads at most `budget` rows of the table (`.tolist()` each) and builds
the tree in pure Python: a few tens of microseconds for budget 32.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np
import torch

from specserve.speculation.drafter import DraftRequest, Drafter, Observation, RequestView
from specserve.speculation.tree import EMPTY_TREE, DraftTree

EMPTY = -1
"""Marks an empty slot of the successor table."""

DEFAULT_WIDTHS = (4, 2, 2, 1, 1, 1)
"""Children per node at depths 0 (the root), 1, ...: up to 76 nodes, 6 deep."""

_EXPAND_MODES = ("best_first", "bfs")


def _rank_prior(rank: int) -> float:
    """A fixed guess of how often the table's rank-`rank` successor is the target's next token."""
    return 0.5 / (rank + 1) ** 2


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


class _BigramIndex:
    """For one request: the token that most recently followed each token, built incrementally."""

    __slots__ = ("next_of", "n", "last")

    def __init__(self) -> None:
        self.next_of: dict[int, int] = {}
        self.n = 0  # tokens consumed: every pair among the first n tokens is indexed
        self.last = EMPTY  # the token at position n - 1

    def update(self, prompt: tuple[int, ...], output: tuple[int, ...]) -> None:
        total = len(prompt) + len(output)
        if total == self.n:
            return
        start = self.n - 1 if self.n > 0 else 0
        if total < self.n or self._token_at(prompt, output, start) != self.last:
            # The sequence is not an extension of what was indexed: start over.
            self.next_of.clear()
            self.n = 0
            start = 0
        p = len(prompt)
        tail = output[start - p:] if start >= p else prompt[start:] + output
        nxt = self.next_of
        for a, b in zip(tail, tail[1:]):
            nxt[a] = b
        self.n = total
        self.last = tail[-1]

    @staticmethod
    def _token_at(prompt: tuple[int, ...], output: tuple[int, ...], i: int) -> int:
        p = len(prompt)
        return prompt[i] if i < p else output[i - p]


class RecyclingDrafter(Drafter):
    """Token Recycling drafter: a global top-k successor table refreshed from every verification."""

    target_topk: int = 8

    def __init__(
        self,
        vocab_size: int,
        topk: int = 8,
        widths: Sequence[int] | None = None,
        *,
        expand: str = "best_first",
        seed_from_prompt: bool = True,
    ) -> None:
        if not _is_int(vocab_size) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an integer >= 1, got {vocab_size!r}")
        if not _is_int(topk) or not 1 <= topk <= vocab_size:
            raise ValueError(f"topk must be an integer in [1, vocab_size={vocab_size}], got {topk!r}")
        if widths is None:  # the default template, capped at topk
            widths = tuple(min(w, topk) for w in DEFAULT_WIDTHS)
        try:
            widths_t = tuple(widths)
        except TypeError:
            raise ValueError(f"widths must be a sequence of integers, got {widths!r}") from None
        if not widths_t or not all(_is_int(w) and 1 <= w <= topk for w in widths_t):
            raise ValueError(f"widths must be a non-empty sequence of integers in [1, topk={topk}], got {widths!r}")
        if expand not in _EXPAND_MODES:
            raise ValueError(f"expand must be one of {_EXPAND_MODES}, got {expand!r}")
        if not isinstance(seed_from_prompt, bool):
            raise ValueError(f"seed_from_prompt must be a bool, got {seed_from_prompt!r}")

        self.vocab_size = int(vocab_size)
        self.topk = int(topk)
        self.target_topk = self.topk
        self.widths = tuple(int(w) for w in widths_t)
        self.expand = expand
        self.seed_from_prompt = seed_from_prompt
        self.succ = np.full((self.vocab_size, self.topk), EMPTY, dtype=np.int32)
        self._bigrams: dict[str, _BigramIndex] = {}

    # ------------------------------------------------------------------ propose

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        return [self._propose_one(r.view, r.budget) for r in requests]

    def _propose_one(self, view: RequestView, budget: int) -> DraftTree:
        prompt, output = view.prompt_token_ids, view.output_token_ids
        bigram: dict[int, int] | None = None
        if self.seed_from_prompt:
            index = self._bigrams.get(view.request_id)
            if index is None:
                index = self._bigrams[view.request_id] = _BigramIndex()
            index.update(prompt, output)
            bigram = index.next_of
        if budget <= 0 or not (prompt or output):
            return EMPTY_TREE
        root = output[-1] if output else prompt[-1]
        if self.expand == "bfs":
            tokens, parents = self._bfs(root, budget, bigram)
        else:
            tokens, parents = self._best_first(root, budget, bigram)
        if not tokens:
            return EMPTY_TREE
        return DraftTree(tuple(tokens), tuple(parents))

    def _candidates(self, token: int, width: int, bigram: dict[int, int] | None) -> list[int]:
        """Up to `width` distinct successors of `token`, best first; the bigram fallback if none."""
        if not 0 <= token < self.vocab_size:
            return []
        out: list[int] = []
        for t in self.succ[token].tolist():
            if t != EMPTY and t not in out:
                out.append(t)
                if len(out) == width:
                    break
        if not out and bigram is not None:
            nxt = bigram.get(token)
            if nxt is not None and 0 <= nxt < self.vocab_size:
                out.append(nxt)
        return out

    def _bfs(self, root: int, budget: int, bigram: dict[int, int] | None) -> tuple[list[int], list[int]]:
        tokens: list[int] = []
        parents: list[int] = []
        widths, max_depth = self.widths, len(self.widths)
        frontier = [(-1, root)]  # (node index, token) at the current depth
        for depth in range(max_depth):
            nxt_frontier: list[tuple[int, int]] = []
            for node, tok in frontier:
                for child in self._candidates(tok, widths[depth], bigram):
                    tokens.append(child)
                    parents.append(node)
                    if len(tokens) == budget:
                        return tokens, parents
                    nxt_frontier.append((len(tokens) - 1, child))
            if not nxt_frontier:
                break
            frontier = nxt_frontier
        return tokens, parents

    def _best_first(self, root: int, budget: int, bigram: dict[int, int] | None) -> tuple[list[int], list[int]]:
        # Score of a node = product over its path of _rank_prior(rank). A child always scores below
        # its parent and a sibling below its elder siblings, so popping by score emits parents
        # before children and siblings in preference order; ties go to the earlier-pushed node.
        tokens: list[int] = []
        parents: list[int] = []
        widths, max_depth = self.widths, len(self.widths)
        heap: list[tuple[float, int, int, int, int]] = []  # (-score, seq, parent, token, depth)
        seq = 0
        for rank, t in enumerate(self._candidates(root, widths[0], bigram)):
            heap.append((-_rank_prior(rank), seq, -1, t, 1))
            seq += 1
        heapq.heapify(heap)
        while heap and len(tokens) < budget:
            neg, _, parent, tok, depth = heapq.heappop(heap)
            tokens.append(tok)
            parents.append(parent)
            if depth < max_depth:
                node = len(tokens) - 1
                for rank, t in enumerate(self._candidates(tok, widths[depth], bigram)):
                    heapq.heappush(heap, (neg * _rank_prior(rank), seq, node, t, depth + 1))
                    seq += 1
        return tokens, parents

    # ------------------------------------------------------------------ observe

    def observe(self, view: RequestView, tree: DraftTree, target_top_ids: torch.Tensor | None) -> None:
        """Write the target's top-k after the root and after each tree node into the table.

        Rows whose token is out of [0, vocab_size) are skipped; ids out of that range are dropped
        from a row (the rest move left, -1 fills the end). Extra columns beyond `topk` are ignored.
        When a token appears more than once (root and nodes), the root's row wins, then the
        earliest node's (the row computed in the least speculative context).
        """
        if target_top_ids is None:
            return
        n = len(tree) + 1
        if target_top_ids.dim() != 2 or target_top_ids.shape[0] != n:
            raise ValueError(
                f"target_top_ids must have shape [len(tree) + 1 = {n}, k], got {tuple(target_top_ids.shape)}"
            )
        prompt, output = view.prompt_token_ids, view.output_token_ids
        if not (prompt or output):
            return
        root = output[-1] if output else prompt[-1]
        V, k = self.vocab_size, self.topk
        rows = target_top_ids[:, :k].detach().to("cpu", torch.int64).numpy()

        # Which rows to write, and to which token: first occurrence of each in-range token.
        keys = (root,) + tuple(tree.tokens)
        row_idx: list[int] = []
        dest: list[int] = []
        seen: set[int] = set()
        for i, t in enumerate(keys):
            if 0 <= t < V and t not in seen:
                seen.add(t)
                row_idx.append(i)
                dest.append(t)
        if not dest:
            return
        sel = rows[row_idx] if len(row_idx) != n else rows
        valid = (sel >= 0) & (sel < V)
        if sel.shape[1] == k and bool(valid.all()):
            self.succ[dest] = sel
            return
        # Slow path: drop out-of-range ids, pad to k with EMPTY.
        for t, row, ok in zip(dest, sel.tolist(), valid.tolist()):
            kept = [x for x, good in zip(row, ok) if good]
            self.succ[t] = kept + [EMPTY] * (k - len(kept))

    def observe_many(self, observations: Sequence[Observation]) -> None:
        """`observe` for each, in order, as one write into the table: a batch's rows cost a
        Python loop over their tokens and one numpy assignment, not a numpy round trip each (at
        batch 8, ~15 us a request a step). The same table as observing them one by one: within an
        observation the root's row wins, then the earliest node's; a later observation overwrites
        an earlier one. Anything `observe` would treat specially (a bad shape, ids out of range,
        fewer than `topk` columns) goes through `observe` one by one."""
        V, k = self.vocab_size, self.topk
        parts: list[torch.Tensor] = []
        final: dict[int, int] = {}  # token -> its row among `parts`' rows (a later observation's wins)
        offset = 0
        for view, tree, top in observations:
            if top is None:
                continue
            n = len(tree) + 1
            if top.dim() != 2 or top.shape[0] != n or top.shape[1] < k:
                return super().observe_many(observations)
            prompt, output = view.prompt_token_ids, view.output_token_ids
            if not (prompt or output):
                continue
            mine: dict[int, int] = {}
            for i, t in enumerate((output[-1] if output else prompt[-1], *tree.tokens)):
                if 0 <= t < V and t not in mine:
                    mine[t] = offset + i
            final.update(mine)
            parts.append(top[:, :k])
            offset += n
        if not final:
            return
        rows = torch.cat(parts).detach().to("cpu", torch.int64).numpy()
        if not bool(((rows >= 0) & (rows < V)).all()):
            return super().observe_many(observations)
        self.succ[list(final)] = rows[list(final.values())]

    def finish(self, request_id: str, view: RequestView) -> None:
        self._bigrams.pop(request_id, None)

    # ------------------------------------------------------------------ helpers

    def successors(self, token: int) -> list[int]:
        """The stored successors of `token`, best first (empty slots left out)."""
        if not 0 <= token < self.vocab_size:
            return []
        return [t for t in self.succ[token].tolist() if t != EMPTY]
