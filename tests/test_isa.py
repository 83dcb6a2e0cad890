"""The AMX guard: a CPU that advertises AMX gets a bfloat16 matmul tried in a child process, and
the oneDNN cap that survives is used; elsewhere nothing is probed."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from specserve import isa


def test_no_probe_without_amx_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(isa, "cpu_info", lambda: ("Some CPU", frozenset({"avx2", "fma"})))
    monkeypatch.setattr(isa, "_probe", lambda cap: pytest.fail("probed a CPU without AMX flags"))
    assert isa.safe_isa_cap(tmp_path) is None


def test_amx_that_dies_is_capped_and_the_result_cached(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(isa, "cpu_info", lambda: ("Xeon", frozenset({"avx512f", "amx_bf16", "amx_tile"})))
    tried: list[str | None] = []

    def probe(cap: str | None) -> int:
        tried.append(cap)
        return -signal.SIGILL if cap is None else 0  # dies unless capped

    monkeypatch.setattr(isa, "_probe", probe)
    assert isa.safe_isa_cap(tmp_path) == "AVX512_CORE_BF16"
    assert tried == [None, "AVX512_CORE_BF16"]
    monkeypatch.setattr(isa, "_probe", lambda cap: pytest.fail("probed twice on one machine"))
    assert isa.safe_isa_cap(tmp_path) == "AVX512_CORE_BF16"  # from the cache


def test_working_amx_is_left_alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(isa, "cpu_info", lambda: ("Xeon", frozenset({"amx_bf16"})))
    monkeypatch.setattr(isa, "_probe", lambda cap: 0)
    assert isa.safe_isa_cap(tmp_path) is None


def test_the_probe_really_runs_a_bf16_matmul() -> None:
    assert isa._probe(None) == 0  # this machine's own answer (a crash would be -SIGILL)
