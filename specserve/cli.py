"""Command line: `specserve generate`, `specserve chat`, `specserve bench ...`."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from specserve.model.loader import DEFAULT_MODEL, LOAD_FORMATS
from specserve.spec.config import SPEC_METHODS, SpecConfig


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=DEFAULT_MODEL, help=f"alias, .gguf file or HF directory (default: {DEFAULT_MODEL})")
    g.add_argument("--load-format", default="auto", choices=LOAD_FORMATS)
    g.add_argument("--device", default="cpu", help="cpu or cuda")
    g.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--kv-cache-gb", type=float, default=1.0)
    g.add_argument("--threads", type=int, default=None, help="CPU threads for PyTorch")
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--spec", default="none",
                   help=f"drafter: {', '.join(SPEC_METHODS)}, or several joined by '+' (default: none)")
    s.add_argument("--spec-tokens", type=int, default=4, help="draft tokens per request per step (K)")
    s.add_argument("--spec-width", type=int, default=1, help="tree width where the drafter has one")
    s.add_argument("--draft-model", default=None, help="model for --spec draft-model (same tokenizer)")
    s.add_argument("--draft-layers", type=int, default=None, help="layers for --spec layer-skip")
    s.add_argument("--draft-stop-below", type=float, default=0.0,
                   help="model drafters stop a chain when their pick's probability is below this")


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def _engine_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    return dict(
        load_format=a.load_format,
        device=a.device,
        dtype=a.dtype,
        max_model_len=a.max_model_len,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        enable_chunked_prefill=not a.no_chunked_prefill,
        enable_prefix_caching=not a.no_prefix_caching,
        kv_cache_gb=a.kv_cache_gb,
        speculative=SpecConfig(
            method=a.spec, num_tokens=a.spec_tokens, width=a.spec_width,
            draft_model=a.draft_model, draft_layers=a.draft_layers, draft_stop_below=a.draft_stop_below,
        ),
    )


def _sampling(a: argparse.Namespace) -> Any:
    from specserve.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        min_p=a.min_p,
        repetition_penalty=a.repetition_penalty,
        seed=a.seed,
        stop=tuple(a.stop or ()),
        ignore_eos=a.ignore_eos,
    )


def _make_llm(a: argparse.Namespace) -> Any:
    import torch

    from specserve import LLM

    if a.threads:
        torch.set_num_threads(a.threads)
    return LLM(a.model, **_engine_kwargs(a))


def _stream(llm: Any, prompt: Any, params: Any, out: Any) -> Any:
    last = None
    for last in llm.stream(prompt, params):
        if last.new_text:
            out.write(last.new_text)
            out.flush()
    out.write("\n")
    if last is not None and last.error is not None:
        print(f"specserve: error: {last.error}", file=sys.stderr)
    return last


def cmd_generate(a: argparse.Namespace) -> int:
    from specserve.tokenizer import apply_chat_template

    llm = _make_llm(a)
    prompt = a.prompt
    if a.chat:
        prompt = apply_chat_template(llm.tokenizer, [{"role": "user", "content": a.prompt}])
    last = _stream(llm, prompt, _sampling(a), sys.stdout)
    if last is not None and not a.quiet:
        rate = last.tokens_per_s
        speed = f", {rate:.1f} tok/s" if rate else ""
        print(f"[{len(last.token_ids)} tokens{speed}, finish_reason={last.finish_reason}]", file=sys.stderr)
    return 1 if last is not None and last.error is not None else 0


def cmd_chat(a: argparse.Namespace) -> int:
    from specserve.tokenizer import apply_chat_template

    llm = _make_llm(a)
    params = _sampling(a)
    messages: list[dict[str, str]] = []
    if a.system:
        messages.append({"role": "system", "content": a.system})
    interactive = sys.stdin.isatty()
    if interactive:
        print("specserve chat: /reset clears the conversation, /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            messages = messages[:1] if a.system else []
            continue
        messages.append({"role": "user", "content": line})
        last = _stream(llm, apply_chat_template(llm.tokenizer, messages), params, sys.stdout)
        messages.append({"role": "assistant", "content": last.text if last else ""})
    return 0


def cmd_bench_throughput(a: argparse.Namespace) -> int:
    from specserve.bench.throughput import run_throughput_bench

    run_throughput_bench(a)
    return 0


def cmd_bench_spec(a: argparse.Namespace) -> int:
    from specserve.bench.spec import run_spec_bench

    run_spec_bench(a)
    return 0


def cmd_bench_serve(a: argparse.Namespace) -> int:
    from specserve.bench.launcher import ServerStartError
    from specserve.bench.serve import ServerUnusable
    from specserve.bench.serve_command import run_serve_bench

    try:
        run_serve_bench(a)
    except (ServerStartError, ServerUnusable) as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--quiet", action="store_true", help="no statistics line on stderr")
    _add_engine_args(gen)
    _add_sampling_args(gen, max_tokens=256)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat using the model's chat template")
    chat.add_argument("--system", default=None, help="system message")
    _add_engine_args(chat)
    _add_sampling_args(chat, max_tokens=512)
    chat.set_defaults(func=cmd_chat)

    from specserve.bench.report import add_report_args

    dataset_help = ("spec-bench, sharegpt, humaneval, or a Spec-Bench style jsonl path "
                    "(default: spec-bench, ../shared/data/spec_bench_question.jsonl)")
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    tp = bench_sub.add_parser("throughput", help="output tokens/s vs transformers generate() at several batch sizes")
    _add_engine_args(tp)
    tp.add_argument("--batch-sizes", default="1,8,32")
    tp.add_argument("--max-tokens", type=int, default=128)
    tp.add_argument("--repeats", type=int, default=3, help="timed runs per row; the median is reported")
    tp.add_argument("--dataset", default=None, help=dataset_help)
    tp.add_argument("--dataset-path", default=None, help="the named dataset's file, where not its default one")
    tp.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    add_report_args(tp, plot=True)
    tp.set_defaults(func=cmd_bench_throughput)

    sp = bench_sub.add_parser("spec", help="speculative decoding on Spec-Bench, batch 1, every drafter")
    _add_engine_args(sp)
    sp.add_argument("--methods", default=None, help="comma-separated subset (default: all; `none` always runs)")
    sp.add_argument("--per-category", type=int, default=1, help="questions per Spec-Bench category")
    sp.add_argument("--max-tokens", type=int, default=256)
    sp.add_argument("--dataset", default=None, help=dataset_help)
    sp.add_argument("--dataset-path", default=None, help="the named dataset's file, where not its default one")
    sp.add_argument("--no-transformers", action="store_true", help="skip the transformers baselines")
    add_report_args(sp, plot=True)
    sp.set_defaults(func=cmd_bench_spec)

    from specserve.bench.serve_command import add_serve_bench_args

    sv = bench_sub.add_parser("serve", help="load generator against an OpenAI-compatible server; rate sweeps "
                                             "over server configurations")
    add_serve_bench_args(sv)
    sv.set_defaults(func=cmd_bench_serve)

    from specserve.server.cli import add_serve_parser  # here: specserve.server.cli imports this module

    add_serve_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from specserve.errors import InvalidRequestError
    from specserve.model.loader import ModelNotFoundError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (InvalidRequestError, ModelNotFoundError, ValueError, FileNotFoundError) as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
