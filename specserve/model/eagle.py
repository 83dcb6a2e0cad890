"""An EAGLE-style draft head: one decoder layer over the target's final hidden state and the
embedding of the next token (EAGLE-1/2), read out by the target's own LM head, or by a
frequency-ranked subset of its rows (FR-Spec) where the full head costs too much. With
`feature_layers` (EAGLE-3's fused features) the target's states after those layers join the last
one's through `fuse` before the head reads them.

Row j of the head takes (f_j, e(t_{j+1})): the target's final-normed hidden state at position j
and the embedding of the token that followed, and predicts f_{j+1}, whose LM-head logits are the
head's distribution for t_{j+2}. The head owns only its fc (and fuse) and its layer; embeddings
and LM head are the target's, passed in. Attention is a callable, so the same math runs batched over padded
training sequences and over a serving drafter's own per-request cache.

On disk (`save_head` / `load_head`): a directory with `config.json` and `model.safetensors`,
tensor names as in EAGLE-1/2 checkpoints (`fc.*`, `layers.0.*`), plus `vocab_ids` (the LM-head
rows the head reads out) and, for a fusing head, `fuse.weight`. Published EAGLE-1/2 checkpoints for a Llama target load from the same
names (their `config.json` is a Llama config, their layer has no input norm); EAGLE-3 heads
(`midlayer.*`, a layer over fused low/mid/high features) do not.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from specserve.config import ModelConfig
from specserve.model.llama import Linear, LlamaForCausalLM, RMSNorm, apply_rope, rope_inv_freq

HEAD_FORMAT = "specserve-eagle-1"

# (q [.., Hq, D], k [.., KVH, D], v [.., KVH, D]) -> [.., Hq, D]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class HeadConfig:
    """The head's shape. `draft_vocab_size` rows of the target's LM head are read out (all of
    them when it equals `vocab_size`); `input_norm`: whether the layer normalises its input (EAGLE-1
    layers do not)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float = 1e-5
    fc_bias: bool = True
    input_norm: bool = False
    target: str = ""  # what it was trained for, for the record
    # EAGLE-3's fused features: the target's residual stream after each of these many layers
    # (final-normed) joins the last layer's state, [low, mid, .., last] -> `fuse` -> hidden
    feature_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_layers", tuple(int(f) for f in self.feature_layers))
        if any(f < 1 for f in self.feature_layers) or len(set(self.feature_layers)) != len(self.feature_layers):
            raise ValueError(f"draft head: feature_layers must be distinct layer counts >= 1, got {self.feature_layers}")
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size",
                     "draft_vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"draft head: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"draft head: num_kv_heads {self.num_kv_heads} does not divide num_heads {self.num_heads}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft head: draft_vocab_size {self.draft_vocab_size} > vocab_size {self.vocab_size}")

    @staticmethod
    def for_target(cfg: ModelConfig, draft_vocab_size: int | None = None, target: str = "",
                   feature_layers: tuple[int, ...] = ()) -> "HeadConfig":
        """A head shaped like one layer of the target."""
        return HeadConfig(
            hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
            draft_vocab_size=min(draft_vocab_size or cfg.vocab_size, cfg.vocab_size), rms_norm_eps=cfg.rms_norm_eps,
            target=target, feature_layers=feature_layers,
        )

    def check_fits(self, cfg: ModelConfig, option: str = "draft_model") -> None:
        """Raise naming `option` unless the head reads and writes the target's hidden states and
        vocabulary."""
        for mine, theirs, what in ((self.hidden_size, cfg.hidden_size, "hidden size"),
                                   (self.vocab_size, cfg.vocab_size, "vocabulary size")):
            if mine != theirs:
                raise ValueError(f"{option}: the draft head's {what} is {mine} but the target's is {theirs}; "
                                 f"it was trained for another model ({self.target or 'unknown'})")
        if any(f > cfg.num_layers for f in self.feature_layers):
            raise ValueError(f"{option}: the draft head reads the target's states after layers {self.feature_layers} "
                             f"but the target has {cfg.num_layers}; it was trained for another model "
                             f"({self.target or 'unknown'})")


class _Attention(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.q_proj = Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.shape = (c.num_heads, c.num_kv_heads, c.head_dim)


class _MLP(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        if c.input_norm:
            self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)


class EagleHead(nn.Module):
    def __init__(self, config: HeadConfig, rope_theta: float = 10000.0, rope_scaling: Any = None) -> None:
        super().__init__()
        from specserve.config import RopeScaling

        self.config = config
        c = config
        self.fc = Linear(2 * c.hidden_size, c.hidden_size, bias=c.fc_bias)
        self.layers = nn.ModuleList([_Layer(c)])
        for m in self.modules():  # nn.Linear's initialisation (the projections' kernels come later, for serving)
            if isinstance(m, Linear):
                nn.init.kaiming_uniform_(m.weight, a=math.sqrt(5))
                if m.bias is not None:
                    bound = 1 / math.sqrt(m.weight.shape[1])
                    nn.init.uniform_(m.bias, -bound, bound)
        if c.feature_layers:  # starts as the last layer's state passed through: training adds what the others give
            # a plain torch Linear, not a kernel slot: serving keeps it in float32 (it runs once per
            # committed token, not per draft depth; int8 would quantize the target's states, whose
            # few large dims set the scale)
            self.fuse = nn.Linear((len(c.feature_layers) + 1) * c.hidden_size, c.hidden_size, bias=False)
            with torch.no_grad():
                self.fuse.weight.zero_()
                self.fuse.weight[:, -c.hidden_size :].copy_(torch.eye(c.hidden_size))
        self.register_buffer("vocab_ids", torch.arange(c.draft_vocab_size), persistent=True)
        inv = rope_inv_freq(c.head_dim, rope_theta, rope_scaling or RopeScaling())
        self.register_buffer("inv_freq", inv, persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def target_features(self, states: torch.Tensor) -> torch.Tensor:
        """What the head reads [..., H] from the target's states at a token: the last layer's
        [..., H] as it is; with `feature_layers`, [..., (layers + 1) * H] fused into one."""
        width = (len(self.config.feature_layers) + 1) * self.config.hidden_size
        if states.shape[-1] != width:
            raise ValueError(f"draft head: the target's states have {states.shape[-1]} columns, the head reads {width}")
        return self.fuse(states) if self.config.feature_layers else states

    def forward(
        self, features: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """features (the target's, through `target_features`, or the head's own outputs), embeds:
        [..., H]; positions: [...]. Returns the predicted next features [..., H]."""
        layer = self.layers[0]
        attn = layer.self_attn
        hq, hkv, d = attn.shape
        lead = features.shape[:-1]
        x = self.fc(torch.cat((embeds, features), dim=-1))
        h = layer.input_layernorm(x) if hasattr(layer, "input_layernorm") else x
        q = attn.q_proj(h).view(*lead, hq, d)
        k = attn.k_proj(h).view(*lead, hkv, d)
        v = attn.v_proj(h).view(*lead, hkv, d)
        cos, sin = self.rope(positions, x.dtype)
        q, k = apply_rope(q, k, cos.unsqueeze(-2), sin.unsqueeze(-2))
        x = x + attn.o_proj(attend(q, k, v).reshape(*lead, hq * d))
        return x + layer.mlp(layer.post_attention_layernorm(x))


def lm_head_weight(model: LlamaForCausalLM) -> torch.Tensor:
    """The target's LM head as a dense [vocab, hidden] matrix: its weight, or, where its kernel
    dropped the dense weight, read back from the kernel once."""
    weight = model.lm_head.weight
    if weight is not None:
        return weight.detach()
    eye = torch.eye(model.config.hidden_size, device=model.embed_tokens.weight.device)
    with torch.inference_mode():
        return model.lm_head(eye).T.contiguous()


def lm_head_rows(model: LlamaForCausalLM, ids: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """Rows `ids` of the target's LM head [len(ids), hidden] as float32, without the whole dense
    matrix where its kernel dropped it: read back from the kernel `chunk` hidden dims at a time
    (the same numbers as `lm_head_weight`'s, a few hundred MB less at its peak for a 150k vocabulary)."""
    weight = model.lm_head.weight
    if weight is not None:
        return weight.detach()[ids.to(weight.device)].float()
    hidden = model.config.hidden_size
    dev = model.norm.weight.device
    cols = ids.to(dev)
    out = torch.empty(len(ids), hidden, device=dev)
    with torch.inference_mode():
        for c in range(0, hidden, chunk):
            n = min(chunk, hidden - c)
            eye = torch.zeros(n, hidden, device=dev)
            eye[:, c : c + n] = torch.eye(n, device=dev)
            out[:, c : c + n] = model.lm_head(eye).float()[:, cols].T
    return out


def causal_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over [B, L, heads, D] (training): causal (each row sees the rows before it), or
    as `mask` [L, S] says (row i sees key j where it is True) for keys and values [B, S, KVH, D]."""
    rep = q.shape[-2] // k.shape[-2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k.repeat_interleave(rep, -2), v.repeat_interleave(rep, -2)))
    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True) if mask is None else \
        F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
    return out.transpose(1, 2)


def save_head(head: EagleHead, out: Path, extra: dict[str, Any] | None = None) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float16 if v.is_floating_point() else v.dtype).contiguous()
             for k, v in head.state_dict().items()}
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({"format": HEAD_FORMAT, **asdict(head.config), **(extra or {})},
                                                indent=2) + "\n")


def _eagle_config(raw: dict[str, Any], state: dict[str, torch.Tensor]) -> HeadConfig:
    """A published EAGLE-1/2 head's config.json is the target's Llama config (one layer)."""
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        return HeadConfig(
            hidden_size=hidden, num_heads=heads, num_kv_heads=int(raw.get("num_key_value_heads", heads)),
            head_dim=int(raw.get("head_dim") or hidden // heads), intermediate_size=int(raw["intermediate_size"]),
            vocab_size=int(raw["vocab_size"]), draft_vocab_size=int(raw["vocab_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), fc_bias="fc.bias" in state,
            input_norm="layers.0.input_layernorm.weight" in state, target=str(raw.get("_name_or_path", "")),
        )
    except KeyError as e:
        raise ValueError(f"draft_model: the head's config.json lacks {e.args[0]!r}") from None


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    st = path / "model.safetensors"
    if st.exists():
        from safetensors.torch import load_file

        return load_file(str(st))
    pt = path / "pytorch_model.bin"
    if pt.exists():
        return torch.load(str(pt), map_location="cpu", weights_only=True)
    raise ValueError(f"draft_model: {path} holds no model.safetensors or pytorch_model.bin")


def load_head(path: str | Path, rope_theta: float = 10000.0, rope_scaling: Any = None) -> EagleHead:
    """A head from a directory this package wrote or a published EAGLE-1/2 checkpoint; errors name
    the `draft_model` option."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise ValueError(f"draft_model: {path} is not a draft head directory (no config.json)")
    raw = json.loads((path / "config.json").read_text())
    state = _read_state(path)
    if any(k.startswith("midlayer.") for k in state):
        raise ValueError("draft_model: this is an EAGLE-3 head (midlayer.*); specserve loads EAGLE-1/2 heads and "
                         "its own (specserve train-drafter)")
    if raw.get("format") == HEAD_FORMAT:
        fields = {k: raw[k] for k in HeadConfig.__dataclass_fields__ if k in raw}
        config = HeadConfig(**fields)
    else:
        config = _eagle_config(raw, state)
    state = {k: v for k, v in state.items() if k.startswith(("fc.", "fuse.", "layers.0.")) or k == "vocab_ids"}
    if "vocab_ids" not in state:
        state["vocab_ids"] = torch.arange(config.draft_vocab_size)
    head = EagleHead(config, rope_theta, rope_scaling)
    missing, unexpected = head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()},
                                               strict=False)
    if missing or unexpected:
        raise ValueError(f"draft_model: the head's weights do not match its config (missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]})")
    return head.eval()
