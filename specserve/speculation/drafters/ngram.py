"""Prompt lookup decoding: propose what followed an earlier occurrence of the context's tail.

As vLLM's n-gram proposer and transformers' `prompt_lookup_num_tokens`: for n
from `max_ngram` down to `min_ngram`, look for an earlier occurrence of the
request's last n tokens (prompt + output) and propose the tokens that came after
it. The longest n that occurs wins; among its occurrences the most recent comes
first.

If a continuation runs into the end of the context (the match overlaps the
tail, as in a repetition loop), it keeps copying with the same lag: a match
ending p tokens before the last token says the text repeats with period p, so
token t + p is predicted to be token t, including tokens proposed just before.

Width (`max_width`, the engine's `--spec-width`). With 1 the draft is a chain:
the most recent match's continuation. With w > 1 the draft is the union, as a
prefix tree, of the first w distinct continuations (each up to `budget` tokens)
among the longest n-gram's most recent matches (at most `MAX_MATCHES` of them),
so continuations that agree share nodes and branch where they first differ. A
continuation seen at several matches counts that many times. Nodes are taken
best first until the budget is spent: most matches through the node, then
shallower, then more recent; so the budget goes to the best supported paths and
siblings appear most supported (then most recent) first.

Cost per request: the last token's earlier occurrences are found with
`tuple.index` (C speed) on a reversed copy, then each occurrence is extended
backwards at most `max_ngram` tokens in Python; the scan stops early once
enough matches of length `max_ngram` are found. About a millisecond for 4k
tokens in the worst case (a token that occurs everywhere), far less typically.
The drafter is stateless, so it is safe to share between threads.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from specserve.speculation.drafter import DraftRequest, Drafter
from specserve.speculation.tree import EMPTY_TREE, DraftTree


def continuation(tokens: Sequence[int], start: int, length: int) -> list[int]:
    """`length` tokens copied from `tokens[start:]`; past the end, copying goes on over the copy.

    Position `start + t` of the extended sequence (tokens followed by the result)
    always exists when `start < len(tokens)`, so the copy keeps the lag
    `len(tokens) - start`.
    """
    n = len(tokens)
    if start + length <= n:
        return list(tokens[start : start + length])
    out = list(tokens[start:])
    for t in range(len(out), length):
        i = start + t
        out.append(tokens[i] if i < n else out[i - n])
    return out


@dataclass
class _Branch:
    """A node of the continuation prefix tree built for one request and step."""

    count: int  # matches whose continuation passes through this node
    rank: int  # creation order; earlier = from a more recent match
    children: dict[int, "_Branch"] = field(default_factory=dict)


@dataclass(frozen=True)
class NgramDrafter(Drafter):
    """Prompt lookup drafter (deterministic; `probs` is None).

    max_ngram / min_ngram: the longest and shortest tail n-gram to look up.
    max_width: how many distinct continuations the draft tree may hold (1: a chain).
    """

    max_ngram: int = 4
    min_ngram: int = 1
    max_width: int = 1

    MAX_MATCHES: ClassVar[int] = 32
    """At most this many matches of the longest n-gram are read when max_width > 1."""

    def __post_init__(self) -> None:
        if not isinstance(self.min_ngram, int) or self.min_ngram < 1:
            raise ValueError(f"min_ngram: must be an integer >= 1, got {self.min_ngram!r}")
        if not isinstance(self.max_ngram, int) or self.max_ngram < self.min_ngram:
            raise ValueError(f"max_ngram: must be an integer >= min_ngram ({self.min_ngram}), got {self.max_ngram!r}")
        if not isinstance(self.max_width, int) or self.max_width < 1:
            raise ValueError(f"max_width: must be an integer >= 1, got {self.max_width!r}")

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        return [self.propose_one(r.view.token_ids, r.budget) for r in requests]

    def propose_one(self, tokens: Sequence[int], budget: int) -> DraftTree:
        """The draft tree for a request whose tokens (prompt + output) are `tokens`."""
        if budget <= 0:
            return EMPTY_TREE
        tokens = tuple(tokens)
        ends = self.match_ends(tokens, 1 if self.max_width == 1 else self.MAX_MATCHES)
        if not ends:
            return EMPTY_TREE
        if self.max_width == 1:
            return DraftTree.chain(continuation(tokens, ends[0] + 1, budget))
        return self._tree(tokens, ends, budget)

    def match_ends(self, tokens: tuple[int, ...], limit: int) -> list[int]:
        """Where earlier occurrences of the longest matching tail n-gram end, most recent first.

        Returns at most `limit` positions j (< len(tokens) - 1, so each has a next
        token), all for the same n, the largest n in [min_ngram, max_ngram] that occurs;
        [] when none does.
        """
        size = len(tokens)
        if size < 2:
            return []
        rev = tokens[::-1]  # rev[r] == tokens[size - 1 - r]; rev[0] is the last token
        last = rev[0]
        best, ends = 0, []
        r = 0
        while True:
            try:
                r = rev.index(last, r + 1)
            except ValueError:
                break
            n, cap = 1, min(self.max_ngram, size - r)
            while n < cap and rev[r + n] == rev[n]:
                n += 1
            if n > best:
                best, ends = n, [size - 1 - r]
            elif n == best and len(ends) < limit:
                ends.append(size - 1 - r)
            if best == self.max_ngram and len(ends) >= limit:
                break
        return ends if best >= self.min_ngram else []

    def _tree(self, tokens: tuple[int, ...], ends: list[int], budget: int) -> DraftTree:
        # Distinct continuations, most recent first, with how many matches each has.
        counts: dict[tuple[int, ...], int] = {}
        for end in ends:
            cont = tuple(continuation(tokens, end + 1, budget))
            if cont in counts:
                counts[cont] += 1
            elif len(counts) < self.max_width:
                counts[cont] = 1
        root: dict[int, _Branch] = {}
        rank = 0
        for cont, count in counts.items():  # insertion order = recency
            children = root
            for tok in cont:
                node = children.get(tok)
                if node is None:
                    node = children[tok] = _Branch(0, rank)
                    rank += 1
                node.count += count
                children = node.children
        # Best first: (most support, shallowest, most recent). A child never beats its parent
        # and is pushed only once the parent is taken, so parents precede children.
        heap: list[tuple[int, int, int, int, int, _Branch]] = []

        def push(children: dict[int, _Branch], parent: int, depth: int) -> None:
            for tok, node in children.items():
                heapq.heappush(heap, (-node.count, depth, node.rank, tok, parent, node))

        out_tokens: list[int] = []
        out_parents: list[int] = []
        push(root, -1, 1)
        while heap and len(out_tokens) < budget:
            _, depth, _, tok, parent, node = heapq.heappop(heap)
            out_tokens.append(tok)
            out_parents.append(parent)
            push(node.children, len(out_tokens) - 1, depth + 1)
        return DraftTree(tuple(out_tokens), tuple(out_parents))
