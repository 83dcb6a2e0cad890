"""`specserve bench throughput`: output tokens/s against transformers generate(), same weights, same run."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

# ../shared/data beside the checkout (the project's layout), else relative to the working directory.
_REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATASETS = (
    _REPO_ROOT.parent / "shared" / "data" / "spec_bench_question.jsonl",
    Path("../shared/data/spec_bench_question.jsonl"),
)


def load_spec_bench_prompts(path: Path | None, n: int) -> list[str]:
    """First-turn questions from Spec-Bench, in file order."""
    if path is None:
        path = next((p for p in DEFAULT_DATASETS if p.is_file()), DEFAULT_DATASETS[0])
    if not path.is_file():
        raise FileNotFoundError(f"dataset: {path} not found; pass --dataset PATH to spec_bench_question.jsonl")
    out: list[str] = []
    with path.open() as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line)["turns"][0])
            if len(out) >= n:
                break
    if len(out) < n:
        out = (out * (n // max(1, len(out)) + 1))[:n]
    return out


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


def _median_rate(fn: Callable[[], int], repeats: int, device: str) -> float:
    rates = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        tokens = fn()
        _sync(device)
        rates.append(tokens / (time.perf_counter() - t))
    return statistics.median(rates)


def run_throughput_bench(a: argparse.Namespace) -> list[dict[str, Any]]:
    from specserve import LLM, SamplingParams
    from specserve.cli import _engine_kwargs
    from specserve.model.loader import model_dir_for
    from specserve.tokenizer import apply_chat_template

    if a.threads:
        torch.set_num_threads(a.threads)
    batch_sizes = [int(b) for b in a.batch_sizes.split(",")]
    llm = LLM(a.model, **_engine_kwargs(a))
    tok = llm.tokenizer
    if tok is not None:
        texts = load_spec_bench_prompts(Path(a.dataset) if a.dataset else None, max(batch_sizes))
        prompts = [apply_chat_template(tok, [{"role": "user", "content": t}]) for t in texts]
    else:  # dummy shape without a tokenizer: fixed-length random prompts
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, llm.engine.model.config.vocab_size, (64,), generator=g).tolist() for _ in range(max(batch_sizes))]
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    print(f"# threads={torch.get_num_threads()} device={a.device} dtype={a.dtype} model={a.model}", file=sys.stderr)

    rows: list[dict[str, Any]] = []
    ours: dict[int, float] = {}
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up
    for b in batch_sizes:
        batch = prompts[:b]
        rate = _median_rate(lambda: sum(len(o.token_ids) for o in llm.generate(batch, params, use_tqdm=False)), a.repeats, a.device)
        ours[b] = rate
        print(f"specserve     batch={b:3d} {rate:8.1f} tok/s", file=sys.stderr)

    theirs: dict[int, float] = {}
    if not a.no_transformers:
        theirs = _transformers_rates(a, model_dir_for(a.model) if a.load_format != "dummy" else None, llm, prompts, batch_sizes)

    weight_bytes = _weight_bytes(llm.engine.model)
    bw = read_bandwidth_gbs(a.device)
    roofline = bw * 1e9 / weight_bytes
    for b in batch_sizes:
        row: dict[str, Any] = {"engine": "specserve", "batch_size": b, "tokens_per_s": round(ours[b], 2)}
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
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "read_bandwidth_gbs": round(bw, 2),
                                            "weight_bytes": weight_bytes, "threads": torch.get_num_threads(),
                                            "max_tokens": a.max_tokens, "model": a.model, "device": a.device,
                                            "dtype": a.dtype}, indent=2))
    return rows


def _weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every projection and norm, not the embedding table
    (only a few rows of it are read, unless it is tied to the LM head, which reads it all)."""
    from specserve.model.llama import Linear, RMSNorm

    seen: set[int] = set()
    total = 0
    for m in model.modules():
        if isinstance(m, (Linear, RMSNorm)):
            for p in m.parameters(recurse=False):
                if p.data_ptr() not in seen:
                    seen.add(p.data_ptr())
                    total += p.numel() * p.element_size()
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
    for b in batch_sizes:
        batch = prompts[:b]
        ids = [p if isinstance(p, list) else p for p in batch]
        width = max(len(p) for p in ids)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in ids], device=a.device)
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids], device=a.device)

        def run() -> int:
            with torch.inference_mode():
                out = hf.generate(input_ids=input_ids, attention_mask=attn, max_new_tokens=a.max_tokens,
                                  min_new_tokens=a.max_tokens, do_sample=False, pad_token_id=pad)
            return (out.shape[1] - width) * b

        run() if b == batch_sizes[0] else None  # warm-up
        rates[b] = _median_rate(run, a.repeats, a.device)
        print(f"transformers  batch={b:3d} {rates[b]:8.1f} tok/s", file=sys.stderr)
    return rates
