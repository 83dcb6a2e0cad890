"""Which engine replica takes a request: the one most likely to hold its prompt's prefix (and so its
conversation's earlier turns, in the prefix cache and in the suffix drafter's cache), unless that
one is loaded well above the others; else the least loaded.

The router cannot see the replicas' caches; it keeps its own index of what it sent where. A prompt
is cut into blocks and each block's key hashes the block and every block before it (so a key
stands for a whole prefix, as the engine's prefix cache keys its KV blocks). A replica "holds"
the keys of the prompts routed to it, most recent first, up to a bound; a restarted replica holds
none. Prompts are keyed by their token ids (a chat's, through the template: a conversation's later
turns extend its earlier turns' ids, as they extend its KV blocks); the router also takes text.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

ROUTING_POLICIES = ("affinity", "round-robin", "least-loaded")


@dataclass(frozen=True)
class RoutingConfig:
    """policy: affinity (prefix match bounded by load), round-robin or least-loaded.
    block_bytes: prompt bytes per routing block (text as UTF-8, token ids as 4 bytes each).
    balance_abs, balance_rel: affinity gives way when the preferred replica has more requests in
    flight than the least loaded one plus max(balance_abs, balance_rel x that one's).
    max_keys_per_replica: prefix keys remembered per replica (least recently routed dropped first).
    max_prompt_blocks: blocks of a prompt looked at (a longer prompt routes by its beginning)."""

    policy: str = "affinity"
    block_bytes: int = 256
    balance_abs: int = 4
    balance_rel: float = 0.5
    max_keys_per_replica: int = 1 << 16
    max_prompt_blocks: int = 512

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy: must be one of {', '.join(ROUTING_POLICIES)}, got {self.policy!r}")
        for name in ("block_bytes", "max_keys_per_replica", "max_prompt_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.balance_abs < 0:
            raise ValueError(f"balance_abs: must be >= 0, got {self.balance_abs}")
        if self.balance_rel < 0:
            raise ValueError(f"balance_rel: must be >= 0, got {self.balance_rel}")


def prefix_keys(prompt: str | Sequence[int], config: RoutingConfig) -> list[bytes]:
    """The keys of the prompt's whole blocks; key i stands for blocks 0..i."""
    data = prompt.encode() if isinstance(prompt, str) else b"".join(int(t).to_bytes(4, "little") for t in prompt)
    size = config.block_bytes
    n = min(len(data) // size, config.max_prompt_blocks)
    keys: list[bytes] = []
    key = b""
    for i in range(n):
        key = hashlib.blake2b(key + data[i * size:(i + 1) * size], digest_size=12).digest()
        keys.append(key)
    return keys


class PrefixIndex:
    """Per replica: the prefix keys routed to it, least recently used first (bounded)."""

    def __init__(self, num_replicas: int, capacity: int) -> None:
        self._held: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_replicas)]
        self._capacity = capacity

    def matched(self, keys: Sequence[bytes]) -> list[int]:
        """For each replica, how many leading keys it holds."""
        out = []
        for held in self._held:
            n = 0
            while n < len(keys) and keys[n] in held:
                n += 1
            out.append(n)
        return out

    def add(self, replica: int, keys: Sequence[bytes]) -> None:
        held = self._held[replica]
        for key in reversed(keys):  # a chain is matched from its first key: keep that one longest
            held[key] = None
            held.move_to_end(key)
        while len(held) > self._capacity:
            held.popitem(last=False)

    def forget(self, replica: int) -> None:
        self._held[replica].clear()

    def size(self, replica: int) -> int:
        return len(self._held[replica])


@dataclass(frozen=True)
class Decision:
    """replica: where the request goes; reason: affinity (the longest prefix match), overloaded (the
    best match was loaded well above the others: least loaded instead), least-loaded (nothing
    matched, or that policy), round-robin; matched: prompt blocks the chosen replica holds."""

    replica: int
    reason: str
    matched: int


class Router:
    """Chooses replicas for requests; remembers which prefixes went where. Not thread-safe (one
    event loop owns it)."""

    def __init__(self, config: RoutingConfig, num_replicas: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"replicas: must be >= 1, got {num_replicas}")
        self.config = config
        self.num_replicas = num_replicas
        self._index = PrefixIndex(num_replicas, config.max_keys_per_replica)
        self._next = 0  # round-robin position, also the tie-break rotation of least-loaded

    def keys(self, prompt: str | Sequence[int]) -> list[bytes]:
        return prefix_keys(prompt, self.config)

    def choose(self, keys: Sequence[bytes], loads: Sequence[int], usable: Sequence[bool]) -> Decision | None:
        """The replica for a request with these prefix keys, given each replica's requests in flight
        and whether it can take requests; None when none can."""
        candidates = [i for i in range(self.num_replicas) if usable[i]]
        if not candidates:
            return None
        policy = self.config.policy
        if policy == "round-robin":
            for step in range(self.num_replicas):
                i = (self._next + step) % self.num_replicas
                if usable[i]:
                    self._next = (i + 1) % self.num_replicas
                    return Decision(i, "round-robin", self._index.matched(keys)[i] if keys else 0)
        matched = self._index.matched(keys) if keys else [0] * self.num_replicas
        order = candidates[self._next % len(candidates):] + candidates[:self._next % len(candidates)]
        self._next += 1
        least = min(order, key=lambda i: (loads[i], -matched[i]))
        if policy == "least-loaded":
            return Decision(least, "least-loaded", matched[least])
        best = max(order, key=lambda i: (matched[i], -loads[i]))
        if matched[best] == 0:
            return Decision(least, "least-loaded", matched[least])
        floor = loads[least]
        if loads[best] - floor <= max(self.config.balance_abs, self.config.balance_rel * floor):
            return Decision(best, "affinity", matched[best])
        return Decision(least, "overloaded", matched[least])

    def routed(self, replica: int, keys: Sequence[bytes]) -> None:
        """The request went to `replica`: it will hold these prefixes."""
        self._index.add(replica, keys)

    def forget(self, replica: int) -> None:
        """The replica restarted: its caches are empty."""
        self._index.forget(replica)

    def keys_held(self, replica: int) -> int:
        return self._index.size(replica)
