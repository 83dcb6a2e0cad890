"""`LLM`: the offline Python API."""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import logging
import time
import zlib
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from specserve.config import parse_dtype
from specserve.engine.engine import LLMEngine
from specserve.errors import InvalidRequestError
from specserve.isa import bf16_works
from specserve.model.llama import LlamaForCausalLM, RotaryEmbedding
from specserve.model.drafts import draft_for, models_dir
from specserve.model.gguf_file import GGUFFile
from specserve.model.gguf_model import gguf_config, gguf_tokenizer_dir, install_gguf_weights, rope_freq_factors
from specserve.model.huge_pages import PageCollapse, collapse_regions, huge_pages_available, into_huge_pages, weights
from specserve.model.loader import (DEFAULT_MODEL, gguf_behind, gguf_int4_source, load_model_files,
                                    resolve_quantization)
from specserve.model.quant import prepare_linears
from specserve.model.tuning import KernelTuner
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams
from specserve.entrypoints.engine_args import EngineArgs
from specserve.speculation.config import SpeculativeConfig
from specserve.speculation.factory import with_model_defaults
from specserve.tokenizer import TokenizerCache, apply_chat_template, load_tokenizer, special_token_ids

logger = logging.getLogger("specserve")


def build_model(
    model: str, load_format: str, device: str, dtype: torch.dtype, max_model_len: int | None, seed: int,
    quantization: str = "none", gguf_q4_0: bool = False, head_vocab: int | None = None, huge_pages: bool = False,
    tokenizers: Callable[[Path], Any] = load_tokenizer,
) -> tuple[LlamaForCausalLM, Any, int, str]:
    """Load config and weights into our model, with each projection's kernel chosen by measurement
    for `quantization` (auto: as the weights were shipped; `gguf_q4_0`: a GGUF run on its own
    blocks has its wider projections rounded to Q4_0, for a draft model; `head_vocab`: the LM head
    reads out only the first that many token ids and the tokenizer's special tokens, for a draft
    model: LlamaForCausalLM.read_out_vocabulary; `huge_pages`: the weights moved into 2 MB pages,
    specserve.model.huge_pages; `tokenizers`: loads a directory's tokenizer, as TokenizerCache does
    once per content); returns (model, tokenizer or None, max_model_len, the precision the weights
    run in)."""
    if load_format != "dummy":
        gguf_path = gguf_behind(model, load_format)
        if resolve_quantization(quantization, gguf_path, device) == "gguf":
            return _build_gguf_model(gguf_path, dtype, max_model_len, gguf_q4_0, head_vocab,  # type: ignore[arg-type]
                                     huge_pages, tokenizers)
    loaded = load_model_files(model, load_format)
    cfg = loaded.config
    limit = _check_limit(max_model_len, cfg)
    with torch.device("meta"):
        net = LlamaForCausalLM(cfg, max_positions=limit)
    if loaded.state_dict is None:
        net = net.to(dtype=dtype).to_empty(device=device)
        _init_random(net, seed)
    else:
        # assign: the loaded tensors become the parameters, no other copy is ever made
        state = {k: v.to(device=device, dtype=dtype) for k, v in loaded.state_dict.items()}
        missing, unexpected = net.load_state_dict(state, strict=False, assign=True)
        del state
        missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"model: weights do not match the config (missing {missing[:5]}, unexpected {unexpected[:5]})")
    net.rope = RotaryEmbedding(cfg.head_dim, limit, cfg.rope_theta, cfg.rope_scaling).to(device)
    if cfg.tie_word_embeddings:
        net.lm_head.weight = net.embed_tokens.weight
    loaded = dataclasses.replace(loaded, state_dict=None)
    net.eval()
    precision = resolve_quantization(quantization, loaded.gguf_path, device)
    source = gguf_int4_source(loaded.gguf_path, cfg) if loaded.gguf_path is not None and precision == "int4" else None
    tokenizer = tokenizers(loaded.tokenizer_path) if loaded.tokenizer_path is not None else None
    _read_out_vocabulary(net, tokenizer, head_vocab, model)  # before the kernels: only the kept rows get one
    tuner = KernelTuner(torch.device(device))
    chosen = prepare_linears(net, precision, tuner.choose, source)
    logger.info("%s: %s weights; kernels: %s", model, precision,
                ", ".join(f"{c} x{n}" for c, n in Counter(chosen.values()).items()))
    if huge_pages:
        _into_huge_pages(net)
    _return_freed_memory()
    return net, tokenizer, limit, precision


def _check_limit(max_model_len: int | None, cfg: Any) -> int:
    if max_model_len is not None and max_model_len > cfg.max_position_embeddings:
        raise InvalidRequestError(
            "max_model_len", f"{max_model_len} exceeds the model's {cfg.max_position_embeddings} positions"
        )
    return min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)


def _read_out_vocabulary(net: LlamaForCausalLM, tokenizer: Any, head_vocab: int | None, name: str) -> None:
    if head_vocab is None:
        return
    cut = net.read_out_vocabulary(head_vocab, special_token_ids(tokenizer) if tokenizer is not None else ())
    if cut is not None:
        logger.info("%s: the LM head reads out token ids [0, %d) and [%d, %d)", Path(name).name, cut[0], cut[1],
                    net.config.vocab_size)


def _build_gguf_model(path: Path, dtype: torch.dtype, max_model_len: int | None,
                      q4_0: bool = False, head_vocab: int | None = None, huge_pages: bool = False,
                      tokenizers: Callable[[Path], Any] = load_tokenizer) -> tuple[LlamaForCausalLM, Any, int, str]:
    """A GGUF model on its own blocks (specserve.model.gguf_model): float32 activations on the CPU;
    `q4_0`: its wider projections rounded to Q4_0 (a draft model's); `head_vocab`: build_model's."""
    if dtype != torch.float32:
        raise InvalidRequestError("dtype", f"the GGUF kernels take float32 activations, not {dtype}; "
                                           "use --dtype float32 or --quantization none")
    start = time.perf_counter()
    g = GGUFFile(path)
    cfg = gguf_config(g)
    limit = _check_limit(max_model_len, cfg)
    # The tokenizer first: building it takes about 100 MB more than it keeps (a 151k vocabulary), and
    # that goes back to the OS before the weights come, so the process's peak is not the sum of both.
    tokenizer = tokenizers(gguf_tokenizer_dir(path))
    _return_freed_memory()
    with torch.device("meta"):
        net = LlamaForCausalLM(cfg, max_positions=limit)
    tuner = KernelTuner(torch.device("cpu"))
    chosen = install_gguf_weights(net, g, cfg, tuner.choose, q4_0)
    prefetch = tuner.choose_prefetch(net)
    _read_out_vocabulary(net, tokenizer, head_vocab, str(path))
    net.rope = RotaryEmbedding(cfg.head_dim, limit, cfg.rope_theta, cfg.rope_scaling, rope_freq_factors(g))
    net.eval()
    if huge_pages and _into_huge_pages(net):  # nothing reads the file's pages any more
        for name in g.tensors:
            g.release(name)
    logger.info("%s: weights in the file's blocks (%s); kernels: %s; prefetch %s; loaded in %.1f s", path.name,
                ", ".join(f"{n} x{c}" for n, c in Counter(t.type_name for t in g.tensors.values()).items()),
                ", ".join(f"{c} x{n}" for c, n in Counter(chosen.values()).items()), prefetch,
                time.perf_counter() - start)
    _return_freed_memory()
    return net, tokenizer, limit, "gguf"


def _into_huge_pages(net: LlamaForCausalLM) -> int:
    """The weights moved into 2 MB pages (specserve.model.huge_pages); the bytes moved."""
    start = time.perf_counter()
    moved = into_huge_pages(net, _return_freed_memory)
    if moved:
        net.kernels_changed()
        logger.info("weights: %.0f MB moved into 2 MB pages in %.2f s", moved / 2**20, time.perf_counter() - start)
    return moved


def _freeze_the_imports() -> None:
    """Leave the objects of the process's imports out of Python's cyclic garbage collection, once
    per process: ~171k of the ~180k objects a full collection walks once the bundled model is
    loaded are the imports' (torch, transformers, ...), and walking them took 50-120 ms a full
    collection, which `auto`'s drafters (their indexes of the requests' tokens) bring on during a
    run (BENCHMARKS.md, sessions 18 and 19). Done before anything of the engine exists, so an LLM
    dropped later is reclaimed as usual; what the caller held then (objects that are still freed
    by their reference counts, but whose reference cycles would now stay) is the price, as for
    `gc.freeze()` anywhere. A process that froze its heap already is left as it is."""
    if not gc.get_freeze_count():
        gc.collect()  # what is garbage already is not kept
        gc.freeze()


def _return_freed_memory() -> None:
    """Give the float weights freed by quantization back to the OS (glibc keeps freed heap
    memory otherwise, and the process's resident size would stay at its loading peak)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@torch.no_grad()
def _init_random(net: LlamaForCausalLM, seed: int) -> None:
    """Dummy weights: N(0, 0.02) matrices, unit norms, zero biases (for performance work)."""
    for name, p in net.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            gen = torch.Generator(device=p.device).manual_seed(seed + zlib.crc32(name.encode()))
            p.normal_(0.0, 0.02, generator=gen)


def _found_draft(spec: SpeculativeConfig, model: str, load_format: str) -> SpeculativeConfig:
    """`spec` with `draft_model="auto"` resolved: the draft model found for the target's GGUF among
    the user's models (`find_draft_model`) where a method drafts with one (`auto`, `draft-model`),
    else none; `draft-model` without one found is an error."""
    if spec.draft_model != "auto":
        return spec
    found = draft_for(model, load_format) if spec.method == "auto" or "draft-model" in spec.methods else None
    if found is None and "draft-model" in spec.methods:
        raise ValueError(f"draft_model: 'auto' found no draft model for {model} among the GGUF files in "
                         f"{models_dir()} (a smaller model of its family with the same vocabulary); name one")
    if found is not None:
        logger.info("draft model: %s, found for %s in %s (--draft-model none: without one)", found, model,
                    models_dir())
    return dataclasses.replace(spec, draft_model=None if found is None else str(found))


class LLM:
    """Generate text with a Llama-family model, optionally with lossless speculative decoding
    (`speculative="ngram"`, or a SpeculativeConfig / dict such as {"method": "layer-skip", "num_tokens": 4}).

    >>> llm = LLM()                                   # the bundled SmolLM2-135M-Instruct
    >>> out = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))
    >>> out[0].text
    """

    def __init__(self, model: str = DEFAULT_MODEL, **options: Any) -> None:
        """`options`: the fields of EngineArgs (load_format, device, dtype, quantization,
        max_model_len, max_num_seqs, kv_cache_gb, speculative, ...)."""
        self.args = EngineArgs.from_kwargs(model, options)
        args = self.args
        _freeze_the_imports()
        if args.threads:
            torch.set_num_threads(args.threads)
        torch_dtype = parse_dtype(args.dtype)
        if torch_dtype == torch.bfloat16 and args.device == "cpu" and not bf16_works():
            logger.warning("dtype: bfloat16 matmuls cannot run on this CPU (probed); using float32")
            torch_dtype = torch.float32
            self.args = args = args.with_(dtype="float32")
        self._tokenizers = TokenizerCache()  # the target's, and a draft model's where it is the same
        self._drafts: list[LlamaForCausalLM] = []
        net, tokenizer, limit, precision = build_model(args.model, args.load_format, args.device, torch_dtype,
                                                       args.max_model_len, args.seed, args.quantization,
                                                       huge_pages=args.huge_pages == "load", tokenizers=self._tokenizers)
        config = args.engine_config(net.config, limit, precision)
        spec = with_model_defaults(_found_draft(args.speculative, args.model, args.load_format), args.model)
        self.engine = LLMEngine(config, net, tokenizer, spec, draft_builder=self._build_draft)
        # After the engine's build, whose forward probes time the weights as they are while nothing else runs
        self.huge_pages = self._collapse_into_huge_pages([net, *self._drafts])

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLM":
        options = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name != "model"}
        return cls(args.model, **options)

    def _build_draft(self, name: str, max_model_len: int, quantization: str,
                     vocab: int | None = None) -> tuple[LlamaForCausalLM, Any]:
        """A draft model for the draft-model drafter, loaded like the target (same precision rule; a
        GGUF run on its own blocks as `quantization` says: SpeculativeConfig.draft_quantization; its
        LM head cut to `vocab`: SpeculativeConfig.draft_vocab)."""
        a = self.args
        model, tokenizer, _, _ = build_model(name, "auto", a.device, parse_dtype(a.dtype), max_model_len, a.seed,
                                             a.quantization, gguf_q4_0=quantization == "q4_0", head_vocab=vocab,
                                             huge_pages=a.huge_pages == "load", tokenizers=self._tokenizers)
        self._drafts.append(model)
        return model, tokenizer

    def _collapse_into_huge_pages(self, models: list[LlamaForCausalLM]) -> PageCollapse | None:
        """With huge_pages "auto" on the CPU: the weights' regions collapsed into 2 MB pages in place,
        on a thread of its own, while the engine serves (specserve.model.huge_pages.PageCollapse)."""
        if self.args.huge_pages != "auto" or self.args.device != "cpu" or not huge_pages_available():
            return None
        return PageCollapse(collapse_regions(t for m in models for t in weights(m))).start()

    def wait_for_huge_pages(self, timeout: float | None = None) -> bool:
        """Block until the weights' collapse into huge pages (huge_pages "auto") is through, as a
        benchmark does before it times; whether it is (True where there is none)."""
        return self.huge_pages is None or self.huge_pages.wait(timeout)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion in one continuous batch; outputs in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise InvalidRequestError("params", f"{len(param_list)} sampling params for {len(prompt_list)} prompts")
        ids = []
        try:
            for prompt, p in zip(prompt_list, param_list):
                ids.append(self.engine.add_request(prompt, p))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation or to each of several."""
        if self.tokenizer is None:
            raise InvalidRequestError("messages", "this model has no tokenizer")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [apply_chat_template(self.tokenizer, conv) for conv in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield outputs for one request as tokens arrive (new_text holds the delta)."""
        rid = self.engine.add_request(prompt, params)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(rid)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        done: dict[str, RequestOutput] = {}
        pending = set(ids)
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm or len(ids) < 2) as bar:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        done[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
        return [done[r] for r in ids]
