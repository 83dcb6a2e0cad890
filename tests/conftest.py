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

from specserve.speculation.controller import FixedController, Selection  # noqa: E402 - after the env var

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

    def select(self, base: Any, sampling_rows: int, candidates: list) -> Any:
        counts = tuple(self.rng.randint(0, len(c.values)) for c in candidates)
        return Selection(counts, float(sampling_rows), float("nan"), 0.0)


def shuffle_grants(llm: Any, seed: int = 0) -> Any:
    """`llm` with its speculation controller replaced by ShuffledGrants."""
    llm.engine.speculator.controller = ShuffledGrants(seed)
    return llm

