"""Block accounting: reference counts, the prefix cache (chained hashes, token check), LRU reuse."""

from __future__ import annotations

import pytest

from specserve.engine import block_manager as bm_module
from specserve.engine.block_manager import BlockManager
from specserve.engine.sequence import Sequence
from specserve.sampling_params import SamplingParams


def seq(tokens: list[int], name: str = "s") -> Sequence:
    return Sequence(name, list(tokens), SamplingParams(), 0.0, max_total_len=len(tokens) + 8)


def compute_all(bm: BlockManager, s: Sequence) -> None:
    """Pretend the forward ran over every token of `s`."""
    assert bm.allocate(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.register_full_blocks(s)


def test_allocate_is_all_or_nothing_and_free_returns_everything() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(list(range(10)))
    assert bm.allocate(a, 10) and len(a.block_table) == 3
    b = seq(list(range(8)), "b")
    assert not bm.allocate(b, 8)  # needs 2, only 1 free: nothing taken
    assert b.block_table == [] and bm.num_free_blocks == 1
    bm.free(a)
    assert bm.num_free_blocks == 4 and a.block_table == []


def test_prefix_hit_shares_blocks_with_refcounts() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(10)))
    compute_all(bm, a)  # blocks for tokens 0-3 and 4-7 are full and cached
    b = seq(list(range(9)) + [99], "b")
    hit = bm.match_prefix(b.token_ids())
    assert hit == a.block_table[:2]
    assert bm.can_admit(hit, b.num_tokens)
    bm.admit(b, hit)
    assert b.num_computed_tokens == 8
    bm.free(a)
    assert bm.num_free_blocks == 8 - 2  # the two shared blocks are still held by b
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_last_token_is_never_served_from_cache() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(8)))
    compute_all(bm, a)
    bm.free(a)
    assert len(bm.match_prefix(list(range(8)))) == 1  # the block holding the last token is recomputed
    assert len(bm.match_prefix(list(range(9)))) == 2


def test_freed_blocks_stay_cached_until_reused_lru() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5])
    compute_all(bm, a)
    bm.free(a)
    assert len(bm.match_prefix([1, 2, 3, 4, 9])) == 2  # still cached after free
    filler = seq([7, 7], "f")
    assert bm.allocate(filler, 2)  # takes the least recently freed block: one never used by a
    assert len(bm.match_prefix([1, 2, 3, 4, 9])) == 2
    filler2 = seq([8] * 6, "g")
    assert bm.allocate(filler2, 6)  # now the cached blocks must be recycled
    assert bm.match_prefix([1, 2, 3, 4, 9]) == []


def test_hash_collision_is_caught_by_token_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bm_module, "chain_hash", lambda prev, tokens: 42)  # every block collides
    bm = BlockManager(num_blocks=8, block_size=2)
    a = seq([1, 2, 3])
    compute_all(bm, a)
    assert bm.match_prefix([5, 6, 7]) == []  # same hash, different tokens: no hit
    assert len(bm.match_prefix([1, 2, 7])) == 1


def test_prefix_caching_off_never_hits() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = seq([1, 2, 3, 4, 5])
    compute_all(bm, a)
    assert bm.match_prefix([1, 2, 3, 4, 5]) == []


def test_double_free_is_detected() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    a = seq([1, 2])
    assert bm.allocate(a, 2)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(AssertionError):
        bm.free(a)


def test_drafts_never_preempt_another_request() -> None:
    """Draft slots come only from blocks left after every running request has its own: a request
    whose next token needs a new block is not preempted because an earlier one asked for drafts."""
    from specserve.config import SchedulerConfig
    from specserve.engine.scheduler import Scheduler

    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm, draft_budget=lambda s: 8)
    a, b = seq([1, 2, 3], "a"), seq([5, 6, 7, 8], "b")
    for s in (a, b):
        sched.add(s)
    sched.schedule()  # prefill both: a holds 1 block, b holds 1 block
    for s in (a, b):
        s.num_computed_tokens = s.num_tokens
        s.output_token_ids.append(9)  # each now decodes its sampled token
    out = sched.schedule()
    assert out.preempted == () and len(out.scheduled) == 2
    # b's next token takes a second block first; a's drafts get the one block left (4 slots) and
    # b's drafts the rest of its own new block (3 slots): grants shrink to fit, nobody is evicted.
    assert [i.draft_budget for i in out.scheduled] == [4, 3]
    assert bm.num_free_blocks == 0


def test_drafts_leave_waiting_prompts_half_the_budget() -> None:
    """Drafts are granted before waiting requests are admitted; while one waits they take at most
    half the token budget left, so a small budget cannot be spent on drafts step after step while a
    prompt waits (with none waiting they may take all of it)."""
    from specserve.config import SchedulerConfig
    from specserve.engine.scheduler import Scheduler

    def four_decoding() -> Scheduler:
        sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8),
                          BlockManager(num_blocks=64, block_size=4), draft_budget=lambda s: 8)
        running = [seq([1, 2, 3], f"r{i}") for i in range(4)]
        for s in running:
            sched.add(s)
        sched.schedule()  # the four prompts: 12 tokens
        for s in running:
            s.num_computed_tokens = s.num_tokens
            s.output_token_ids.append(9)
        return sched

    assert sum(i.draft_budget for i in four_decoding().schedule().scheduled) == 16 - 4  # nobody waiting: all of it
    sched = four_decoding()
    late = seq([5, 6, 7, 8, 9, 10, 11, 12], "late")
    sched.add(late)
    out = sched.schedule()
    drafts = sum(i.draft_budget for i in out.scheduled)
    assert drafts == (16 - 4) // 2, drafts
    assert [i.num_new_tokens for i in out.scheduled if i.seq is late] == [16 - 4 - drafts]


def test_no_drafts_while_prompts_wait_behind_a_large_batch() -> None:
    """While a request waits to be admitted and `admitting_max_decodes` (the engine's:
    `Speculator.LATENCY_ROWS`) or more are scheduled, no decode gets draft slots (the prompt gets the
    budget); one fewer, they may take half of it."""
    from specserve.config import SchedulerConfig
    from specserve.engine.scheduler import Scheduler

    def drafts_with(decoding: int) -> tuple[int, int]:
        sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=32),
                          BlockManager(num_blocks=256, block_size=4), draft_budget=lambda s: 8,
                          admitting_max_decodes=n)
        running = [seq([1, 2, 3], f"r{i}") for i in range(decoding)]
        for s in running:
            sched.add(s)
        while sched.waiting:
            sched.schedule()
        for s in running:
            s.num_computed_tokens = s.num_tokens
            s.output_token_ids.append(9)
        late = seq(list(range(1, 41)), "late")
        sched.add(late)
        out = sched.schedule()
        return sum(i.draft_budget for i in out.scheduled), sum(i.num_new_tokens for i in out.scheduled if i.seq is late)

    n = 16
    assert drafts_with(n) == (0, 40)
    assert drafts_with(n - 1) == ((64 - (n - 1)) // 2, 64 - (n - 1) - (64 - (n - 1)) // 2)


def test_a_trimmed_reservation_is_reused_first_and_cached_blocks_last() -> None:
    """A block released holding nothing cached (a draft reservation trimmed after its step) is the
    next one taken: step after step, a decode's reservation comes back to the same block instead of
    walking the whole cache (which slowed plain forwards by 2-3%), and cached prefixes outlive it."""
    bm = BlockManager(num_blocks=8, block_size=2)
    cached = seq([1, 2, 3, 4, 5], "cached")
    compute_all(bm, cached)
    bm.free(cached)  # two cached blocks, one uncached tail, all free
    a = seq([7, 7, 7], "a")
    assert bm.allocate(a, 3)
    taken = set(a.block_table)
    for _ in range(5):  # reserve 4 draft slots beyond the next token, then trim them, as each step does
        assert bm.allocate(a, 3 + 1 + 4)
        reserved = set(a.block_table[2:])
        bm.trim(a, 3 + 1)
        taken |= reserved
    assert len(taken) <= 5, taken  # the same reservation blocks every step
    assert len(bm.match_prefix([1, 2, 3, 4, 9])) == 2  # the cached prefix survived the churn
    other = seq([8] * 8, "o")
    assert bm.allocate(other, 8)  # four blocks of the six free: the uncached ones go first
    assert len(bm.match_prefix([1, 2, 3, 4, 9])) == 2
