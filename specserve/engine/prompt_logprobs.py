"""Prompt logprobs kept beside the prefix cache, so a scoring request that shares a prefix with an
earlier one reads the prefix's K/V and its logprobs instead of recomputing them.

Cached K/V holds no logits, so without this a request that asks for prompt logprobs computes its
whole prompt. The store is keyed like the prefix cache, by the chained hash of a full block (its
tokens and every token before it): the logprob of a token depends only on the tokens up to it, so a
block's entries are exact for any request whose prompt has that block chain. A block holds the
entries of its own tokens but its first, which the previous block's last row predicts; that one
(the "boundary" entry) is keyed by the previous block's hash and the token itself, since it differs
between prompts that part at a block edge. A request uses as many leading cached blocks as have
their entries, with at least as many alternatives as it asks for, and the boundary entry of the
first token it computes. Bounded: least recently used blocks are dropped first.
"""

from __future__ import annotations

from collections import OrderedDict

from specserve.engine.sequence import Sequence
from specserve.outputs import TokenLogprob


class PromptLogprobStore:
    def __init__(self, block_size: int, capacity: int) -> None:
        """capacity: blocks whose entries are kept (the boundary entries as many again)."""
        self.block_size = block_size
        self.capacity = max(1, capacity)
        self._inner: OrderedDict[int, tuple[int, tuple[TokenLogprob, ...]]] = OrderedDict()  # hash -> (k, entries)
        self._boundary: OrderedDict[tuple[int, int], tuple[int, TokenLogprob]] = OrderedDict()  # (hash, token) -> (k, entry)

    def save(self, seq: Sequence) -> None:
        """Keep the entries of `seq`'s registered full prompt blocks that its prompt logprobs cover."""
        bs, k, lps = self.block_size, seq.params.prompt_logprobs, seq.prompt_logprobs
        if k is None:
            return
        prompt = seq.prompt_token_ids
        for i, h in enumerate(seq.block_hashes):
            end = (i + 1) * bs  # the block holds positions i*bs .. end-1; entry q-1 is position q's
            if end > len(prompt) or len(lps) < end - 1:
                break
            if self._inner.get(h, (-1,))[0] < k:
                self._inner[h] = (k, tuple(lps[i * bs : end - 1]))
            self._inner.move_to_end(h)
            if end < len(prompt) and len(lps) >= end:
                key = (h, prompt[end])
                if self._boundary.get(key, (-1,))[0] < k:
                    self._boundary[key] = (k, lps[end - 1])
                self._boundary.move_to_end(key)
        while len(self._inner) > self.capacity:
            self._inner.popitem(last=False)
        while len(self._boundary) > self.capacity:
            self._boundary.popitem(last=False)

    def prefix(self, seq: Sequence, hashes: list[int]) -> tuple[int, list[TokenLogprob]]:
        """How many of the leading cached blocks (`hashes`, in order) `seq` can use, and the prompt
        logprobs they give it (positions 1 .. n * block_size, top alternatives cut to its k)."""
        k = seq.params.prompt_logprobs
        if k is None:
            return 0, []
        bs, prompt = self.block_size, seq.prompt_token_ids
        n = 0  # a block is usable with its own entries and the next token's (its last row's prediction)
        while (n < len(hashes) and (n + 1) * bs < len(prompt) and self._inner.get(hashes[n], (-1,))[0] >= k
               and self._boundary.get((hashes[n], prompt[(n + 1) * bs]), (-1,))[0] >= k):
            n += 1
        entries: list[TokenLogprob] = []
        for i in range(n):
            entries.extend(self._inner[hashes[i]][1])
            entries.append(self._boundary[(hashes[i], prompt[(i + 1) * bs])][1])
        return n, [TokenLogprob(e.token_id, e.logprob, e.top[:k], e.rank) for e in entries]
