"""Paged KV block allocation with reference counts and a prefix cache.

Every full block whose K/V has been computed is keyed by a chained hash of
(previous block's hash, this block's tokens). A later request whose prompt
starts with the same tokens takes those blocks instead of recomputing them
(the tokens are compared on a hit, so a hash collision cannot corrupt output).
A freed block keeps its hash and sits in the free list in LRU order, so the
free list doubles as the prefix cache: a block is forgotten only when it is
reused for something else.
"""

from __future__ import annotations

from collections import OrderedDict

from specserve.engine.sequence import Sequence


def chain_hash(prev: int | None, tokens: tuple[int, ...]) -> int:
    return hash((prev, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_kv_blocks: must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # hash -> block id
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    # -- queries ---------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def hash_of(self, block: int) -> int | None:
        """The prefix-cache hash of a registered block (None for one not in the cache)."""
        return self._hash[block]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Cached blocks holding a prefix of `token_ids`, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        found: list[int] = []
        prev: int | None = None
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = chain_hash(prev, tokens)
            block = self._cached.get(h)
            if block is None or self._tokens[block] != tokens:
                break
            found.append(block)
            prev = h
        return found

    def can_admit(self, cached: list[int], num_tokens: int) -> bool:
        """Whether a new sequence reusing `cached` blocks can get blocks for `num_tokens` slots."""
        reclaimed = sum(1 for b in cached if self._ref[b] == 0)  # cached blocks sitting in the free list
        return self.blocks_needed(num_tokens) - len(cached) + reclaimed <= len(self._free)

    # -- changes ---------------------------------------------------------
    def admit(self, seq: Sequence, cached: list[int]) -> None:
        """Give `seq` the prefix-cache blocks found by `match_prefix` and mark their tokens computed."""
        assert not seq.block_table, "admit() is for sequences without blocks"
        prev: int | None = None
        for b in cached:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1
            seq.block_table.append(b)
            prev = self._hash[b]
            seq.block_hashes.append(prev)  # type: ignore[arg-type]
        seq.num_computed_tokens = len(cached) * self.block_size
        if self.enable_prefix_caching:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += seq.num_computed_tokens

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow `seq`'s block table to hold `num_tokens` slots. All or nothing."""
        need = self.blocks_needed(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        for _ in range(need):
            seq.block_table.append(self._take_free())
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release `seq`'s tail blocks beyond those needed for `num_tokens` slots (e.g. slots that
        held rejected draft tokens)."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            b = seq.block_table.pop()
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._release(b)

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publish every newly completed block of `seq` (K/V computed) to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        while len(seq.block_hashes) < num_full:
            i = len(seq.block_hashes)
            tokens = tuple(seq.token_slice(i * bs, (i + 1) * bs))
            h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else None, tokens)
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            if h not in self._cached and self._hash[block] is None:
                self._cached[h] = block
                self._hash[block] = h
                self._tokens[block] = tokens

    def free(self, seq: Sequence) -> None:
        """Release all of `seq`'s blocks (`_release`): cached ones to the free list's end, tail first,
        so that its prefix is evicted last; uncached ones to the front, taken next."""
        for b in reversed(seq.block_table):
            self._ref[b] -= 1
            assert self._ref[b] >= 0, f"block {b} freed twice"
            if self._ref[b] == 0:
                self._release(b)
        seq.block_table = []
        seq.block_hashes = []

    def _release(self, block: int) -> None:
        """Into the free list: a block in the prefix cache at the end (evicted last, in LRU order), one
        holding nothing cached at the front, taken next. A decode's draft reservation is taken and
        trimmed step after step; sent to the end, each step's reservation took another block from
        the front, so that over a batch's life the requests' blocks came from all over the cache,
        and the forwards of plain steps at batch 8 on the bundled model took 2-3% longer
        (BENCHMARKS.md, session 18). Reused first, they also leave cached prefixes alone."""
        self._free[block] = None
        if self._hash[block] is None:
            self._free.move_to_end(block, last=False)

    def _take_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        h = self._hash[block]
        if h is not None:
            if self._cached.get(h) == block:
                del self._cached[h]
            self._hash[block] = None
            self._tokens[block] = None
        self._ref[block] = 1
        return block
