"""Command line: `specserve generate`, `specserve chat`, `specserve bench ...`."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from specserve.entrypoints.engine_args import EngineArgs


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


def make_llm(a: argparse.Namespace) -> Any:
    """The LLM the parsed engine options describe."""
    from specserve import LLM

    return LLM.from_engine_args(EngineArgs.from_cli(a))


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

    llm = make_llm(a)
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

    llm = make_llm(a)
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


def cmd_train_drafter(a: argparse.Namespace) -> int:
    import dataclasses
    import logging

    from specserve.train.drafter import DrafterTrainer, TrainConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = TrainConfig(**{f.name: getattr(a, f.name) for f in dataclasses.fields(TrainConfig)})
    out = DrafterTrainer(config).run()
    if config.data_only:
        print(f"answers and states written to {out}; train on them with the same command without --data-only")
    else:
        print(f"draft head written to {out}; serve it with --spec eagle --draft-model {out}")
    return 0


def _add_train_args(p: argparse.ArgumentParser) -> None:
    import dataclasses

    from specserve.train.drafter import TrainConfig

    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "out":
            p.add_argument(flag, required=True, help="directory for the head, its data and checkpoints "
                                                      "(an existing one resumes)")
            continue
        if isinstance(f.default, bool):
            p.add_argument(flag, action="store_true", default=f.default)
            continue
        p.add_argument(flag, type=type(f.default), default=f.default, help=f"(default: {f.default})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--quiet", action="store_true", help="no statistics line on stderr")
    EngineArgs.add_cli_args(gen)
    _add_sampling_args(gen, max_tokens=256)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat using the model's chat template")
    chat.add_argument("--system", default=None, help="system message")
    EngineArgs.add_cli_args(chat)
    _add_sampling_args(chat, max_tokens=512)
    chat.set_defaults(func=cmd_chat)

    from specserve.bench.report import add_report_args

    dataset_help = ("spec-bench, sharegpt, humaneval, or a Spec-Bench style jsonl path "
                    "(default: spec-bench, ../shared/data/spec_bench_question.jsonl)")
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    tp = bench_sub.add_parser("throughput", help="output tokens/s vs transformers generate() at several batch sizes")
    EngineArgs.add_cli_args(tp)
    tp.add_argument("--batch-sizes", default="1,8,32")
    tp.add_argument("--max-tokens", type=int, default=128)
    tp.add_argument("--repeats", type=int, default=3, help="timed runs per row; the median is reported")
    tp.add_argument("--dataset", default=None, help=dataset_help)
    tp.add_argument("--dataset-path", default=None, help="the named dataset's file, where not its default one")
    tp.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    add_report_args(tp, plot=True)
    tp.set_defaults(func=cmd_bench_throughput)

    sp = bench_sub.add_parser("spec", help="speculative decoding on Spec-Bench (or another dataset), every "
                              "drafter; NAME:fixed or NAME:goodput picks a row's controller")
    EngineArgs.add_cli_args(sp)
    sp.add_argument("--methods", default=None,
                    help="comma-separated subset (default: all; `none` always runs); NAME:fixed or NAME:goodput "
                         "picks the controller for one row, NAME@K its most draft tokens (e.g. auto@4,auto@16); "
                         "none-again: a second engine without speculation, whose ratio to none is the run's noise")
    sp.add_argument("--per-category", type=int, default=1, help="questions per Spec-Bench category")
    sp.add_argument("--batch", type=int, default=1,
                    help="requests generated together (default 1: one at a time, with per-category rows)")
    sp.add_argument("--continuous", action="store_true",
                    help="with --batch B: rounds of 4 x B prompts submitted at once to engines that run at most B "
                         "at a time (continuous batching: a request that ends makes room for the next), each "
                         "round on every method in turn; without it each group of B runs until its last request ends")
    sp.add_argument("--max-tokens", type=int, default=256)
    sp.add_argument("--dataset", default=None, help=dataset_help)
    sp.add_argument("--dataset-path", default=None, help="the named dataset's file, where not its default one")
    sp.add_argument("--no-transformers", action="store_true", help="skip the transformers baselines")
    sp.add_argument("--eagle-head", default=None, help="draft head for the eagle row (default: the one shipped "
                                                         "for the model, if any)")
    add_report_args(sp, plot=True)
    sp.set_defaults(func=cmd_bench_spec)

    from specserve.bench.serve_command import add_serve_bench_args

    sv = bench_sub.add_parser("serve", help="load generator against an OpenAI-compatible server; rate sweeps "
                                             "over server configurations")
    add_serve_bench_args(sv)
    sv.set_defaults(func=cmd_bench_serve)

    td = sub.add_parser("train-drafter", help="train an EAGLE-style draft head for a model on its own answers "
                                              "(--spec eagle --draft-model OUT serves it)")
    _add_train_args(td)
    td.set_defaults(func=cmd_train_drafter)

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
