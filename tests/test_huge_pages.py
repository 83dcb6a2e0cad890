"""Weights in 2 MB pages (specserve.model.huge_pages). Moved at load (`huge_pages="load"`): the model
computes exactly what it computed where its weights loaded, every weight lies in the one mapping
advised MADV_HUGEPAGE, and what was shared (a tied head, views of one tensor) stays shared, not copied
twice. Collapsed in place (the default, "auto"): every region holding a weight byte is asked for,
once; the weights stay where they are and compute the same; a kernel that refuses changes nothing."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from torch import nn

from specserve import LLM, SamplingParams
from specserve.entrypoints.engine_args import EngineArgs
from specserve.model import huge_pages
from specserve.model.forward import ForwardItem
from specserve.model.huge_pages import (HUGE_PAGE, PageCollapse, collapse_regions, huge_pages_available,
                                        into_huge_pages, weights)

from conftest import random_prompts
from gguf_fixtures import write_model

needs_thp = pytest.mark.skipif(not huge_pages_available(), reason="no transparent huge pages on this system")


def _smaps_entry(address: int) -> tuple[int, int, dict[str, str]]:
    """(start, end, fields) of this process's mapping that holds `address`, from /proc/self/smaps."""
    found: tuple[int, int, dict[str, str]] | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                if found is not None:
                    break
                start, end = (int(x, 16) for x in head.split("-"))
                found = (start, end, {}) if start <= address < end else None
            elif found is not None:
                key, _, value = line.partition(":")
                found[2][key] = value.strip()
    if found is None:
        raise AssertionError(f"no mapping holds {address:#x}")
    return found


def _mapping_of(address: int) -> tuple[int, int, frozenset[str]]:
    """(start, end, VmFlags) of this process's mapping that holds `address`."""
    start, end, fields = _smaps_entry(address)
    return start, end, frozenset(fields["VmFlags"].split())


def _prompt_logits(llm: LLM) -> torch.Tensor:
    """Every position's logits for one 40-token prompt, straight from the model runner."""
    prompt = random_prompts(1, seed=3, low=40, high=41, vocab=min(llm.engine.model.config.vocab_size, 259))[0]
    with torch.inference_mode():
        return llm.engine.runner.run([ForwardItem(list(range(4)), 0, prompt, logits="all")]).logits


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("huge")
    return {"gguf-qwen2": write_model(d / "qwen2.gguf", "qwen2"),
            "gguf-llama-tied": write_model(d / "llama.gguf", "llama", tie=True, seed=1)}


@needs_thp
@pytest.mark.parametrize("name", ["gguf-qwen2", "gguf-llama-tied", "safetensors-llama"])
def test_weights_in_huge_pages_compute_what_they_computed_where_they_loaded(
    files: dict[str, Path], tiny_llama: Path, name: str
) -> None:
    path = str(tiny_llama if name == "safetensors-llama" else files[name])
    moved, kept = LLM(path, huge_pages=True), LLM(path, huge_pages=False)
    arena = {_mapping_of(t.data_ptr())[:2] for t in weights(moved.engine.model) if t.numel()}
    assert len(arena) == 1 and not {_mapping_of(t.data_ptr())[:2] for t in weights(kept.engine.model) if t.numel()} & arena
    assert torch.equal(*(_prompt_logits(llm) for llm in (moved, kept)))
    vocab = moved.engine.model.config.vocab_size
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = random_prompts(3, seed=4, vocab=min(vocab, 259))
    assert ([o.token_ids for o in moved.generate(prompts, params, use_tqdm=False)]
            == [o.token_ids for o in kept.generate(prompts, params, use_tqdm=False)])


@needs_thp
def test_every_weight_lies_in_one_mapping_advised_for_huge_pages(files: dict[str, Path]) -> None:
    model = LLM(str(files["gguf-qwen2"]), huge_pages=True).engine.model
    tensors = [t for t in weights(model) if t.numel()]
    assert {type(m).__name__ for m in model.modules()} >= {"GGUFLinearKernel", "GGUFEmbedding"}
    assert model.embed_tokens.blocks.data_ptr() in {t.data_ptr() for t in tensors}  # the kernels' own tensors are met
    regions = {_mapping_of(t.data_ptr()) for t in tensors}
    assert len(regions) == 1, regions
    start, end, flags = regions.pop()
    assert "hg" in flags  # MADV_HUGEPAGE
    assert all(start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= end for t in tensors)


class _Shared(nn.Module):
    """A head tied to an embedding, a buffer that is a view of a parameter, a GGUF-style list of parts
    that are views of one tensor, and a small norm."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(300, 64)
        self.head = nn.Linear(64, 300, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("rows", self.embed.weight.detach()[10:20])
        whole = torch.arange(4096 * 3, dtype=torch.uint8).reshape(4096, 3)
        self.parts = [whole[:1000], whole[1000:]]
        self.norm = nn.Parameter(torch.ones(64))

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        self.parts = [fn(p) for p in self.parts]
        return super()._apply(fn, recurse)


@needs_thp
def test_what_was_shared_stays_shared_and_is_copied_once() -> None:
    m = _Shared()
    before = {n: t.clone() for n, t in [("embed", m.embed.weight.detach()), ("rows", m.rows), ("norm", m.norm.detach()),
                                        ("part0", m.parts[0]), ("part1", m.parts[1])]}
    moved = into_huge_pages(m)
    assert moved >= 300 * 64 * 4 + 4096 * 3 + 64 * 4 and moved < 300 * 64 * 4 + 4096 * 3 + 64 * 4 + 3 * 64  # once each
    assert m.head.weight is m.embed.weight and isinstance(m.embed.weight, nn.Parameter)
    assert m.rows.data_ptr() == m.embed.weight.data_ptr() + 10 * 64 * 4  # still a view of the embedding
    assert m.parts[1].data_ptr() == m.parts[0].data_ptr() + 1000 * 3  # still views of one tensor
    after = {"embed": m.embed.weight.detach(), "rows": m.rows, "norm": m.norm.detach(), "part0": m.parts[0],
             "part1": m.parts[1]}
    for name, t in before.items():
        assert torch.equal(after[name], t), name
    start, end, flags = _mapping_of(m.embed.weight.data_ptr())
    assert "hg" in flags and all(start <= t.data_ptr() < end for t in after.values())


def test_where_the_system_has_huge_pages_off_nothing_moves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "_THP_SETTING", setting)
    m = _Shared()
    where = [t.data_ptr() for t in weights(m)]
    assert not huge_pages_available() and into_huge_pages(m) == 0
    assert [t.data_ptr() for t in weights(m)] == where


def test_huge_pages_are_collapsed_in_place_by_default_and_the_bare_flag_moves_them_at_load() -> None:
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    assert EngineArgs.from_cli(p.parse_args([])).huge_pages == "auto" == EngineArgs().huge_pages
    assert EngineArgs.from_cli(p.parse_args(["--huge-pages"])).huge_pages == "load"
    assert EngineArgs.from_cli(p.parse_args(["--huge-pages", "off"])).huge_pages == "off"
    assert EngineArgs(huge_pages=True).huge_pages == "load" and EngineArgs(huge_pages=False).huge_pages == "off"
    with pytest.raises(ValueError, match="huge_pages: 'yes' is not one of auto, load, off"):
        EngineArgs(huge_pages="yes")


@needs_thp
def test_while_weights_move_the_replaced_originals_are_garbage_each_time_memory_is_given_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`freed` (the loader's malloc_trim) is called as the move goes, and by then what was replaced
    is unreferenced: loading does not hold the model twice until the end."""
    import weakref

    monkeypatch.setattr(huge_pages, "FREE_EVERY", 1)
    m = nn.Sequential(*(nn.Linear(256, 256, bias=False) for _ in range(6)))
    originals = [weakref.ref(layer.weight.data.untyped_storage()) for layer in m]  # type: ignore[union-attr]
    seen: list[int] = []  # at each call, how many originals are gone

    def freed() -> None:
        seen.append(sum(r() is None for r in originals))

    into_huge_pages(m, freed)
    assert len(seen) >= 5 and seen == sorted(seen) and seen[-1] >= 5, seen


def test_a_kernel_that_refuses_the_advice_still_gets_the_weights_whole(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    """madvise failing (an old or locked-down kernel) is not a failed load: the weights are copied,
    in 4 KB pages, and compute as before."""
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "_THP_SETTING", setting)

    def refuse(*args: object) -> None:
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(huge_pages, "_advise_huge", refuse)
    m = _Shared()
    before = [t.clone() for t in weights(m)]
    assert into_huge_pages(m) > 0
    assert all(torch.equal(a, b) for a, b in zip(weights(m), before))
    assert "hg" not in _mapping_of(m.embed.weight.data_ptr())[2]


def test_the_regions_asked_for_hold_every_byte_of_every_weight_and_nothing_else_each_once() -> None:
    m = _Shared()
    big = nn.Linear(1024, 1500, bias=False)  # 6 MB: regions of its own, and its edges shared with others
    tensors = [*weights(m), *weights(big), torch.empty(0)]
    regions = collapse_regions(tensors)
    assert regions == sorted(set(regions)) and all(r % HUGE_PAGE == 0 for r in regions)
    spans = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors if t.numel()}
    for start, n in spans:  # every byte, the first and last of each storage included, lies in a region
        for byte in (start, start + n - 1, *range(start, start + n, 4096)):
            assert byte // HUGE_PAGE * HUGE_PAGE in regions
    assert all(any(start < r + HUGE_PAGE and r < start + n for start, n in spans) for r in regions)  # none idle


def test_a_refused_collapse_is_counted_and_changes_nothing() -> None:
    """A kernel before 6.1 (EINVAL for an advice it does not know), or no huge page free (ENOMEM):
    the thread finishes, counts each refusal by errno, and the weights are as they were."""
    import ctypes

    asked: list[tuple[int, int, int]] = []

    def refuse(address: int, length: int, advice: int) -> int:
        asked.append((address, length, advice))
        ctypes.set_errno(22 if len(asked) % 2 else 12)
        return -1

    m = _Shared()
    before = [t.clone() for t in weights(m)]
    job = PageCollapse(collapse_regions(weights(m)), advise=refuse).start()
    assert job.wait(30)
    assert not job.collapsed and sum(job.refused.values()) == len(job.regions) == len(asked) > 0
    assert set(job.refused) == ({22, 12} if len(asked) > 1 else {22})
    assert all(length == HUGE_PAGE and advice == huge_pages.MADV_COLLAPSE for _, length, advice in asked)
    assert all(torch.equal(a, b) for a, b in zip(weights(m), before))


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages (kB) of this process's mapping that holds `address`."""
    return int(_smaps_entry(address)[2]["AnonHugePages"].split()[0])


@needs_thp
def test_by_default_the_weights_are_collapsed_where_they_lie_and_compute_what_they_computed(
    files: dict[str, Path],
) -> None:
    path = str(files["gguf-qwen2"])
    collapsed = LLM(path, speculative=None)
    where = [t.data_ptr() for t in weights(collapsed.engine.model)]
    assert collapsed.wait_for_huge_pages(60) and collapsed.huge_pages is not None
    job = collapsed.huge_pages
    if not job.collapsed:
        pytest.skip(f"this kernel collapses nothing (refused by errno: {dict(job.refused)})")
    # (checked before another model loads: a load's malloc_trim gives back free heap pages, which
    # may split a huge page that holds one; it failed here once when checked after)
    assert all(_anon_huge_kb(region) > 0 for region in job.collapsed)  # the kernel's own account
    assert [t.data_ptr() for t in weights(collapsed.engine.model)] == where  # in place: nothing moved
    kept = LLM(path, speculative=None, huge_pages="off")
    assert kept.huge_pages is None and LLM(path, speculative=None, huge_pages="load").huge_pages is None
    assert torch.equal(*(_prompt_logits(llm) for llm in (collapsed, kept)))


def test_the_collapse_waits_while_the_engine_computes_and_goes_on_after_its_patience() -> None:
    """Busy all along: nothing is asked before `patience` has passed, then every region is; idle:
    every region at once."""
    import time

    m = _Shared()
    asked: list[float] = []

    def advise(address: int, length: int, advice: int) -> int:
        asked.append(time.perf_counter())
        return 0

    begin = time.perf_counter()
    job = PageCollapse(collapse_regions(weights(m)), advise=advise, busy=lambda: True, patience=0.5, poll=0.01).start()
    assert job.wait(30) and len(job.collapsed) == len(job.regions) == len(asked) > 0
    assert min(asked) - begin >= 0.5
    asked.clear()
    begin = time.perf_counter()
    idle = PageCollapse(collapse_regions(weights(m)), advise=advise, busy=lambda: False, patience=30).start()
    assert idle.wait(30) and len(asked) == len(idle.regions) and max(asked) - begin < 5


def test_the_rest_of_the_process_counts_as_busy_past_its_share_of_a_cpu() -> None:
    import threading
    import time

    from specserve.model.huge_pages import OthersBusy

    cpu = [0.0]
    busy = OthersBusy(share=0.25, others_cpu=lambda: cpu[0])
    time.sleep(0.1)
    cpu[0] += 0.005  # 5% of a CPU
    assert not busy()
    time.sleep(0.1)
    cpu[0] += 0.05  # 50%
    assert busy()
    seen: dict[str, bool] = {}

    def look() -> None:  # the real account: this thread asks while the main thread spins
        real = OthersBusy()
        go.set()
        time.sleep(0.3)
        seen["busy"] = real()

    go = threading.Event()
    t = threading.Thread(target=look)
    t.start()
    go.wait(10)
    end = time.perf_counter() + 0.35
    while time.perf_counter() < end:
        pass
    t.join()
    assert seen == {"busy": True}
