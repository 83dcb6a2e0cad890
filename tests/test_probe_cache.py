"""The forward probes kept across starts (specserve.engine.drafting.ProbeCache): a later engine on
the same machine, model and cache layout uses the kept costs after a short check, probes again
where the check fails or nothing readable is kept, and never takes another model's costs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specserve.engine.drafting import CHECK_SIZES, PROBE_SIZES, ProbeCache, forward_costs, probe_key
from specserve.entrypoints.llm import LLM


def _counting(runner) -> list[int]:
    """Every forward the runner makes from now, by its number of new tokens."""
    sizes: list[int] = []
    run = runner.run

    def counted(items, *args, **kwargs):
        sizes.append(sum(len(item.tokens) for item in items))
        return run(items, *args, **kwargs)

    runner.run = counted
    return sizes


@pytest.fixture(scope="module")
def runner(tiny_llama: Path):
    return LLM(str(tiny_llama), speculative="none", max_model_len=256).engine.core.runner


def _costs(runner, cache: ProbeCache):
    return forward_costs(runner, runner.kv_cache[0][0].shape[0], 128, 255, cache)


def test_kept_costs_are_used_after_a_check_of_two_sizes(runner, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import specserve.engine.drafting as drafting

    monkeypatch.setattr(drafting, "CHECK_FASTER", 100.0)  # a tiny model's timings are noise: any check passes
    monkeypatch.setattr(drafting, "CHECK_SLOWER", 100.0)
    cache = ProbeCache(tmp_path / "probes.json")
    first, how = _costs(runner, cache)
    assert how == "probed" and set(first.seconds) == set(PROBE_SIZES)
    sizes = _counting(runner)
    try:
        again, how = _costs(runner, cache)
    finally:
        del runner.run
    assert how.startswith("kept") and set(sizes) == set(CHECK_SIZES)  # only the check ran
    assert again == first and cache.recall(probe_key(runner, 128, 255)) == first  # used, and left as kept


def test_kept_costs_that_fail_the_check_are_probed_again_and_replaced(runner, tmp_path: Path) -> None:
    path = tmp_path / "probes.json"
    cache = ProbeCache(path)
    _costs(runner, cache)
    data = json.loads(path.read_text())
    (key, entry), = data.items()
    entry["seconds"] = {n: s * 50 for n, s in entry["seconds"].items()}  # far from what this machine does
    path.write_text(json.dumps(data))
    sizes = _counting(runner)
    try:
        costs, how = _costs(runner, cache)
    finally:
        del runner.run
    assert how == "probed" and set(PROBE_SIZES) <= set(sizes)
    kept = cache.recall(key)
    assert kept == costs and all(kept.seconds[n] < s for n, s in
                                 ((int(n), s) for n, s in entry["seconds"].items()))


@pytest.mark.parametrize("factor, kept", [(1.3, True), (1.45, True), (0.95, True), (0.85, False), (1.6, False)])
def test_a_slower_check_is_noise_and_a_faster_one_means_probing_again(runner, tmp_path: Path, factor: float,
                                                                      kept: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy moment only slows a measurement: a check up to 50% slower than the kept costs keeps
    them; one more than 10% faster (kept in a slow moment, or the machine changed) probes again.
    The forwards are timed by a stand-in here, so that the rule is what is tested."""
    import specserve.engine.drafting as drafting

    cache = ProbeCache(tmp_path / "probes.json")
    key = probe_key(runner, 128, 255)
    stored = drafting.ForwardCosts({n: 0.001 * n for n in PROBE_SIZES}, 1e-7, 2e-7)
    cache.remember(key, stored)
    fresh = {n: 0.0005 * n for n in PROBE_SIZES}
    checked: list[tuple[int, ...]] = []

    def probe(runner, num_blocks, max_tokens, sizes=PROBE_SIZES, tries_small=4):
        checked.append(tuple(sizes))
        return {n: (stored.seconds[n] * factor if sizes == CHECK_SIZES else fresh[n]) for n in sizes}

    monkeypatch.setattr(drafting, "probe_forward", probe)
    monkeypatch.setattr(drafting, "probe_attention", lambda *a, **k: (3e-7, 4e-7))
    costs, how = _costs(runner, cache)
    assert checked[0] == CHECK_SIZES
    if kept:
        assert how.startswith("kept") and checked == [CHECK_SIZES]
        assert costs == stored  # the profile's shape is not bent by the checked sizes
    else:
        assert how == "probed" and costs == drafting.ForwardCosts(fresh, 3e-7, 4e-7)
    assert cache.recall(key) == costs


@pytest.mark.parametrize("content", ["{not json", "[]", '{"%s": {"seconds": 3}}'])
def test_an_unreadable_cache_is_no_cache(runner, tmp_path: Path, content: str) -> None:
    path = tmp_path / "probes.json"
    path.write_text(content.replace("%s", probe_key(runner, 128, 255)))
    costs, how = _costs(runner, ProbeCache(path))
    assert how == "probed" and ProbeCache(path).recall(probe_key(runner, 128, 255)) == costs


def test_the_key_is_the_models_shapes_and_kernels_not_its_instance(runner, tiny_llama: Path,
                                                                   tiny_qwen2: Path) -> None:
    same = LLM(str(tiny_llama), speculative="none", max_model_len=256).engine.core.runner
    assert probe_key(same, 128, 255) == probe_key(runner, 128, 255)
    assert probe_key(runner, 64, 255) != probe_key(runner, 128, 255) != probe_key(runner, 128, 127)
    other = LLM(str(tiny_qwen2), speculative="none", max_model_len=256).engine.core.runner
    assert probe_key(other, 128, 255) != probe_key(runner, 128, 255)
    longer = LLM(str(tiny_llama), speculative="none", max_model_len=512).engine.core.runner
    assert probe_key(longer, 128, 255) != probe_key(runner, 128, 255)  # its RoPE table: another model's tensors


def test_weights_in_2mb_pages_are_another_key(runner, tiny_llama: Path) -> None:
    """The same model with its weights moved into one 2 MB-page arena runs at another speed (1.1x
    on the 1.5B): its probes are not the 4 KB-page model's."""
    from specserve.model.huge_pages import huge_pages_available

    if not huge_pages_available():
        pytest.skip("no transparent huge pages on this system")
    moved = LLM(str(tiny_llama), speculative="none", max_model_len=256, huge_pages=True).engine.core.runner
    assert probe_key(moved, 128, 255) != probe_key(runner, 128, 255)
