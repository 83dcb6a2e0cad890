"""Whether a float32 model's layers run in the native layer loop: decided by timing whole steps.

The kernel tuner picks each projection's kernel alone. The native layer loop (one C call for all
layers) needs every layer projection on the native kernel, and what it saves, the interpreter
between the kernels, no single projection's timing can see: on a 2-core EPYC the tuner's float32
choices ran 20 tok/s, the loop 26. So, with float32 weights on the CPU, both plans run a few real
decode steps of the model (1 and 4 rows, over a small KV cache of their own) and the faster one is
kept; the decision is cached with the tuner's choices.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch
from torch import nn

from specserve.engine.model_runner import ForwardItem, ModelRunner, allocate_kv_cache
from specserve.model.attention import make_backend
from specserve.model.attention.cpu_paged import CpuPagedBackend
from specserve.model.llama import LlamaForCausalLM
from specserve.model.native_decoder import NativeDecoder
from specserve.model.quant import NativeF32Kernel, native_available
from specserve.model.tuning import KernelTuner

logger = logging.getLogger("specserve.model")

_BLOCK = 16
_CONTEXT = 64  # cached tokens a timed step attends to (fewer for a model with fewer positions)
PLANS = ("tuned", "native-loop")


def _what(model: LlamaForCausalLM) -> str:
    c = model.config
    return f"layer-loop|float32|{c.num_layers}x{c.hidden_size}x{c.intermediate_size}x{c.num_heads}x{c.num_kv_heads}"


def recalled_plan(model: LlamaForCausalLM, tuner: KernelTuner) -> str | None:
    """The plan decided for this model's shapes on this machine before, if any."""
    return tuner.recall(_what(model), list(PLANS))


def native_layer_kernels(model: LlamaForCausalLM) -> dict[str, nn.Module] | None:
    """A native float32 kernel for every layer projection (sharing the dense weights), to build
    before the tuner's choice drops those weights; None when the loop cannot run this model."""
    if not (native_available() and NativeDecoder.available() and CpuPagedBackend.available()):
        return None
    out: dict[str, nn.Module] = {}
    for name, module in model.layers.named_modules(prefix="layers"):
        if hasattr(module, "kernel"):
            if module.weight is None or module.weight.dtype != torch.float32 or module.weight.device.type != "cpu":
                return None
            out[name] = NativeF32Kernel(module.weight, module.bias)
    return out or None


def choose_layer_loop(model: LlamaForCausalLM, natives: dict[str, nn.Module], tuner: KernelTuner,
                      max_positions: int) -> bool:
    """Install `natives` (making the native layer loop run) when whole decode steps run faster
    with them than with the kernels the tuner chose; returns whether they were installed."""
    modules = dict(model.named_modules())
    tuned = {name: modules[name].kernel for name in natives}
    if all(isinstance(k, NativeF32Kernel) for k in tuned.values()):
        return True  # the tuner chose them already
    context = min(_CONTEXT, max_positions - 8)
    if context < 8:
        return False

    def install(kernels: dict[str, nn.Module]) -> None:
        for name, kernel in kernels.items():
            modules[name].kernel = kernel
        model.kernels_changed()

    def timed(kernels: dict[str, nn.Module]) -> float:
        install(kernels)
        return _step_seconds(model, context)

    try:
        plan = tuner.decide(_what(model), {"tuned": lambda: timed(tuned), "native-loop": lambda: timed(natives)})
    except Exception as e:  # noqa: BLE001 - keep the tuner's kernels
        logger.info("native layer loop not timed (%s); keeping the tuned kernels", str(e))
        plan = "tuned"
    install(natives if plan == "native-loop" else tuned)
    return plan == "native-loop"


def _step_seconds(model: LlamaForCausalLM, context: int) -> float:
    """Median seconds of a 1-row plus a 4-row decode step of `model` over a fresh small KV cache."""
    cfg = model.config
    device = torch.device("cpu")
    blocks = (context + 4) // _BLOCK + 1
    kv = allocate_kv_cache(model, blocks, _BLOCK, torch.float32, device)
    backend = make_backend("cpu-paged", device, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    runner = ModelRunner(model, kv, _BLOCK, device, backend)
    table = list(range(blocks))
    runner.run([ForwardItem(table, 0, [1] * context, logits="none")])  # fill the context
    steps = [[ForwardItem(table, context, [1])], [ForwardItem(table, context, [1, 2, 3, 4], logits="all")]]
    for items in steps:  # warm-up
        runner.run(items)
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for items in steps:
            runner.run(items)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)
