"""`specserve bench spec`: speculative decoding on Spec-Bench, batch 1, every drafter side by side.

Greedy, chat template, first turn of N questions per category. For each method:
output tokens/s, speedup against `none` measured in the same run, mean accepted
length (tokens per verification step), per category and overall; plus transformers'
generate() plain and with prompt lookup, on the same weights. Also measures the
cost of verifying k draft tokens against a plain decode step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specserve.bench.datasets import (
    CodeEdit,
    Dataset,
    SampleSpec,
    SpecBench,
    hf_token_counter,
    open_dataset,
)
from specserve.bench.report import (
    BenchReport,
    Column,
    ReportPaths,
    markdown_table,
    progress,
)
from specserve.bench.throughput import _sync
from specserve.outputs import DraftCounters
from specserve.speculation.factory import bundled_head

SPEC_COLUMNS = (
    Column("method", "method"),
    Column("tokens_per_s", "tok/s", ".1f"),
    Column("speedup_vs_none", "vs none", ".2f"),
    Column("mean_accepted_length", "acc. len", ".2f"),
    Column("grant_mean", "grant", ".2f"),
    Column("predicted_accepted", "pred. acc.", ".0f"),
    Column("accepted", "acc.", ".0f"),
    Column("cost_error", "cost err", ".1%"),
)


def load_by_category(path: Path | None, per_category: int) -> list[tuple[str, str]]:
    """(category, first-turn question) pairs, the first `per_category` of each category in file order."""
    draw = SpecBench(path).sample(SampleSpec(per_category=per_category))
    return [(s.category or "", s.prompt) for s in draw.samples]


def load_questions(dataset: Dataset, per_category: int, max_tokens: int, tokenizer: Any) -> list[tuple[str, str]]:
    """(category, prompt) pairs: the first `per_category` per category (Spec-Bench, code-edit); for a
    dataset without categories, its first `per_category` usable prompts under the dataset's name."""
    if isinstance(dataset, (SpecBench, CodeEdit)):
        spec = SampleSpec(per_category=per_category, output_len=max_tokens)
    else:
        spec = SampleSpec(num=per_category, output_len=max_tokens)
    draw = dataset.sample(spec, hf_token_counter(tokenizer))
    return [(s.category or dataset.name, s.prompt) for s in draw.samples]


def chat_questions(dataset: Dataset, per_category: int, max_tokens: int, tokenizer: Any) -> list[tuple[str, list[int]]]:
    """`load_questions`, each question as a one-turn chat in the tokenizer's template: (category,
    prompt token ids)."""
    from specserve.tokenizer import apply_chat_template

    return [(category, apply_chat_template(tokenizer, [{"role": "user", "content": q}]))
            for category, q in load_questions(dataset, per_category, max_tokens, tokenizer)]


def chat_prompts(dataset: Dataset, per_category: int, max_tokens: int, tokenizer: Any) -> list[list[int]]:
    """The prompts of `chat_questions`."""
    return [prompt for _, prompt in chat_questions(dataset, per_category, max_tokens, tokenizer)]


def _draft_model(a: argparse.Namespace) -> str | None:
    """The draft model of the `draft-model` rows: the one named, or with `auto` (the default) the one
    found for the model among the user's GGUF files (`specserve.model.drafts`), or none."""
    name = getattr(a, "draft_model", None)
    if name in (None, "", "none"):
        return None
    if name != "auto":
        return name
    from specserve.model.drafts import draft_for

    found = draft_for(a.model, a.load_format)
    return None if found is None else str(found)


def _methods(a: argparse.Namespace) -> list[tuple[str, dict[str, Any] | None]]:
    k = a.spec_tokens
    all_methods: dict[str, dict[str, Any] | None] = {
        "none": None,
        "auto": dict(method="auto", num_tokens=k),
        "ngram": dict(method="ngram", num_tokens=k, width=a.spec_width),
        "suffix": dict(method="suffix", num_tokens=k),
        "recycling": dict(method="recycling", num_tokens=k),
        "layer-skip": dict(method="layer-skip", num_tokens=k, draft_layers=a.draft_layers,
                           draft_stop_below=a.draft_stop_below),
        "ngram+recycling": dict(method="ngram+recycling", num_tokens=k, width=a.spec_width),
        "suffix+recycling": dict(method="suffix+recycling", num_tokens=k),
    }
    head = getattr(a, "eagle_head", None)
    if head or bundled_head(a.model):
        all_methods["eagle"] = dict(method="eagle", num_tokens=k, draft_model=head)
    draft = _draft_model(a)
    if draft:
        all_methods["draft-model"] = dict(method="draft-model", num_tokens=k, draft_model=draft,
                                          draft_stop_below=a.draft_stop_below)
        # `auto` with the draft model beside its lookups (what --spec auto --draft-model serves)
        all_methods["auto+draft-model"] = dict(method="auto", num_tokens=k, draft_model=draft,
                                               draft_stop_below=a.draft_stop_below)
    names = a.methods.split(",") if a.methods else list(all_methods)
    # Asked by name only: a second engine without speculation, run interleaved like the others. Its
    # ratio to `none` is how far two identical engines in this run differ: the run's own noise.
    all_methods["none-again"] = None
    controller = getattr(a, "spec_controller", "goodput")
    for name in list(all_methods):  # NAME:fixed / NAME:goodput pick the controller for one row
        for c in ("fixed", "goodput"):
            spec = all_methods[name]
            if spec is not None:
                all_methods[f"{name}:{c}"] = dict(spec, controller=c)
        if all_methods[name] is not None:
            all_methods[name] = dict(all_methods[name], controller=controller)  # type: ignore[arg-type]
    for name in names:  # NAME@K: the same row with at most K draft tokens (a sweep of K in one run)
        base, sep, k_text = name.rpartition("@")
        if sep and base in all_methods and all_methods[base] is not None:
            if not k_text.isdigit():
                raise ValueError(f"methods: {name!r}: the number after '@' must be a count of draft tokens")
            all_methods[name] = dict(all_methods[base], num_tokens=int(k_text))  # type: ignore[arg-type]
    unknown = [n for n in names if n not in all_methods]
    if unknown:
        hint = " (draft-model needs --draft-model PATH)" if "draft-model" in unknown else ""
        hint += " (eagle needs --eagle-head DIR for this model)" if "eagle" in unknown else ""
        raise ValueError(f"methods: unknown {', '.join(unknown)}; choose from {', '.join(all_methods)}{hint}")
    if "none" not in names:
        names = ["none"] + names
    return [(n, all_methods[n]) for n in names]


def run_spec_bench(a: argparse.Namespace) -> list[dict[str, Any]]:
    from specserve import LLM, SamplingParams
    from specserve.entrypoints.engine_args import EngineArgs

    paths = ReportPaths.from_args(a)
    if a.threads:
        torch.set_num_threads(a.threads)
    dataset = open_dataset(a.dataset, Path(a.dataset_path) if getattr(a, "dataset_path", None) else None)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0)
    base = EngineArgs.from_cli(a)
    batch = max(1, getattr(a, "batch", 1))
    continuous = bool(getattr(a, "continuous", False)) and batch > 1
    if continuous:  # at most `batch` requests run; a round of 4 x batch is queued at once
        base = base.with_(max_num_seqs=batch)
    rows: list[dict[str, Any]] = []
    per_method: dict[str, dict[str, Tally]] = {}
    questions: list[tuple[str, list[int]]] = []
    prompts: list[list[int]] | None = None
    verify_cost: list[dict[str, float]] = []
    methods = _methods(a)
    bar = None
    control: dict[str, dict[str, Any]] = {}
    # Every method's engine is built first, then each batch of prompts runs on every method in
    # turn (interleaved), the order reversed every other batch, so that a machine whose speed drifts
    # over minutes favours none of them (in a fixed order `auto` always ran between `none` and
    # `none-again`, and a drift within a batch's turn fell on it alone).
    llms = {}
    for name, spec in methods:
        llm = llms[name] = LLM.from_engine_args(base.with_(speculative=spec))
        llm.wait_for_huge_pages()  # its weights' collapse into 2 MB pages is not timed with anything
        if prompts is None:
            questions = chat_questions(dataset, a.per_category, a.max_tokens, llm.tokenizer)
            prompts = [prompt for _, prompt in questions]
            verify_cost = measure_verify_cost(llm, prompts[0])
            bar = progress(len(methods) * len(prompts), "spec bench generations")
        llm.generate(prompts[0], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)  # warm-up
    assert prompts is not None and bar is not None
    stats = {name: defaultdict(Tally) for name in llms}
    size = 4 * batch if continuous else batch
    for start in range(0, len(prompts), size):  # batch 1: one request at a time, per category
        group = list(range(start, min(start + size, len(prompts))))
        order = list(llms.items())
        for name, llm in (order if (start // size) % 2 == 0 else order[::-1]):
            t = time.perf_counter()
            outs = llm.generate([prompts[i] for i in group], params, use_tqdm=False)
            dt = time.perf_counter() - t
            for i, out in zip(group, outs):
                keys = (questions[i][0], "overall") if batch == 1 else ("overall",)
                for key in keys:
                    stats[name][key].add(len(out.token_ids), dt / len(group), out.metrics.speculation)
            bar.update(len(group))
    for name, llm in llms.items():
        per_method[name] = dict(stats[name])
        control[name] = _control_row(llm.engine.speculation_stats())
        o = stats[name]["overall"]
        bar.write(f"{name:<22} {o.rate:7.1f} tok/s  accepted/step {o.mean_accepted_length:.2f}", file=sys.stderr)
    del llms
    if bar is not None:
        bar.close()

    if not a.no_transformers:
        assert prompts is not None
        per_method.update(_transformers(a, questions, prompts))

    none = per_method["none"]
    for name, by_cat in per_method.items():
        for cat, tally in by_cat.items():
            rows.append({
                "method": name, "category": cat, "tokens_per_s": round(tally.rate, 2),
                "speedup_vs_none": round(tally.rate / none[cat].rate, 3),
                "mean_accepted_length": round(tally.mean_accepted_length, 3),
                **(control.get(name, {}) if cat == "overall" else {}),
            })
    _print_table(rows)
    report = BenchReport(
        f"specserve bench spec: {a.model}, {dataset.name}, batch {batch}{' continuous' if continuous else ''}, "
        f"{a.max_tokens} new tokens, "
        f"K = {a.spec_tokens}",
        tuple(rows), SPEC_COLUMNS,
        fields={"verify_cost": verify_cost, "model": a.model, "max_tokens": a.max_tokens,
                "per_category": a.per_category, "spec_tokens": a.spec_tokens, "threads": torch.get_num_threads(),
                "dataset": dataset.name, "batch": batch, "continuous": continuous},
        shown_rows=tuple(r for r in rows if r["category"] == "overall"))
    write_spec_outputs(report, paths)
    return rows


def _control_row(s: Any) -> dict[str, Any]:
    """The controller's record for a method's run: mean grant per decoding request-step, expected
    vs accepted draft tokens of the nodes it kept, and the cost model's mean relative error."""
    grants = dict(s.grants)
    n = sum(grants.values())
    return {
        "grant_mean": round(sum(k * c for k, c in grants.items()) / n, 3) if n else None,
        "grant_histogram": {str(k): c for k, c in sorted(grants.items())},
        "predicted_accepted": round(s.predicted_accepted, 1),
        "accepted": s.accepted,
        "cost_error": round(s.cost_relative_error, 4) if s.cost_steps else None,
        "drafted_with": dict(s.drafted_with),
        "guard": {"plain_steps": s.guard_plain_steps, "probes": s.guard_probes, "turned_off": s.guard_turned_off},
    }


def write_spec_outputs(report: BenchReport, paths: ReportPaths) -> None:
    """--json, --plot (overall tokens/s per method) and --report (with the per-category matrix)."""
    if paths.json is not None:
        report.write_json(paths.json)
    overall = report.table_rows
    if paths.plot is not None:
        from specserve.bench.plots import plot_grouped_bars

        plot_grouped_bars(paths.plot, [str(r["method"]) for r in overall],
                          {"overall tok/s": [float(r["tokens_per_s"]) for r in overall]}, "output tokens/s",
                          report.title)
    if paths.report is not None:
        report.write_markdown(paths.report, [("Per category", category_matrix(report.rows)),
                                             ("Verification cost", _verify_cost_table(report.fields["verify_cost"]))],
                              paths.plot)


def category_matrix(rows: list[dict[str, Any]] | tuple[Any, ...]) -> str:
    """Categories down, methods across: tokens/s (speedup vs none, mean accepted length)."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    categories = sorted(dict.fromkeys(r["category"] for r in rows), key=lambda c: c != "overall")
    cell = {(r["method"], r["category"]): r for r in rows}
    table = []
    for cat in categories:
        line: dict[str, Any] = {"category": f"**{cat}**" if cat == "overall" else cat}
        for m in methods:
            r = cell.get((m, cat))
            line[m] = None if r is None else (
                f"{r['tokens_per_s']:.1f}" if m == "none" else
                f"{r['tokens_per_s']:.1f} ({r['speedup_vs_none']:.2f}x, {r['mean_accepted_length']:.2f})")
        table.append(line)
    return markdown_table(table, [Column("category", "category"), *(Column(m, m) for m in methods)])


def _verify_cost_table(verify_cost: list[dict[str, float]]) -> str:
    if not verify_cost:
        return "not measured"
    return markdown_table(verify_cost, [Column("k", "k"), Column("ms", "ms", ".2f"),
                                        Column("relative", "relative to k = 0", ".2f")])


@dataclass
class Tally:
    """Output tokens, wall time and speculation counters summed over a method's generations."""

    tokens: int = 0
    seconds: float = 0.0
    spec: DraftCounters = field(default_factory=DraftCounters)

    def add(self, tokens: int, seconds: float, spec: DraftCounters | None = None) -> None:
        self.tokens += tokens
        self.seconds += seconds
        if spec is not None:
            self.spec.add(spec)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verification step; 1.0 for plain decoding (no verification steps)."""
        return self.spec.mean_accepted_length if self.spec.steps else 1.0


def measure_verify_cost(llm: Any, prompt: list[int], max_k: int = 16, repeats: int = 7) -> list[dict[str, float]]:
    """Time of one forward verifying a chain of k draft tokens for one request, relative to k = 0."""
    from specserve.engine.model_runner import ForwardItem
    from specserve.speculation.tree import DraftTree

    engine = llm.engine
    rid = engine.add_request(prompt, __import__("specserve").SamplingParams(max_tokens=2, temperature=0))
    engine.step()  # prefill: the request now has K/V for its prompt
    seq = next(s for s in engine.scheduler.running if s.request_id == rid)
    if not engine.blocks.allocate(seq, seq.num_tokens + max_k):
        raise RuntimeError(f"kv cache: no room for {max_k} draft slots to measure the verification cost")
    out: list[dict[str, float]] = []
    base = None
    for k in range(max_k + 1):
        tree = DraftTree.chain([seq.output_token_ids[-1]] * k)
        item = ForwardItem(seq.block_table, seq.num_computed_tokens, [seq.output_token_ids[-1]] + list(tree.tokens),
                           mask=tree.ancestor_mask() if k else None, logits="all")
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            engine.runner.run([item])
            times.append(time.perf_counter() - t)
        ms = statistics.median(times) * 1e3
        base = base or ms
        out.append({"k": k, "ms": round(ms, 2), "relative": round(ms / base, 3)})
    engine.abort_request(rid)
    return out


def _transformers(
    a: argparse.Namespace, questions: list[tuple[str, list[int]]], prompts: list[list[int]]
) -> dict[str, dict[str, tuple[int, float, int, int]]]:
    from transformers import AutoModelForCausalLM

    from specserve.config import parse_dtype
    from specserve.model.loader import model_dir_for

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir_for(a.model)), dtype=parse_dtype(a.dtype))
    hf = hf.to(a.device).eval()
    out: dict[str, dict[str, Tally]] = {}
    baselines = (("transformers", {}), ("transformers-prompt-lookup", {"prompt_lookup_num_tokens": 10}))
    with progress(len(baselines) * len(prompts), "transformers generations") as bar:
        for name, extra in baselines:
            stats: dict[str, Tally] = defaultdict(Tally)
            for (cat, _), prompt in zip(questions, prompts):
                ids = torch.tensor([prompt], device=a.device)
                _sync(a.device)
                t = time.perf_counter()
                with torch.inference_mode():
                    gen = hf.generate(ids, max_new_tokens=a.max_tokens, do_sample=False, **extra)
                _sync(a.device)
                dt = time.perf_counter() - t
                for key in (cat, "overall"):
                    stats[key].add(gen.shape[1] - ids.shape[1], dt)
                bar.update(1)
            out[name] = dict(stats)
            bar.write(f"{name:<22} {stats['overall'].rate:7.1f} tok/s", file=sys.stderr)
    return out


def _print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'method':<28}{'tok/s':>9}{'vs none':>9}{'acc. len':>10}   (overall)")
    for r in rows:
        if r["category"] == "overall":
            print(f"{r['method']:<28}{r['tokens_per_s']:>9.1f}{r['speedup_vs_none']:>8.2f}x{r['mean_accepted_length']:>10.2f}")
