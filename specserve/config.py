"""Frozen configuration objects: the model's shape and the engine's limits."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "smollm", "smollm2")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map a user-facing dtype name to a torch dtype, naming the field on error."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"dtype: unknown dtype {name!r}; choose one of {sorted(set(_DTYPES))}") from None


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `kind` is 'none', 'linear' or 'llama3'."""

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @staticmethod
    def from_hf(cfg: dict[str, Any] | None) -> "RopeScaling":
        if not cfg:
            return RopeScaling()
        kind = cfg.get("rope_type", cfg.get("type", "default"))
        if kind == "default":
            return RopeScaling()
        if kind == "linear":
            return RopeScaling(kind="linear", factor=float(cfg["factor"]))
        if kind == "llama3":
            return RopeScaling(
                kind="llama3",
                factor=float(cfg["factor"]),
                low_freq_factor=float(cfg.get("low_freq_factor", 1.0)),
                high_freq_factor=float(cfg.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(cfg.get("original_max_position_embeddings", 8192)),
            )
        raise ValueError(f"rope_scaling: unsupported rope type {kind!r} (supported: default, linear, llama3)")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_key_value_heads: {self.num_kv_heads} does not divide num_attention_heads {self.num_heads}"
            )

    @staticmethod
    def from_hf_dict(cfg: dict[str, Any]) -> "ModelConfig":
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type: {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return ModelConfig(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            rope_scaling=RopeScaling.from_hf(cfg.get("rope_scaling") or cfg.get("rope_parameters")),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama has them when attention_bias is set.
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            model_type=model_type,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @staticmethod
    def from_model_dir(path: str | Path) -> "ModelConfig":
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"model: {path} has no config.json")
        return ModelConfig.from_hf_dict(json.loads(cfg_path.read_text()))

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers-compatible config.json for this shape."""
        arch = "Qwen2ForCausalLM" if self.model_type == "qwen2" else "LlamaForCausalLM"
        model_type = "qwen2" if self.model_type == "qwen2" else "llama"
        out: dict[str, Any] = {
            "architectures": [arch],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if model_type == "llama":
            out["attention_bias"] = self.attention_bias
            out["mlp_bias"] = False
        if self.rope_scaling.kind == "linear":
            out["rope_scaling"] = {"rope_type": "linear", "factor": self.rope_scaling.factor}
        elif self.rope_scaling.kind == "llama3":
            rs = self.rope_scaling
            out["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": rs.factor,
                "low_freq_factor": rs.low_freq_factor,
                "high_freq_factor": rs.high_freq_factor,
                "original_max_position_embeddings": rs.original_max_position_embeddings,
            }
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            out["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        return out


# Named shapes for `--load-format dummy` (random weights, no download needed).
NAMED_SHAPES: dict[str, ModelConfig] = {
    "llama-3.1-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
        max_position_embeddings=131072, model_type="llama", bos_token_id=128000, eos_token_ids=(128001, 128009),
    ),
    "llama-3.2-1b": ModelConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
        num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(kind="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
        max_position_embeddings=131072, tie_word_embeddings=True, model_type="llama",
        bos_token_id=128000, eos_token_ids=(128001, 128009),
    ),
    "llama-2-7b": ModelConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
        num_kv_heads=32, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=4096, model_type="llama", bos_token_id=1, eos_token_ids=(2,),
    ),
    "mistral-7b": ModelConfig(
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1000000.0,
        max_position_embeddings=32768, model_type="mistral", bos_token_id=1, eos_token_ids=(2,),
    ),
    "qwen2.5-0.5b": ModelConfig(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
        num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=32768, tie_word_embeddings=True, attention_bias=True, model_type="qwen2",
        bos_token_id=151643, eos_token_ids=(151645,),
    ),
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, model_type="llama",
        bos_token_id=1, eos_token_ids=(2,),
    ),
}


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size and how many blocks (or how many bytes) to allocate."""

    block_size: int = 16
    num_blocks: int | None = None  # overrides kv_cache_bytes when set
    kv_cache_bytes: int = 1 << 30
    enable_prefix_caching: bool = True
    dtype: torch.dtype | None = None  # of the cached K/V; None: the model's dtype

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size: must be positive, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_kv_blocks: must be positive, got {self.num_blocks}")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes: must be positive, got {self.kv_cache_bytes}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: the per-step token budget and the number of sequences."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens: must be positive, got {self.max_num_batched_tokens}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs: must be positive, got {self.max_num_seqs}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_model_len: int = 2048
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    seed: int = 0
    attention_backend: str = "auto"  # auto | sdpa | cpu-paged
