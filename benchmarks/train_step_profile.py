"""Where a training step of the EAGLE head goes, against what this CPU's matmuls can do.

One step of `specserve train-drafter` as it runs (the head shaped for the target, `head_passes`
and `_terms` of the trainer, bfloat16 autocast, AdamW, 2048-token batches) on random data, timed
over several steps; its floating-point operations counted by torch's `FlopCounterMode`; beside it,
the rate of one large bfloat16 matmul of the head's MLP shape on this CPU (the most the step's
matmuls could run at). The ratio says whether a faster trainer is there to be had on this machine,
and the seconds per token say what a given amount of data costs to learn.

    python benchmarks/train_step_profile.py --model ~/.cache/specserve-models/qwen2.5-coder-1.5b-q4_k_m.gguf \
        --feature-layers auto --passes 3 --json benchmarks/train_step_profile_1p5b_CPU.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def matmul_rate(m: int, k: int, n: int, repeats: int = 10) -> float:
    """GFLOP/s of an [m, k] @ [k, n] product under bfloat16 autocast (float32 operands, as training's)."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(2):
            a @ b
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t)
    return 2 * m * k * n / statistics.median(times) / 1e9


def main() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    from specserve.model.eagle import EagleHead, HeadConfig
    from specserve.model.gguf_file import GGUFFile
    from specserve.model.gguf_model import gguf_config
    from specserve.train.drafter import FUSE_LR_SCALE, TrainConfig, _terms, feature_layers, head_passes

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the target's GGUF (only its shape is read)")
    ap.add_argument("--feature-layers", default="auto")
    ap.add_argument("--passes", type=int, default=3, help="training passes (own-feature passes + 1)")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--sample-tokens", type=int, default=341, help="rows a sample (code edits: ~360)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    torch.manual_seed(0)
    cfg = gguf_config(GGUFFile(a.model))
    layers = feature_layers(a.feature_layers, cfg.num_layers)
    hc = HeadConfig.for_target(cfg, a.draft_vocab, feature_layers=layers)
    head = EagleHead(hc, cfg.rope_theta, cfg.rope_scaling)
    h = cfg.hidden_size
    b, length = max(1, a.batch_tokens // a.sample_tokens), a.sample_tokens
    feats = torch.randn(b, length, (len(layers) + 1) * h)
    embeds = torch.randn(b, length, h)
    positions = torch.arange(length).expand(b, length)
    nxt = torch.randn(b, length, h)
    labels = torch.randint(0, a.draft_vocab, (b, length))
    fmask = torch.ones(b, length, dtype=torch.bool)
    lm_rows = torch.randn(a.draft_vocab, h) * 0.02
    fuse = [p for n, p in head.named_parameters() if n.startswith("fuse.")]
    rest = [p for n, p in head.named_parameters() if not n.startswith("fuse.")]
    opt = torch.optim.AdamW([{"params": rest}] + ([{"params": fuse, "lr": 1e-4 * FUSE_LR_SCALE}] if fuse else []),
                            lr=1e-4)

    c = TrainConfig(out="")  # the trainer's default loss weights

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs = head_passes(head, feats, embeds, positions, a.passes)
            terms = [_terms(o, lm_rows, nxt, labels, fmask) for o in outs]
            loss = sum((1.0 if k == 0 else c.own_feature_weight) * (t[0] + c.token_weight * t[1])
                       for k, t in enumerate(terms))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        opt.step()

    counter = FlopCounterMode(display=False)
    with counter:
        step()
    flops = counter.get_total_flops()
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    sec = statistics.median(times)
    tokens = b * length
    rate = matmul_rate(tokens, h, cfg.intermediate_size)
    params = sum(p.numel() for p in head.parameters())
    row = {
        "cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "head_params": params, "feature_layers": list(layers), "passes": a.passes, "draft_vocab": a.draft_vocab,
        "batch_tokens": tokens, "step_seconds": sec, "step_seconds_all": times, "step_gflop": flops / 1e9,
        "step_gflop_per_s": flops / sec / 1e9, "mlp_matmul_gflop_per_s": rate,
        "share_of_matmul_rate": flops / sec / 1e9 / rate, "ms_per_token_per_epoch": sec / tokens * 1e3,
    }
    print(f"{row['cpu']}, {row['threads']} threads: head {params / 1e6:.1f}M params, {a.passes} passes, "
          f"{tokens} tokens a step")
    print(f"step {sec:.2f} s (median of {a.steps}), {flops / 1e12:.2f} TFLOP: {row['step_gflop_per_s']:.0f} GFLOP/s; "
          f"one bf16 matmul [{tokens}x{h}]@[{h}x{cfg.intermediate_size}]: {rate:.0f} GFLOP/s "
          f"({row['share_of_matmul_rate']:.0%}); {row['ms_per_token_per_epoch']:.2f} ms a token an epoch")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
