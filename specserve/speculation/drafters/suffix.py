"""SuffixDecoding: draft from suffix statistics of this request and of earlier outputs.

Oliaro et al. 2024, "SuffixDecoding: Extreme Speculative Decoding for Emerging
AI Applications" (as in Snowflake ArcticInference's suffix_decoding). Two
indexes count the token windows seen so far:

- per request, one over that request's own prompt + output, extended
  incrementally each step with the tokens appended since the last call (rebuilt
  if the request's tokens are not an extension of what was indexed); dropped in
  `finish`;
- one global index over the outputs of the last `max_cached_requests` finished
  requests (added in `finish`, oldest evicted first), guarded by a lock, since
  `finish` may come from a server thread while the engine thread proposes.

Proposing. Find the longest suffix of the request's tokens, at most `max_depth`
long, that occurred before with a continuation (match length m). From there
grow the tree greedily: the frontier node with the highest path probability
(the product of count(child) / count(all continuations of its parent) along the
path) is taken next, until `max_spec = min(budget, max(1, int(m *
max_spec_factor)))` nodes are taken or every frontier node is below `min_prob`.
Siblings come out most probable first. Each index gives a candidate; the one
with the higher score (the sum of its nodes' path probabilities, the expected
number of accepted tokens under the counts) wins, the request's own on a tie;
so a long match in earlier outputs beats a weak one in the request's own text
and vice versa. This is ArcticInference's rule rather than "longer match wins".

The index (`SuffixTrie`) is a suffix trie of bounded depth D = max_depth +
max(1, int(max_depth * max_spec_factor)): it counts every window of at most D
tokens starting at each position. To keep memory near linear it is path
compressed where it counts one occurrence: a node seen once stores where that
occurrence ends (its sequence and position) instead of children, and its
subtree is read from the sequence; the node is expanded into real children only
when a second occurrence reaches it. Memory is then O(tokens + repeated
windows), bounded by D * tokens indexed (per request: its length; global:
`max_cached_requests` outputs).

The drafter's indexes are C++ (`NativeSuffixIndex`, csrc/suffix_trie.cpp): the
same trie, match and tree growth as the Python `SuffixTrie` and `PySuffixIndex`
here, which are the reference it is tested against node for node. Cost per step
and request: indexing a new token touches only the windows still inside repeated
text (at most D, usually a few); the match is a binary search over suffix
lengths, O(max_depth * log max_depth) hash lookups; growing the tree is
O(max_spec * log) heap operations. In C++ a call (index the new tokens, or match
and grow) costs ~5 us, most of it the call itself; the Python reference took
~1 us a token to index and ~100 us a request to match and grow in both indexes,
which at batch 4-8 of a small model was what drafting with suffix cost
(BENCHMARKS.md, session 40).

Threading: `finish` may run concurrently with `propose`; `propose` itself must
not run concurrently with itself (the engine calls it from one thread). Per
request state that `finish` could not drop (a request proposed for once more
after it finished) is dropped after `STALE_AFTER_CALLS` calls without use.
"""

from __future__ import annotations

import heapq
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import ClassVar, Protocol, Union, cast

import torch

from specserve.model import ops
from specserve.speculation.drafter import DraftRequest, Drafter, RequestView
from specserve.speculation.tree import EMPTY_TREE, DraftTree


class _Node:
    """A trie node counting the occurrences (window starts) of the path to it.

    Expanded nodes have `children`. A node with one occurrence may instead be
    compressed: `children` is None and `seq[end]` is the last token of that
    occurrence, so its subtree is the continuation `seq[end + 1:]`.
    """

    __slots__ = ("count", "children", "seq", "end")

    def __init__(self, seq: Sequence[int] | None, end: int) -> None:
        self.count = 1
        self.children: dict[int, _Node] | None = None
        self.seq = seq
        self.end = end


Cursor = Union[_Node, tuple[Sequence[int], int]]
"""A position in the trie: an expanded node, or (seq, end) inside a compressed path."""

Window = tuple[_Node, int]
"""An open window while indexing: the expanded node it has reached and its depth."""


class SuffixTrie:
    """Counts of every window of at most `depth` tokens of the sequences added, path compressed."""

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"depth: must be >= 1, got {depth}")
        self.depth = depth
        self.root = _Node(None, -1)
        self.root.count = 0
        self.root.children = {}

    # -- building -----------------------------------------------------------------

    def push(self, seq: Sequence[int], i: int, windows: list[Window]) -> list[Window]:
        """Index `seq[i]`, the next token of `seq`, whose open windows are `windows`.

        Every window that ends at i - 1 and is shorter than `depth` grows by one token,
        and a new one starts at i. A window that reaches a new node leaves it
        compressed and closes (its continuation is `seq` itself); a window that
        reaches a compressed node expands it. Returns the windows still open.
        """
        tok = seq[i]
        still_open: list[Window] = []
        for node, depth in chain(windows, ((self.root, 0),)):
            children = node.children
            assert children is not None
            child = children.get(tok)
            if child is None:
                children[tok] = _Node(seq, i)
                continue
            if child.children is None:
                self._expand(child, depth + 1)
            child.count += 1
            if depth + 1 < self.depth:
                still_open.append((child, depth + 1))
        return still_open

    def _expand(self, node: _Node, depth: int) -> None:
        seq, end = node.seq, node.end
        assert seq is not None
        node.children = {}
        if depth < self.depth and end + 1 < len(seq):
            node.children[seq[end + 1]] = _Node(seq, end + 1)
        node.seq = None

    def add(self, seq: Sequence[int]) -> None:
        """Index a whole sequence (which must not change while indexed)."""
        windows: list[Window] = []
        for i in range(len(seq)):
            windows = self.push(seq, i, windows)

    def remove(self, seq: Sequence[int]) -> None:
        """Undo `add(seq)` for the same sequence object (counts drop; empty nodes go)."""
        for start in range(len(seq)):
            node = self.root
            for k in range(min(self.depth, len(seq) - start)):
                children = node.children
                assert children is not None
                tok = seq[start + k]
                child = children[tok]
                child.count -= 1
                if child.count == 0:
                    del children[tok]
                    break
                if child.children is None:  # compressed nodes count one occurrence: unreachable
                    break
                node = child

    # -- reading ------------------------------------------------------------------

    @staticmethod
    def _cursor(node: _Node) -> Cursor:
        if node.children is not None:
            return node
        assert node.seq is not None
        return (node.seq, node.end)

    def step(self, cur: Cursor, depth: int, tok: int) -> Cursor | None:
        """The child of `cur` (at `depth`) for `tok`, or None."""
        if isinstance(cur, _Node):
            assert cur.children is not None
            child = cur.children.get(tok)
            return None if child is None else self._cursor(child)
        seq, end = cur
        if depth < self.depth and end + 1 < len(seq) and seq[end + 1] == tok:
            return (seq, end + 1)
        return None

    def find(self, pattern: Sequence[int]) -> Cursor | None:
        """The trie position of `pattern`, or None if it never occurred."""
        cur: Cursor = self.root
        for depth, tok in enumerate(pattern):
            nxt = self.step(cur, depth, tok)
            if nxt is None:
                return None
            cur = nxt
        return cur

    def frequent_children(self, cur: Cursor, depth: int, share: float) -> tuple[int, list[tuple[int, int, Cursor]]]:
        """The count of all continuations of `cur` (at `depth`), and (token, count, cursor) of those
        counting at least `share` of it, most frequent first (first seen first among equals). A node
        after a common token may have thousands of continuations: only the few that can pass are
        given cursors and sorted."""
        if isinstance(cur, _Node):
            assert cur.children is not None
            kids = cur.children
            total = sum(c.count for c in kids.values())
            least = share * total * (1 - 1e-9)  # no stricter than the caller's own test, whatever the rounding
            picked = [(tok, c.count, self._cursor(c)) for tok, c in kids.items() if c.count >= least]
            picked.sort(key=lambda kid: -kid[1])
            return total, picked
        kids_list = self.children(cur, depth)
        return sum(count for _, count, _ in kids_list), kids_list

    def continues(self, cur: Cursor, depth: int) -> bool:
        """Whether `cur` (at `depth`) has any continuation: `children` without listing them (a node
        after a common token in the global index has thousands)."""
        if isinstance(cur, _Node):
            return bool(cur.children)
        seq, end = cur
        return depth < self.depth and end + 1 < len(seq)

    def children(self, cur: Cursor, depth: int) -> list[tuple[int, int, Cursor]]:
        """(token, count, cursor) of each continuation of `cur` (at `depth`), in first-seen order."""
        if isinstance(cur, _Node):
            assert cur.children is not None
            return [(tok, c.count, self._cursor(c)) for tok, c in cur.children.items()]
        seq, end = cur
        if depth < self.depth and end + 1 < len(seq):
            return [(seq[end + 1], 1, (seq, end + 1))]
        return []


@dataclass(frozen=True)
class SuffixConfig:
    """max_depth: longest context suffix matched; max_spec_factor: nodes per matched token;
    min_prob: smallest path probability a node may have; max_cached_requests: finished
    requests' outputs kept in the global index (0 disables it)."""

    max_depth: int = 24
    max_spec_factor: float = 1.0
    min_prob: float = 0.1
    max_cached_requests: int = 256

    def __post_init__(self) -> None:
        if not isinstance(self.max_depth, int) or self.max_depth < 1:
            raise ValueError(f"max_depth: must be an integer >= 1, got {self.max_depth!r}")
        if not self.max_spec_factor > 0:
            raise ValueError(f"max_spec_factor: must be > 0, got {self.max_spec_factor!r}")
        if not 0 <= self.min_prob <= 1:
            raise ValueError(f"min_prob: must be in [0, 1], got {self.min_prob!r}")
        if not isinstance(self.max_cached_requests, int) or self.max_cached_requests < 0:
            raise ValueError(f"max_cached_requests: must be an integer >= 0, got {self.max_cached_requests!r}")

    @property
    def trie_depth(self) -> int:
        """Match plus proposal: the deepest window the indexes need."""
        return self.max_depth + max(1, int(self.max_depth * self.max_spec_factor))


Proposal = tuple[list[int], list[int], list[float], float]
"""A tree grown from a match: tokens, parents, each node's conditional probability, and the score
(the sum of path probabilities); a score below 0 means no suffix of the context matched."""


class SuffixIndex(Protocol):
    """The drafter's view of an index: sequences appended to and indexed, removed, and matched.
    `NativeSuffixIndex` (C++) serves the drafter; `PySuffixIndex` is the reference it is tested
    against, node for node."""

    def extend(self, seq: int, tokens: list[int]) -> int:
        """Append `tokens` to sequence `seq` and index them (-1: a new sequence); its id."""
        ...

    def close(self, seq: int) -> None:
        """The sequence is complete: forget its open windows."""
        ...

    def remove(self, seq: int) -> None:
        """Undo the sequence's indexing."""
        ...

    def speculate(self, context: list[int], max_depth: int, budget: int, max_spec_factor: float,
                  min_prob: float) -> Proposal:
        """Match the longest suffix of `context` (at most `max_depth`) with a continuation, then
        grow a tree of at most min(budget, max(1, int(match * max_spec_factor))) nodes."""
        ...

    def children(self, pattern: list[int]) -> tuple[list[int], list[int]]:
        """The continuations of `pattern` and their counts, first seen first."""
        ...


class PySuffixIndex:
    """`SuffixIndex` over the Python `SuffixTrie`: the reference for the native index."""

    def __init__(self, depth: int) -> None:
        self.trie = SuffixTrie(depth)
        self._seqs: list[list[int]] = []
        self._windows: list[list[Window]] = []

    def extend(self, seq: int, tokens: list[int]) -> int:
        if seq < 0:
            seq = len(self._seqs)
            self._seqs.append([])
            self._windows.append([])
        grown = self._seqs[seq]
        for tok in tokens:
            grown.append(tok)
            self._windows[seq] = self.trie.push(grown, len(grown) - 1, self._windows[seq])
        return seq

    def close(self, seq: int) -> None:
        self._windows[seq] = []

    def remove(self, seq: int) -> None:
        self.trie.remove(self._seqs[seq])
        self._seqs[seq], self._windows[seq] = [], []

    def children(self, pattern: list[int]) -> tuple[list[int], list[int]]:
        cur = self.trie.find(pattern)
        kids = [] if cur is None else self.trie.children(cur, len(pattern))
        return [tok for tok, _, _ in kids], [count for _, count, _ in kids]

    def speculate(self, context: list[int], max_depth: int, budget: int, max_spec_factor: float,
                  min_prob: float) -> Proposal:
        trie = self.trie
        # A suffix that occurred with a continuation implies every shorter one did: binary search.
        lo, hi = 0, min(max_depth, len(context))
        match: Cursor | None = None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            cur = trie.find(context[len(context) - mid :])
            if cur is not None and trie.continues(cur, mid):
                lo, match = mid, cur
            else:
                hi = mid - 1
        if match is None:
            return [], [], [], -1.0
        max_spec = min(budget, max(1, int(lo * max_spec_factor)))
        return self._grow(match, lo, max_spec, min_prob)

    def _grow(self, match: Cursor, depth: int, max_nodes: int, min_prob: float) -> Proposal:
        tokens: list[int] = []
        parents: list[int] = []
        conditional: list[float] = []
        score = 0.0
        heap: list[tuple[float, int, int, int, Cursor, int, float]] = []
        order = 0

        def push(cur: Cursor, depth: int, parent: int, prob: float) -> None:
            nonlocal order
            total, kids = self.trie.frequent_children(cur, depth, min_prob / prob)
            for tok, count, child in kids:
                p = prob * count / total
                if p >= min_prob:
                    heapq.heappush(heap, (-p, order, tok, parent, child, depth + 1, count / total))
                    order += 1

        push(match, depth, -1, 1.0)
        while heap and len(tokens) < max_nodes:
            neg_p, _, tok, parent, child, child_depth, cond = heapq.heappop(heap)
            tokens.append(tok)
            parents.append(parent)
            conditional.append(cond)
            score -= neg_p
            push(child, child_depth, len(tokens) - 1, -neg_p)
        return tokens, parents, conditional, score


def NativeSuffixIndex(depth: int) -> SuffixIndex:
    """The C++ index (csrc/suffix_trie.cpp), the same trie and tree growth as `PySuffixIndex`."""
    ops.load()
    return cast(SuffixIndex, torch.classes.specserve.SuffixTrie(depth))


@dataclass
class _RequestIndex:
    """A request's own tokens, indexed as one sequence of `index`: how many, and the first and last
    ENDS of them (the prefix check)."""

    index: SuffixIndex
    seq: int = -1  # the sequence's id in `index` once started
    length: int = 0
    head: tuple[int, ...] = ()
    tail: tuple[int, ...] = ()
    last_call: int = 0

    ENDS: ClassVar[int] = 16

    def extends_to(self, tokens: tuple[int, ...]) -> bool:
        """Whether `tokens` continue what was indexed. Its first and last ENDS tokens are compared,
        not all of them (an O(length) copy and comparison a call, for every request every step): a
        request's tokens only grow, so this tells a reused request id or a rewritten history apart,
        and a wrong index could only cost drafts, never change an output (every draft is verified)."""
        n = self.length
        return (len(tokens) >= n and tokens[max(0, n - self.ENDS) : n] == self.tail
                and tokens[: min(n, self.ENDS)] == self.head)

    def extend(self, tokens: tuple[int, ...]) -> None:
        if len(tokens) > self.length:
            self.seq = self.index.extend(self.seq, list(tokens[self.length :]))
            if self.length < self.ENDS:
                self.head = tokens[: self.ENDS]
            self.length = len(tokens)
            self.tail = tokens[max(0, self.length - self.ENDS) :]


class SuffixDrafter(Drafter):
    """SuffixDecoding drafter (deterministic; `probs` is None). See the module docstring."""

    STALE_AFTER_CALLS: ClassVar[int] = 4096
    """Per-request state unused for this many `propose` calls is dropped (rebuilt if needed)."""

    def __init__(
        self,
        max_depth: int = 24,
        max_spec_factor: float = 1.0,
        min_prob: float = 0.1,
        max_cached_requests: int = 256,
        native: bool = True,
    ) -> None:
        self.config = SuffixConfig(max_depth, max_spec_factor, min_prob, max_cached_requests)
        # the C++ index, or the Python one it is tested against (same drafts, ~20x the time)
        self._new_index: Callable[[int], SuffixIndex] = NativeSuffixIndex if native else PySuffixIndex
        self._lock = threading.Lock()  # guards _requests (the dict), _global, _cached and _pending
        self._requests: dict[str, _RequestIndex] = {}
        self._global = self._new_index(self.config.trie_depth)
        self._cached: OrderedDict[str, int] = OrderedDict()  # outputs in the global index: their sequence ids
        self._pending: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # finished, not indexed yet
        self._calls = 0

    # Finished outputs are indexed when the drafter is next asked to propose, at most this many per
    # call: indexing one (every window of up to `trie_depth` tokens) costs milliseconds, and a step
    # that does not draft with suffix (the controller or the goodput guard says so) should not pay it.
    ABSORB_PER_CALL = 2

    # -- Drafter ------------------------------------------------------------------

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        self._calls += 1
        if self._calls % 256 == 0:
            self._drop_stale()
        self._absorb(self.ABSORB_PER_CALL)
        return [self._propose_one(r.view, r.budget) for r in requests]

    def finish(self, request_id: str, view: RequestView) -> None:
        output = tuple(view.output_token_ids)
        with self._lock:
            self._requests.pop(request_id, None)
            if self.config.max_cached_requests == 0 or not output:
                return
            old = self._cached.pop(request_id, None)
            if old is not None:
                self._global.remove(old)
            self._pending.pop(request_id, None)
            self._pending[request_id] = output
            self._evict()

    def _absorb(self, limit: int) -> None:
        """Index up to `limit` pending finished outputs in the global index, oldest first."""
        with self._lock:
            for _ in range(min(limit, len(self._pending))):
                request_id, output = self._pending.popitem(last=False)
                seq = self._global.extend(-1, list(output))
                self._global.close(seq)
                self._cached[request_id] = seq

    def _evict(self) -> None:
        """At most `max_cached_requests` outputs kept, indexed or pending: the oldest go first."""
        while len(self._cached) + len(self._pending) > self.config.max_cached_requests:
            if self._cached:
                _, evicted = self._cached.popitem(last=False)
                self._global.remove(evicted)
            else:
                self._pending.popitem(last=False)

    # -- introspection (tests, metrics) -----------------------------------------------

    @property
    def num_cached_requests(self) -> int:
        """Finished outputs kept for drafting (indexed, or waiting for the next proposal)."""
        with self._lock:
            return len(self._cached) + len(self._pending)

    @property
    def num_tracked_requests(self) -> int:
        with self._lock:
            return len(self._requests)

    # -- internals ------------------------------------------------------------------

    def _propose_one(self, view: RequestView, budget: int) -> DraftTree:
        if budget <= 0:
            return EMPTY_TREE
        tokens = view.token_ids
        if not tokens:
            return EMPTY_TREE
        c = self.config
        context = list(tokens[-c.max_depth :])
        own = self._request_index(view.request_id, tokens).index
        mine = own.speculate(context, c.max_depth, budget, c.max_spec_factor, c.min_prob)
        with self._lock:
            other = (self._global.speculate(context, c.max_depth, budget, c.max_spec_factor, c.min_prob)
                     if self._cached else None)
        # the higher score wins, the request's own on a tie; no match scores below 0
        tree_tokens, parents, conditional, score = mine if other is None or mine[3] >= other[3] else other
        if score < 0:
            return EMPTY_TREE
        return DraftTree(tuple(tree_tokens), tuple(parents), scores=tuple(conditional))

    def _request_index(self, request_id: str, tokens: tuple[int, ...]) -> _RequestIndex:
        with self._lock:
            index = self._requests.get(request_id)
        if index is None or not index.extends_to(tokens):
            index = _RequestIndex(self._new_index(self.config.trie_depth))
            with self._lock:
                self._requests[request_id] = index
        index.extend(tokens)
        index.last_call = self._calls
        return index

    def _drop_stale(self) -> None:
        oldest = self._calls - self.STALE_AFTER_CALLS
        with self._lock:
            for rid in [rid for rid, idx in self._requests.items() if idx.last_call < oldest]:
                del self._requests[rid]
