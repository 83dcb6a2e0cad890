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

Cost per step and request: indexing a new token touches only the windows still
inside repeated text (at most D, usually a few); the match is a binary search
over suffix lengths, O(max_depth * log max_depth) dict lookups; growing the tree
is O(max_spec * log) heap operations: well under 0.1 ms a request. A request's
first call indexes its whole prompt: about 1 microsecond a token for ordinary
text, 4 for highly repetitive text (4k tokens: 3-18 ms). Text that repeats
earlier text expands up to D - 1 nodes a token, whose allocations can bring on
Python's cyclic GC (it is the allocation, not the index, that costs then).

Threading: `finish` may run concurrently with `propose`; `propose` itself must
not run concurrently with itself (the engine calls it from one thread). Per
request state that `finish` could not drop (a request proposed for once more
after it finished) is dropped after `STALE_AFTER_CALLS` calls without use.
"""

from __future__ import annotations

import heapq
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import ClassVar, Union

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


@dataclass
class _RequestIndex:
    trie: SuffixTrie
    seq: list[int] = field(default_factory=list)
    windows: list[Window] = field(default_factory=list)
    last_call: int = 0

    def extend(self, tokens: tuple[int, ...]) -> None:
        for i in range(len(self.seq), len(tokens)):
            self.seq.append(tokens[i])
            self.windows = self.trie.push(self.seq, i, self.windows)


@dataclass
class _Candidate:
    tokens: list[int]
    parents: list[int]
    score: float
    conditional: list[float] = field(default_factory=list)  # per node: count / count of its siblings' parent


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
    ) -> None:
        self.config = SuffixConfig(max_depth, max_spec_factor, min_prob, max_cached_requests)
        self._lock = threading.Lock()  # guards _requests (the dict), _global, _cached and _pending
        self._requests: dict[str, _RequestIndex] = {}
        self._global = SuffixTrie(self.config.trie_depth)
        self._cached: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # outputs in the global index
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
                self._global.add(output)
                self._cached[request_id] = output

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
        own = self._speculate(self._request_index(view.request_id, tokens).trie, tokens, budget)
        with self._lock:
            other = self._speculate(self._global, tokens, budget) if self._cached else None
        best = own if other is None or (own is not None and own.score >= other.score) else other
        if best is None:
            return EMPTY_TREE
        return DraftTree(tuple(best.tokens), tuple(best.parents), scores=tuple(best.conditional))

    def _request_index(self, request_id: str, tokens: tuple[int, ...]) -> _RequestIndex:
        with self._lock:
            index = self._requests.get(request_id)
        n = 0 if index is None else len(index.seq)
        if index is None or len(tokens) < n or tokens[:n] != tuple(index.seq):
            index = _RequestIndex(SuffixTrie(self.config.trie_depth))
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

    def _speculate(self, trie: SuffixTrie, tokens: tuple[int, ...], budget: int) -> _Candidate | None:
        """Match the longest suffix of `tokens` with a continuation in `trie`, then grow a tree."""
        # A suffix that occurred with a continuation implies every shorter one did: binary search.
        lo, hi = 0, min(self.config.max_depth, len(tokens))
        match: Cursor | None = None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            cur = trie.find(tokens[len(tokens) - mid :])
            if cur is not None and trie.continues(cur, mid):
                lo, match = mid, cur
            else:
                hi = mid - 1
        if match is None:
            return None
        max_spec = min(budget, max(1, int(lo * self.config.max_spec_factor)))
        return self._grow(trie, match, lo, max_spec)

    def _grow(self, trie: SuffixTrie, match: Cursor, depth: int, max_nodes: int) -> _Candidate:
        out = _Candidate([], [], 0.0)
        heap: list[tuple[float, int, int, int, Cursor, int, float]] = []
        order = 0

        def push(cur: Cursor, depth: int, parent: int, prob: float) -> None:
            nonlocal order
            total, kids = trie.frequent_children(cur, depth, self.config.min_prob / prob)
            for tok, count, child in kids:
                p = prob * count / total
                if p >= self.config.min_prob:
                    heapq.heappush(heap, (-p, order, tok, parent, child, depth + 1, count / total))
                    order += 1

        push(match, depth, -1, 1.0)
        while heap and len(out.tokens) < max_nodes:
            neg_p, _, tok, parent, child, child_depth, conditional = heapq.heappop(heap)
            out.tokens.append(tok)
            out.parents.append(parent)
            out.conditional.append(conditional)
            out.score -= neg_p
            push(child, child_depth, len(out.tokens) - 1, -neg_p)
        return out
