"""Shared fixtures: tiny random Llama/Qwen2 checkpoints written as Hugging Face directories.

The models are made here, with transformers, so the tests need no download.
Their tokenizer is a byte-level BPE with no merges (one token per byte), so
multi-byte characters span several tokens, which exercises detokenization.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local; never reach for a hub
os.environ.setdefault("TQDM_DISABLE", "1")  # progress bars (generation, training) would flood failure reports
# The command line's `--draft-model auto` looks for a draft among the user's GGUF files: the tests
# see none of them (a test that wants one sets its own directory).
os.environ["SPECSERVE_MODELS"] = os.path.join(os.path.dirname(__file__), "no-such-models-dir")

from specserve.speculation.controller import FixedController, Selection  # noqa: E402 - after the env var


@pytest.fixture(scope="session", autouse=True)
def _engine_device() -> Any:
    """SPECSERVE_TEST_DEVICE=cuda runs every engine the tests build (that names no device) on that
    device, module fixtures included: the same properties checked on the GPU path. CI leaves it
    unset (the CPU)."""
    device = os.environ.get("SPECSERVE_TEST_DEVICE")
    if not device:
        yield
        return
    from specserve.entrypoints.llm import LLM
    from specserve.model.loader import DEFAULT_MODEL

    original = LLM.__init__

    def on_device(self: Any, model: str = DEFAULT_MODEL, **options: Any) -> None:
        options.setdefault("device", device)
        original(self, model, **options)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LLM, "__init__", on_device)
        yield

BYTE_VOCAB = 258  # <s>, </s>, then one token per byte
EOS_ID = 1
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def write_byte_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<s>": 0, "</s>": 1, **{ch: i + 2 for i, ch in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def make_tiny_model(path: Path, arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    base: dict[str, Any] = dict(
        vocab_size=BYTE_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        initializer_range=0.2,  # peaked logits: fewer near-ties under greedy decoding
        bos_token_id=0,
        eos_token_id=EOS_ID,
        tie_word_embeddings=False,
    )
    base.update(overrides)
    torch.manual_seed(seed)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**base))
    else:
        model = LlamaForCausalLM(LlamaConfig(**base))
    model.save_pretrained(str(path))
    write_byte_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    made: dict[str, Path] = {}

    def factory(name: str = "llama", arch: str = "llama", **overrides: Any) -> Path:
        if name not in made:
            made[name] = make_tiny_model(tmp_path_factory.mktemp(name), arch, **overrides)
        return made[name]

    return factory


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("qwen2", arch="qwen2", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def bundled_model_dir() -> Path:
    from specserve.model.loader import ModelNotFoundError, model_dir_for

    try:
        return model_dir_for("smollm2-135m")
    except ModelNotFoundError as e:
        pytest.skip(str(e))


def random_prompts(n: int, seed: int = 0, low: int = 3, high: int = 40, vocab: int = BYTE_VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (n,), generator=g).tolist()
    return [torch.randint(2, vocab, (L,), generator=g).tolist() for L in lengths]


class ShuffledGrants(FixedController):
    """A speculation controller whose grants change every step: each request keeps a random
    number of its draft nodes (0 included), whatever they are worth. Outputs must not notice."""

    def __init__(self, seed: int = 0) -> None:
        import random

        self.rng = random.Random(seed)

    def select(self, base: Any, sampling_rows: int, candidates: list, behind_plain: bool = False) -> Any:
        counts = tuple(self.rng.randint(0, len(c.values)) for c in candidates)
        return Selection(counts, float(sampling_rows), float("nan"), 0.0)


def record_proposed_tokens(drafter: Any) -> list[int]:
    """A list that collects every token `drafter` proposes from now on (its `propose` wrapped)."""
    propose, seen = drafter.propose, []

    def spy(requests: Any) -> Any:
        out = propose(requests)
        seen.extend(t for tree in out for t in tree.tokens)
        return out

    drafter.propose = spy
    return seen


def shuffle_grants(llm: Any, seed: int = 0) -> Any:
    """`llm` with its speculation controller replaced by ShuffledGrants."""
    llm.engine.speculator.controller = ShuffledGrants(seed)
    return llm



def write_random_head(target: Path, out: Path, seed: int = 0, draft_vocab: int | None = None) -> Path:
    """An untrained EAGLE-style head shaped for the HF model at `target` (its drafts are random)."""
    import json

    from specserve.config import ModelConfig
    from specserve.model.eagle import EagleHead, HeadConfig, save_head

    cfg = ModelConfig.from_hf_dict(json.loads((target / "config.json").read_text()))
    torch.manual_seed(seed)
    head = EagleHead(HeadConfig.for_target(cfg, draft_vocab, target=str(target)), cfg.rope_theta)
    if draft_vocab is not None:  # the upper ids, so that some tokens are outside the head's vocabulary
        head.vocab_ids.copy_(torch.arange(cfg.vocab_size - draft_vocab, cfg.vocab_size))
    save_head(head, out)
    return out


def write_copy_head(target: Path, out: Path, fused: bool = False) -> Path:
    """A head that computes what the one-layer HF model at `target` computes: fc passes the next
    token's embedding through, and the layer is the target's own. Row j (feature f_j, token t_{j+1})
    then gives the target's output at t_{j+1} up to the final norm (whose weights are ones), so its
    drafts are the target's choices, save for what the first token adds to the target's attention.
    `fused`: an EAGLE-3-style head reading the state after layer 1 beside the last (the same state
    here), its `fuse` keeping the last."""
    import json

    from safetensors.torch import load_file

    from specserve.config import ModelConfig
    from specserve.model.eagle import EagleHead, HeadConfig, save_head

    cfg = ModelConfig.from_hf_dict(json.loads((target / "config.json").read_text()))
    assert cfg.num_layers == 1
    hf = load_file(str(target / "model.safetensors"))
    assert torch.equal(hf["model.norm.weight"], torch.ones(cfg.hidden_size))
    c = HeadConfig.for_target(cfg, target=str(target), feature_layers=(1,) if fused else ())
    head = EagleHead(HeadConfig(**{**c.__dict__, "input_norm": True}), cfg.rope_theta)
    state = {k[len("model."):]: v for k, v in hf.items() if k.startswith("model.layers.0.")}
    eye = torch.eye(cfg.hidden_size)
    if fused:
        state["fuse.weight"] = torch.cat((torch.zeros_like(eye), eye), dim=1)
    state["fc.weight"] = torch.cat((eye, torch.zeros_like(eye)), dim=1)
    state["fc.bias"] = torch.zeros(cfg.hidden_size)
    state["vocab_ids"] = torch.arange(cfg.vocab_size)
    head.load_state_dict(state)
    save_head(head, out)
    return out
