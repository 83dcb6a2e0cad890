"""Lookup drafters (prompt lookup / n-gram, SuffixDecoding) and the suffix index (C++ and its Python
reference): no models."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import pytest

from specserve.sampling_params import SamplingParams
from specserve.speculation.drafter import DraftRequest, RequestView
from specserve.speculation.drafters.ngram import NgramDrafter, continuation
from specserve.speculation.drafters.suffix import (
    NativeSuffixIndex,
    PySuffixIndex,
    SuffixConfig,
    SuffixDrafter,
    SuffixIndex,
    SuffixTrie,
)
from specserve.speculation.tree import EMPTY_TREE, DraftTree


def view(prompt: list[int], output: list[int] = (), rid: str = "r") -> RequestView:
    return RequestView(
        request_id=rid, prompt_token_ids=tuple(prompt), output_token_ids=tuple(output), params=SamplingParams()
    )


def propose(drafter, v: RequestView, budget: int) -> DraftTree:
    (tree,) = drafter.propose([DraftRequest(v, budget)])
    return tree


def check_tree(tree: DraftTree, budget: int) -> None:
    """The contract every drafter's tree must meet (DraftTree checks parent order itself)."""
    DraftTree(tree.tokens, tree.parents, tree.probs)
    assert len(tree) <= max(budget, 0)
    assert tree.probs is None
    siblings = Counter(zip(tree.parents, tree.tokens))
    assert all(n == 1 for n in siblings.values()), f"duplicate sibling tokens in {tree}"


def paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Root-to-leaf token paths of a tree."""
    out = []
    for i in range(len(tree)):
        if not tree.children(i):
            path, j = [], i
            while j >= 0:
                path.append(tree.tokens[j])
                j = tree.parents[j]
            out.append(tuple(reversed(path)))
    return out


# ---------------------------------------------------------------- n-gram


def test_ngram_proposes_continuation_of_most_recent_match():
    # Protects: the chain is what followed the most recent earlier occurrence of the tail.
    toks = [1, 2, 3, 10, 11, 9, 1, 2, 3, 20, 21, 9, 1, 2, 3]
    tree = propose(NgramDrafter(), view(toks), 3)
    assert tree == DraftTree.chain([20, 21, 9])


def test_ngram_longest_ngram_wins_over_more_recent_shorter_match():
    # Protects: n is tried from max_ngram down; a 3-gram match beats a more recent 1-gram match.
    toks = [5, 6, 7, 40, 41, 0, 7, 50, 51, 0, 5, 6, 7]
    assert propose(NgramDrafter(max_ngram=3), view(toks), 2).tokens == (40, 41)
    # With max_ngram=1 only the last token counts, so the most recent 7 wins.
    assert propose(NgramDrafter(max_ngram=1), view(toks), 2).tokens == (50, 51)


def test_ngram_budget_and_no_match():
    # Protects: budget 0 -> empty; budget k -> at most k nodes; nothing to look up -> empty.
    toks = [1, 2, 3, 4, 5, 6, 1, 2]
    d = NgramDrafter()
    assert propose(d, view(toks), 0) is EMPTY_TREE
    for k in range(1, 8):
        tree = propose(d, view(toks), k)
        check_tree(tree, k)
        assert 1 <= len(tree) <= k
    assert len(propose(d, view([1, 2, 3, 4]), 4)) == 0
    assert len(propose(d, view([7]), 4)) == 0
    assert len(propose(d, view([], [7]), 4)) == 0
    # min_ngram: a lone repeated token is not enough when 2-grams are required.
    assert len(propose(NgramDrafter(min_ngram=2), view([1, 8, 3, 4, 8]), 4)) == 0
    assert propose(NgramDrafter(min_ngram=2), view([1, 8, 3, 1, 8]), 2).tokens == (3, 1)


def test_ngram_matches_span_prompt_and_output():
    # Protects: lookup runs over prompt + output, the tail being the output's end.
    tree = propose(NgramDrafter(), view([4, 5, 6, 7, 8], [1, 4, 5]), 3)
    assert tree.tokens == (6, 7, 8)


def test_ngram_continuation_repeats_past_the_end():
    # Protects: a match overlapping the tail keeps copying with its lag (repetition loops
    # get full-length drafts), and the copy is exactly the periodic continuation.
    toks = [9, 1, 2, 3, 1, 2, 3, 1, 2]
    assert propose(NgramDrafter(), view(toks), 7).tokens == (3, 1, 2, 3, 1, 2, 3)
    assert continuation([0, 1, 2], 1, 5) == [1, 2, 1, 2, 1]
    assert continuation([0, 1, 2], 2, 3) == [2, 2, 2]
    assert continuation([0, 1, 2, 3], 1, 2) == [1, 2]


def test_ngram_width_gives_branches_where_continuations_differ():
    # Protects: max_width > 1 merges distinct continuations into one prefix tree; shared
    # prefixes share nodes; equally supported siblings list the most recent first.
    toks = [1, 2, 30, 31, 5, 1, 2, 40, 41, 6, 1, 2]
    tree = propose(NgramDrafter(max_width=2), view(toks), 4)
    check_tree(tree, 4)
    assert [tree.tokens[i] for i in tree.children(-1)] == [40, 30]
    assert set(paths(tree)) == {(40, 41), (30, 31)}
    # Width 1 on the same context is the most recent chain.
    assert propose(NgramDrafter(max_width=1), view(toks), 4).tokens == (40, 41, 6, 1)
    # Branching below a shared prefix: both continuations start with 7.
    toks = [1, 2, 7, 30, 5, 1, 2, 7, 40, 6, 1, 2]
    tree = propose(NgramDrafter(max_width=2), view(toks), 3)
    assert tree.tokens[0] == 7 and tree.parents[0] == -1
    assert sorted(tree.tokens[i] for i in tree.children(0)) == [30, 40]


def test_ngram_width_prefers_the_better_supported_continuation():
    # Protects: a continuation seen at more matches gets the budget (and first place) first.
    toks = [1, 2, 30, 1, 2, 30, 1, 2, 40, 1, 2]
    tree = propose(NgramDrafter(max_width=2), view(toks), 1)
    assert tree.tokens == (30,)
    tree = propose(NgramDrafter(max_width=3), view(toks), 8)
    check_tree(tree, 8)
    assert tree.tokens[0] == 30 and tree.children(-1)[:2] == [0, tree.tokens.index(40)]


def test_ngram_random_trees_are_valid():
    # Protects: every (context, budget, width) gives a valid tree within budget, and width 1
    # always a chain.
    rng = random.Random(0)
    for _ in range(300):
        toks = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        budget = rng.randrange(0, 10)
        width = rng.randrange(1, 5)
        d = NgramDrafter(max_ngram=rng.randrange(1, 5), max_width=width)
        tree = propose(d, view(toks), budget)
        check_tree(tree, budget)
        if width == 1:
            assert tree.parents == tuple(range(-1, len(tree) - 1))
        if len(tree) == 0 and budget > 0:
            assert toks[-1] not in toks[:-1]


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(min_ngram=0), "min_ngram"),
        (dict(max_ngram=1, min_ngram=2), "max_ngram"),
        (dict(max_width=0), "max_width"),
    ],
)
def test_ngram_validates_arguments(kwargs, field):
    with pytest.raises(ValueError, match=field):
        NgramDrafter(**kwargs)


# ---------------------------------------------------------------- suffix trie


def window_counts(seqs: list[list[int]], depth: int) -> Counter:
    counts: Counter = Counter()
    for seq in seqs:
        for s in range(len(seq)):
            for n in range(1, min(depth, len(seq) - s) + 1):
                counts[tuple(seq[s : s + n])] += 1
    return counts


def trie_counts(trie: SuffixTrie) -> Counter:
    counts: Counter = Counter()
    stack = [(trie.root, ())]
    while stack:
        cur, path = stack.pop()
        for tok, count, child in trie.children(cur, len(path)):
            counts[path + (tok,)] = count
            stack.append((child, path + (tok,)))
    return counts


def index_counts(index: SuffixIndex) -> Counter:
    """Every window's count, read through `SuffixIndex.children` (the native index's too)."""
    counts: Counter = Counter()
    stack: list[tuple[int, ...]] = [()]
    while stack:
        path = stack.pop()
        for tok, count in zip(*index.children(list(path))):
            counts[path + (tok,)] = count
            stack.append(path + (tok,))
    return counts


def test_suffix_trie_counts_every_window():
    # Protects: the path-compressed trie holds exactly the window counts of a plain bounded
    # suffix trie, built token by token, after add, and after remove (eviction).
    rng = random.Random(2)
    for _ in range(60):
        depth = rng.randrange(1, 7)
        seqs = [[rng.randrange(3) for _ in range(rng.randrange(0, 25))] for _ in range(3)]
        # incremental, as for a request's own tokens
        trie, grown, windows = SuffixTrie(depth), [], []
        for i, tok in enumerate(seqs[0]):
            grown.append(tok)
            windows = trie.push(grown, i, windows)
            assert trie_counts(trie) == window_counts([grown], depth)
        # whole sequences, as for the global cache, then evict some
        trie = SuffixTrie(depth)
        tuples = [tuple(s) for s in seqs]
        for t in tuples:
            trie.add(t)
        assert trie_counts(trie) == window_counts(seqs, depth)
        trie.remove(tuples[1])
        assert trie_counts(trie) == window_counts([seqs[0], seqs[2]], depth)
        trie.remove(tuples[0])
        trie.remove(tuples[2])
        assert trie_counts(trie) == Counter() and trie.root.children == {}


def test_suffix_trie_continues_exactly_where_it_has_children():
    # Protects: the match's check that a suffix occurred with a continuation (`continues`, which does
    # not list them) says what `children` says, at every pattern found, compressed nodes included.
    rng = random.Random(5)
    for _ in range(40):
        depth = rng.randrange(1, 7)
        trie = SuffixTrie(depth)
        for _ in range(3):
            trie.add(tuple(rng.randrange(3) for _ in range(rng.randrange(0, 20))))
        for _ in range(30):
            pattern = [rng.randrange(3) for _ in range(rng.randrange(0, depth + 1))]
            cur = trie.find(pattern)
            if cur is not None:
                assert trie.continues(cur, len(pattern)) == bool(trie.children(cur, len(pattern)))


def test_native_suffix_index_counts_every_window_and_forgets_removed_ones():
    # Protects: the C++ index holds exactly the window counts of a plain bounded suffix trie, built
    # token by token and in whole sequences, and after removals (eviction) nothing of a removed
    # sequence is left: the same property as the Python trie's above.
    rng = random.Random(12)
    for _ in range(60):
        depth = rng.randrange(1, 7)
        seqs = [[rng.randrange(3) for _ in range(rng.randrange(0, 25))] for _ in range(3)]
        index = NativeSuffixIndex(depth)
        grown: list[int] = []
        for tok in seqs[0]:
            grown.append(tok)
            index.extend(0 if len(grown) > 1 else -1, [tok])
            assert index_counts(index) == window_counts([grown], depth)
        index = NativeSuffixIndex(depth)
        ids = []
        for seq in seqs:
            ids.append(index.extend(-1, seq))
            index.close(ids[-1])
        assert index_counts(index) == window_counts(seqs, depth)
        index.remove(ids[1])
        assert index_counts(index) == window_counts([seqs[0], seqs[2]], depth)
        again = index.extend(-1, seqs[1])  # a freed sequence id and freed nodes are reused
        index.close(again)
        assert index_counts(index) == window_counts(seqs, depth)
        for seq_id in (ids[0], ids[2], again):
            index.remove(seq_id)
        assert index_counts(index) == Counter() and index.num_nodes() == 1


@pytest.mark.parametrize("alphabet", [3, 40])
def test_native_suffix_index_drafts_what_the_python_one_drafts(alphabet):
    # Protects: the C++ index is the Python reference node for node: the same match, the same
    # tree (tokens, parents, conditional probabilities) and the same score, on repetitive text
    # (3 tokens: deep trees, many expansions) and varied text, with sequences grown a few tokens at
    # a time, added whole, and removed, at random depths, budgets, factors and thresholds.
    rng = random.Random(alphabet)
    for _ in range(40):
        max_depth = rng.randrange(1, 9)
        factor = rng.choice([0.5, 1.0, 2.0, 3.0])
        depth = SuffixConfig(max_depth, factor).trie_depth
        native, python = NativeSuffixIndex(depth), PySuffixIndex(depth)
        ids: list[tuple[int, int]] = []
        own = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 10))]
        mine = (native.extend(-1, own), python.extend(-1, own))
        for _ in range(rng.randrange(2, 6)):
            seq = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 60))]
            ids.append((native.extend(-1, seq), python.extend(-1, seq)))
            native.close(ids[-1][0])
            python.close(ids[-1][1])
        for step in range(30):
            more = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 5))]
            native.extend(mine[0], more)
            python.extend(mine[1], more)
            own += more
            if step % 10 == 9 and ids:
                gone = ids.pop(rng.randrange(len(ids)))
                native.remove(gone[0])
                python.remove(gone[1])
            budget, min_prob = rng.randrange(0, 16), rng.choice([0.0, 0.05, 0.1, 0.3])
            context = own[-max_depth:] if rng.random() < 0.8 else [rng.randrange(alphabet) for _ in range(max_depth)]
            want = python.speculate(context, max_depth, budget, factor, min_prob)
            got = native.speculate(context, max_depth, budget, factor, min_prob)
            assert tuple(got) == tuple(want), (context, budget, factor, min_prob)
        assert index_counts(native) == index_counts(python)


def test_native_and_python_suffix_drafters_propose_the_same_trees():
    # Protects: the drafter over the C++ index proposes what it proposed over the Python trie,
    # through requests growing, finishing into the global cache, evictions and a rewritten history.
    rng = random.Random(21)
    native, python = SuffixDrafter(max_cached_requests=5), SuffixDrafter(max_cached_requests=5, native=False)
    base = [rng.randrange(30) for _ in range(40)]
    texts: dict[str, list[int]] = {}
    for i in range(300):
        rid = f"r{rng.randrange(8)}"
        text = texts.setdefault(rid, base[: rng.randrange(1, 10)] + [rng.randrange(30)])
        text += base[(k := rng.randrange(len(base))) : k + rng.randrange(0, 6)] + [rng.randrange(30)]
        if i % 50 == 49:
            text[0] += 1  # a rewritten history: re-indexed, not extended
            before = native._requests.get(rid)
        reqs = [DraftRequest(view(text[:3], text[3:], rid=rid), rng.randrange(0, 12))]
        assert native.propose(reqs) == python.propose(reqs)
        if i % 50 == 49:
            assert before is None or native._requests[rid] is not before
        if rng.random() < 0.15:
            for d in (native, python):
                d.finish(rid, view(text[:3], text[3:], rid=rid))
            del texts[rid]


# ---------------------------------------------------------------- suffix drafter


def test_suffix_proposes_from_own_history():
    # Protects: a repetitive request gets the continuation of its own earlier text.
    text = [3, 1, 4, 1, 5, 9, 2, 6, 8, 7]
    d = SuffixDrafter()
    tree = propose(d, view(text + [0] + text[:6]), 4)
    assert tree == DraftTree.chain([2, 6, 8, 7])
    # As the output grows the index follows it (incremental path).
    tree = propose(d, view(text + [0] + text[:6], [2, 6]), 2)
    assert tree.tokens == (8, 7)


def test_suffix_proposes_from_finished_requests():
    # Protects: a new request repeating an earlier request's output drafts it from the global
    # cache, which holds outputs (not prompts) of finished requests.
    d = SuffixDrafter()
    out = list(range(100, 130))
    d.finish("a", view([1, 2, 3], out, rid="a"))
    tree = propose(d, view([7, 8] + out[:10], rid="b"), 5)
    assert tree.tokens == tuple(out[10:15])
    assert len(propose(d, view([9, 1, 2, 3], rid="c"), 5)) == 0  # a's prompt is not cached


def test_suffix_global_cache_evicts_oldest():
    # Protects: the global cache never holds more than max_cached_requests outputs, the
    # oldest go first, and their statistics go with them.
    d = SuffixDrafter(max_cached_requests=3)
    outs = {f"q{i}": [1000 + 10 * i + j for j in range(10)] for i in range(5)}
    for rid, out in outs.items():
        d.finish(rid, view([0], out, rid=rid))
        assert d.num_cached_requests <= 3
    assert d.num_cached_requests == 3
    assert len(propose(d, view(outs["q0"][:4], rid="x"), 3)) == 0
    assert len(propose(d, view(outs["q1"][:4], rid="y"), 3)) == 0
    assert propose(d, view(outs["q4"][:4], rid="z"), 3).tokens == tuple(outs["q4"][4:7])
    assert index_counts(d._global) == window_counts([outs[f"q{i}"] for i in (2, 3, 4)], d.config.trie_depth)
    # Disabled cache keeps nothing.
    off = SuffixDrafter(max_cached_requests=0)
    off.finish("a", view([0], outs["q0"], rid="a"))
    assert off.num_cached_requests == 0


def test_suffix_drops_request_state_on_finish_and_rebuilds_on_change():
    # Protects: per-request indexes live only while the request does, and a request whose
    # tokens are not an extension of what was indexed is re-indexed, not mixed up.
    d = SuffixDrafter(max_cached_requests=0)
    propose(d, view([1, 2, 3, 1, 2], rid="a"), 2)
    propose(d, view([4, 5, 4], rid="b"), 2)
    assert d.num_tracked_requests == 2
    d.finish("a", view([1, 2, 3, 1, 2], rid="a"))
    assert d.num_tracked_requests == 1
    # "b" was [4, 5, 4]; now it is [4, 6, 7, 4, 6]: only the new tokens may be used.
    assert propose(d, view([4, 6, 7, 4, 6], rid="b"), 2).tokens == (7, 4)
    assert d.num_tracked_requests == 1
    assert index_counts(d._requests["b"].index) == window_counts([[4, 6, 7, 4, 6]], d.config.trie_depth)


def test_suffix_longer_match_allows_longer_proposal():
    # Protects: max_spec = match length * max_spec_factor, so longer matches draft more.
    d = SuffixDrafter()
    out = list(range(200, 240))
    d.finish("a", view([0], out, rid="a"))
    sizes = [len(propose(d, view([1] + out[:m], rid=f"m{m}"), 16)) for m in range(1, 12)]
    assert sizes == sorted(sizes) and sizes[0] == 1 and sizes[-1] == 11
    assert len(propose(SuffixDrafter(max_spec_factor=2.0), view([1, 2, 3, 1, 2]), 16)) == 3  # 2 * 2, cut by the text


def test_suffix_tree_branches_by_frequency():
    # Protects: greedy expansion by path probability: the more frequent continuation comes
    # first, rarer ones follow, and branches below min_prob are left out.
    hist = [1, 2, 30, 5, 1, 2, 30, 6, 1, 2, 40, 7, 8]  # after (1, 2): 30 twice, 40 once
    d = SuffixDrafter(max_spec_factor=4.0)
    tree = propose(d, view(hist + [1, 2]), 8)
    check_tree(tree, 8)
    assert [tree.tokens[i] for i in tree.children(-1)] == [30, 40]
    tree = propose(SuffixDrafter(max_spec_factor=4.0, min_prob=0.5), view(hist + [1, 2]), 8)
    assert 40 not in tree.tokens and tree.tokens[0] == 30


def test_suffix_budget_and_random_validity():
    # Protects: budget 0 -> empty, never more than budget nodes, valid trees without
    # duplicate siblings, across random contexts and a shared global cache.
    rng = random.Random(3)
    d = SuffixDrafter(max_depth=6, max_spec_factor=2.0, min_prob=0.0, max_cached_requests=4)
    for i in range(200):
        toks = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        budget = rng.randrange(0, 12)
        tree = propose(d, view(toks[:5], toks[5:], rid=f"r{i % 7}"), budget)
        check_tree(tree, budget)
        if budget == 0:
            assert tree is EMPTY_TREE
        if i % 3 == 0:
            d.finish(f"r{i % 7}", view(toks[:5], toks[5:], rid=f"r{i % 7}"))
    assert d.num_cached_requests <= 4


def test_suffix_concurrent_finish_while_proposing():
    # Protects: finish() from other threads (server aborts) while the engine thread proposes
    # neither crashes nor corrupts the global cache.
    d = SuffixDrafter(max_cached_requests=8)
    rng = random.Random(4)
    errors: list[BaseException] = []
    stop = threading.Event()

    def finisher(seed: int) -> None:
        r = random.Random(seed)
        try:
            i = 0
            while not stop.is_set():
                out = [r.randrange(6) for _ in range(r.randrange(1, 40))]
                d.finish(f"t{seed}-{i % 12}", view([0], out, rid=f"t{seed}-{i % 12}"))
                i += 1
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=finisher, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            reqs = [
                DraftRequest(view([rng.randrange(6) for _ in range(20)], rid=f"p{j}"), rng.randrange(0, 8))
                for j in range(4)
            ]
            for req, tree in zip(reqs, d.propose(reqs)):
                check_tree(tree, req.budget)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors
    assert d.num_cached_requests <= 8
    with d._lock:
        outs = [list(d._global.tail(seq, 1 << 30)) for seq in d._cached.values()]
    assert index_counts(d._global) == window_counts([list(o) for o in outs], d.config.trie_depth)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(max_depth=0), "max_depth"),
        (dict(max_spec_factor=0), "max_spec_factor"),
        (dict(min_prob=1.5), "min_prob"),
        (dict(max_cached_requests=-1), "max_cached_requests"),
    ],
)
def test_suffix_validates_arguments(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SuffixDrafter(**kwargs)
