"""`specserve bench throughput`: output tokens/s against transformers generate(), same weights, same run."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from specserve.bench.datasets import (
    SampleSpec,
    SpecBench,
    cycle_to,
    hf_token_counter,
    open_dataset,
)
from specserve.bench.report import BenchReport, Column, ReportPaths, progress
from specserve.outputs import DraftCounters

THROUGHPUT_COLUMNS = (
    Column("engine", "engine"),
    Column("batch_size", "batch"),
    Column("tokens_per_s", "tok/s", ".1f"),
    Column("ratio_vs_transformers", "vs transformers", ".2f"),
    Column("fraction_of_roofline", "of roofline", ".3f"),
)


def load_spec_bench_prompts(path: Path | None, n: int) -> list[str]:
    """First-turn questions from Spec-Bench, in file order (repeated when the file has fewer than n)."""
    return cycle_to(SpecBench(path).sample(SampleSpec(num=n)).prompts, n)


def load_prompts(a: argparse.Namespace, tokenizer: Any, n: int) -> list[str]:
    """`n` prompt texts from `--dataset` (file order, repeated when the dataset has fewer)."""
    dataset = open_dataset(a.dataset, Path(a.dataset_path) if getattr(a, "dataset_path", None) else None)
    draw = dataset.sample(SampleSpec(num=n, output_len=a.max_tokens), hf_token_counter(tokenizer))
    return cycle_to(draw.prompts, n)


def read_bandwidth_gbs(device: str, nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Measured memory read bandwidth (a sum over a tensor far larger than the caches), in GB/s."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    times = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        src.sum()
        _sync(device)
        times.append(time.perf_counter() - t)
    return nbytes / min(times) / 1e9


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _median_rate(fn: Callable[[], int], repeats: int, device: str, bar: Any = None) -> float:
    rates = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        tokens = fn()
        _sync(device)
        rates.append(tokens / (time.perf_counter() - t))
        if bar is not None:
            bar.update(1)
    return statistics.median(rates)


def run_throughput_bench(a: argparse.Namespace) -> list[dict[str, Any]]:
    from specserve import LLM, SamplingParams
    from specserve.entrypoints.engine_args import EngineArgs
    from specserve.model.loader import model_dir_for
    from specserve.tokenizer import apply_chat_template

    paths = ReportPaths.from_args(a)
    if a.threads:
        torch.set_num_threads(a.threads)
    batch_sizes = [int(b) for b in a.batch_sizes.split(",")]
    llm = LLM.from_engine_args(EngineArgs.from_cli(a))
    llm.wait_for_huge_pages()
    tok = llm.tokenizer
    if tok is not None:
        texts = load_prompts(a, tok, max(batch_sizes))
        prompts = [apply_chat_template(tok, [{"role": "user", "content": t}]) for t in texts]
    else:  # dummy shape without a tokenizer: fixed-length random prompts
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, llm.engine.model.config.vocab_size, (64,), generator=g).tolist() for _ in range(max(batch_sizes))]
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    print(f"# threads={torch.get_num_threads()} device={a.device} dtype={a.dtype} model={a.model}", file=sys.stderr)

    rows: list[dict[str, Any]] = []
    ours: dict[int, float] = {}
    drafts: dict[int, DraftCounters] = {}  # of the last timed run at each batch size
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up

    def run(batch: list[Any], b: int) -> int:
        outs = llm.generate(batch, params, use_tqdm=False)
        drafts[b] = DraftCounters()
        for o in outs:
            drafts[b].add(o.metrics.speculation)
        return sum(len(o.token_ids) for o in outs)

    with progress(len(batch_sizes) * a.repeats, "specserve runs") as bar:
        for b in batch_sizes:
            rate = _median_rate(lambda: run(prompts[:b], b), a.repeats, a.device, bar)
            ours[b] = rate
            d = drafts[b]
            bar.write(f"specserve     batch={b:3d} {rate:8.1f} tok/s  drafted {d.proposed} accepted {d.accepted} "
                      f"in {d.steps} verifying steps", file=sys.stderr)

    theirs: dict[int, float] = {}
    if not a.no_transformers:
        theirs = _transformers_rates(a, model_dir_for(a.model) if a.load_format != "dummy" else None, llm, prompts, batch_sizes)

    weight_bytes = _weight_bytes(llm.engine.model)
    bw = read_bandwidth_gbs(a.device)
    roofline = bw * 1e9 / weight_bytes
    for b in batch_sizes:
        row: dict[str, Any] = {"engine": "specserve", "batch_size": b, "tokens_per_s": round(ours[b], 2),
                               "spec": a.spec, "drafted": drafts[b].proposed, "accepted": drafts[b].accepted,
                               "verifying_steps": drafts[b].steps}
        if b in theirs:
            row["ratio_vs_transformers"] = round(ours[b] / theirs[b], 3)
        if b == 1:
            row["roofline_tokens_per_s"] = round(roofline, 2)
            row["fraction_of_roofline"] = round(ours[b] / roofline, 3)
        rows.append(row)
        if b in theirs:
            rows.append({"engine": "transformers", "batch_size": b, "tokens_per_s": round(theirs[b], 2)})

    print(f"\nweights read per step {weight_bytes / 1e6:.0f} MB, read bandwidth {bw:.1f} GB/s "
          f"-> batch-1 roofline {roofline:.1f} tok/s")
    print(f"{'engine':<14}{'batch':>6}{'tok/s':>10}{'vs transformers':>17}")
    for r in rows:
        ratio = f"{r['ratio_vs_transformers']:.2f}x" if "ratio_vs_transformers" in r else ""
        print(f"{r['engine']:<14}{r['batch_size']:>6}{r['tokens_per_s']:>10.1f}{ratio:>17}")
    report = BenchReport(
        f"specserve bench throughput: {a.model}, {a.max_tokens} new tokens, {a.device} {a.dtype}",
        tuple(rows), THROUGHPUT_COLUMNS,
        fields={"read_bandwidth_gbs": round(bw, 2), "weight_bytes": weight_bytes, "threads": torch.get_num_threads(),
                "max_tokens": a.max_tokens, "model": a.model, "device": a.device, "dtype": a.dtype,
                "dataset": a.dataset or "spec-bench"})
    write_throughput_outputs(report, paths, batch_sizes, ours, theirs)
    return rows


def write_throughput_outputs(report: BenchReport, paths: ReportPaths, batch_sizes: list[int],
                             ours: dict[int, float], theirs: dict[int, float]) -> None:
    """--json, --plot (tokens/s per batch size, both engines) and --report."""
    if paths.json is not None:
        report.write_json(paths.json)
    if paths.plot is not None:
        from specserve.bench.plots import plot_grouped_bars

        series: dict[str, list[float | None]] = {"specserve": [ours[b] for b in batch_sizes]}
        if theirs:
            series["transformers"] = [theirs.get(b) for b in batch_sizes]
        plot_grouped_bars(paths.plot, [str(b) for b in batch_sizes], series, "output tokens/s", report.title,
                          xlabel="batch size")
    if paths.report is not None:
        fields = report.fields
        note = (f"Weights read per decode step {int(fields['weight_bytes']) / 1e6:.0f} MB; measured read "
                f"bandwidth {fields['read_bandwidth_gbs']} GB/s. Median of the timed runs after a warm-up; "
                f"{fields['threads']} threads.")
        report.write_markdown(paths.report, [("Notes", note)], paths.plot)


def _weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every projection and norm, not the embedding table
    (only a few rows of it are read, unless it is tied to the LM head, which reads it all)."""
    from specserve.model.huge_pages import weights
    from specserve.model.llama import Linear, RMSNorm

    seen: set[int] = set()
    total = 0
    for m in model.modules():
        if isinstance(m, Linear) and m.kernel is not None:
            tensors = weights(m.kernel)  # as the kernel holds them (packed, quantized; a GGUF kernel's parts)
        elif isinstance(m, (Linear, RMSNorm)):
            tensors = [p for p in m.parameters(recurse=False) if p is not None]
        else:
            continue
        for t in tensors:
            if t is None:
                continue
            key = id(t) if t.is_mkldnn else t.data_ptr()  # oneDNN's blocked weights have no storage
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


def _transformers_rates(
    a: argparse.Namespace, model_dir: Path | None, llm: Any, prompts: list[Any], batch_sizes: list[int]
) -> dict[int, float]:
    """transformers generate() on the same weights (random weights of the same shape for dummy models)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from specserve.config import parse_dtype

    dtype = parse_dtype(a.dtype)
    cfg = llm.engine.model.config
    if model_dir is not None:
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(a.device).eval()
    else:
        hf_cfg = (Qwen2Config if cfg.model_type == "qwen2" else LlamaConfig)(**cfg.to_hf_dict())
        with torch.device(a.device):
            hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype).eval()
    pad = cfg.eos_token_ids[0] if cfg.eos_token_ids else 0
    rates: dict[int, float] = {}
    with progress(len(batch_sizes) * a.repeats, "transformers runs") as bar:
        for b in batch_sizes:
            ids = prompts[:b]  # token id lists (chat template applied)
            width = max(len(p) for p in ids)
            input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in ids], device=a.device)
            attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids], device=a.device)

            def run() -> int:
                with torch.inference_mode():
                    out = hf.generate(input_ids=input_ids, attention_mask=attn, max_new_tokens=a.max_tokens,
                                      min_new_tokens=a.max_tokens, do_sample=False, pad_token_id=pad)
                return (out.shape[1] - width) * b

            if b == batch_sizes[0]:
                run()  # warm-up
            rates[b] = _median_rate(run, a.repeats, a.device, bar)
            bar.write(f"transformers  batch={b:3d} {rates[b]:8.1f} tok/s", file=sys.stderr)
    return rates
