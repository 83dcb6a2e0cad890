"""Speculative decoding is lossless: greedy outputs are token for token the plain outputs, sampled
outputs follow the target's exact distribution, stops inside accepted runs cut where plain decoding
would, and no KV block leaks."""

from __future__ import annotations

import time

import dataclasses
import itertools
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

from specserve import LLM, SamplingParams

from conftest import random_prompts, record_proposed_tokens, shuffle_grants

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def draft_dir(tiny_model_factory) -> Path:
    """A different (worse) model with the same tokenizer: its drafts are mostly rejected."""
    return tiny_model_factory("draft", seed=1, num_hidden_layers=1)


def spec_configs(target: Path, draft: Path) -> dict[str, dict]:
    return {
        "ngram": dict(method="ngram", num_tokens=4, controller="fixed"),
        "ngram-tree": dict(method="ngram", num_tokens=6, controller="fixed", width=3),
        "suffix": dict(method="suffix", num_tokens=6, controller="fixed"),
        "recycling": dict(method="recycling", num_tokens=6, controller="fixed"),
        "draft-model": dict(method="draft-model", num_tokens=4, controller="fixed", draft_model=str(draft)),
        # the target drafting for itself: every draft accepted
        "draft-model-self": dict(method="draft-model", num_tokens=4, controller="fixed", draft_model=str(target)),
        "layer-skip": dict(method="layer-skip", num_tokens=3, controller="fixed", draft_layers=1),
    }


@pytest.fixture(scope="module")
def plain_outputs(tiny_llama: Path) -> list[list[int]]:
    llm = LLM(str(tiny_llama))
    return [o.token_ids for o in llm.generate(random_prompts(8, seed=21), GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("name", list(spec_configs(Path(), Path())))
@pytest.mark.parametrize(
    "engine_opts",
    [dict(max_num_batched_tokens=24), dict(num_kv_blocks=24, block_size=4)],
    ids=["chunked-prefill", "preemption"],
)
def test_greedy_speculation_matches_plain_decoding(
    tiny_llama: Path, draft_dir: Path, plain_outputs: list[list[int]], name: str, engine_opts: dict
) -> None:
    """Greedy output is the plain output whatever drafts each request is granted, step by step."""
    spec = spec_configs(tiny_llama, draft_dir)[name]
    llm = shuffle_grants(LLM(str(tiny_llama), speculative=spec, **engine_opts), seed=len(name))
    outs = llm.generate(random_prompts(8, seed=21), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == plain_outputs
    engine = llm.engine
    assert engine.draft_totals.steps > 0 and engine.draft_totals.proposed > 0
    if "num_kv_blocks" in engine_opts:
        assert engine.stats().num_preemptions > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    if name == "draft-model-self":
        assert engine.draft_totals.accepted == engine.draft_totals.proposed  # the target agrees with itself
    per_request = [o.metrics.speculation for o in outs]
    assert sum(s.proposed for s in per_request) == engine.draft_totals.proposed
    assert sum(s.accepted for s in per_request) == engine.draft_totals.accepted


@pytest.fixture(scope="module")
def plain_int4_outputs(tiny_llama: Path) -> list[list[int]]:
    # the same chunking as below: int4 prefills of 64+ rows take a float GEMM, equal only up to rounding
    llm = LLM(str(tiny_llama), quantization="int4", max_num_batched_tokens=24, device="cpu")  # the CPU's native path
    return [o.token_ids for o in llm.generate(random_prompts(8, seed=21), GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("name", ["ngram-tree", "suffix", "recycling", "layer-skip", "draft-model"])
def test_greedy_speculation_matches_plain_decoding_on_the_int4_native_path(
    tiny_llama: Path, draft_dir: Path, plain_int4_outputs: list[list[int]], name: str
) -> None:
    """With int4 weights, decode and verification steps run every layer in one native call (trees
    through the native attention's ancestor masks): still token for token plain decoding."""
    llm = LLM(str(tiny_llama), speculative=spec_configs(tiny_llama, draft_dir)[name], quantization="int4",
              max_num_batched_tokens=24, device="cpu")
    assert llm.engine.model._native(llm.engine.runner.kv_cache, torch.zeros(1, 64)) is not None
    outs = llm.generate(random_prompts(8, seed=21), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == plain_int4_outputs
    assert llm.engine.draft_totals.steps > 0


@pytest.mark.parametrize("name", ["ngram-tree", "recycling", "draft-model"])
def test_greedy_speculation_matches_plain_decoding_through_sdpa(
    tiny_llama: Path, draft_dir: Path, name: str
) -> None:
    """The SDPA backend (the GPU's attention: trees as padded query rows with ancestor masks, the
    valid rows picked out by host-made indices) gives plain decoding's tokens too, checked here on
    the CPU where CI runs."""
    opts = dict(attention_backend="sdpa", max_num_batched_tokens=24)
    plain = LLM(str(tiny_llama), **opts).generate(random_prompts(8, seed=21), GREEDY, use_tqdm=False)
    llm = shuffle_grants(LLM(str(tiny_llama), speculative=spec_configs(tiny_llama, draft_dir)[name], **opts), seed=3)
    outs = llm.generate(random_prompts(8, seed=21), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert llm.engine.draft_totals.steps > 0 and llm.engine.draft_totals.proposed > 0


def test_sdpa_never_offers_torch_cudnn_attention(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every SDPA call of the backend runs with cuDNN's attention switched off: cuDNN builds a graph
    for each new (query, key) length, which a draft tree changes nearly every step (on an H100 a
    drafted step cost ~2.5x a plain one with it, ~1.1x without). The flag is global, so it is
    read inside the calls, on the CPU as on a GPU."""
    import torch.nn.functional as F

    from specserve.model.attention import sdpa

    seen: list[bool] = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", spy)
    llm = LLM(str(tiny_llama), attention_backend="sdpa", speculative="ngram")
    llm.generate(random_prompts(2, seed=5), GREEDY, use_tqdm=False)
    assert seen and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after each call


# ---------------------------------------------------------------------------
# Lossless sampling, checked exactly on a 4-token vocabulary

VOCAB = 4
PROMPT = [0, 1, 2, 3, 1]


@pytest.fixture(scope="module")
def small_vocab(tiny_model_factory) -> tuple[Path, Path]:
    opts = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, initializer_range=0.15)
    return (tiny_model_factory("v4-target", **opts, seed=3),
            tiny_model_factory("v4-draft", **opts, seed=4, num_hidden_layers=1))


def exact_distribution(target: Path, params: SamplingParams, n_tokens: int = 3) -> dict[tuple[int, ...], float]:
    """P(first n tokens) by enumerating every continuation with transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(n_tokens):
        nxt: dict[tuple[int, ...], float] = {}
        for prefix, p in probs.items():
            with torch.no_grad():
                logits = model(torch.tensor([PROMPT + list(prefix)])).logits[0, -1]
            for token, bias in params.logit_bias:
                logits[token] += bias
            logits = logits / params.temperature
            dist = logits.softmax(-1)
            if params.top_p < 1:
                order = dist.argsort(descending=True)
                keep = (dist[order].cumsum(0) - dist[order]) < params.top_p
                mask = torch.zeros_like(dist, dtype=torch.bool)
                mask[order[keep]] = True
                dist = torch.where(mask, dist, 0.0)
                dist = dist / dist.sum()
            for t in range(VOCAB):
                nxt[prefix + (t,)] = p * dist[t].item()
        probs = nxt
    return probs


def sample_counts(target: Path, spec: dict, params: SamplingParams, n: int) -> tuple[dict[tuple[int, ...], int], LLM]:
    """The first three tokens of n sampled outputs. Every request must end normally with at least
    three tokens: a request that errored (a token its grammar forbids, a broken distribution) or
    stopped short would otherwise drop out of the counts and hide a lossy rule."""
    llm = shuffle_grants(LLM(str(target), speculative=spec, max_num_seqs=256, seed=7))
    outs = llm.generate([PROMPT] * n, params, use_tqdm=False)
    assert len(outs) == n
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        assert o.finish_reason in ("length", "stop") and o.error is None, (o.finish_reason, o.error)
        assert len(o.token_ids) >= 3, o.token_ids
        counts[tuple(o.token_ids[:3])] = counts.get(tuple(o.token_ids[:3]), 0) + 1
    return counts, llm


def chi2_pvalue(counts: dict[tuple[int, ...], int], exact: dict[tuple[int, ...], float], n: int) -> float:
    """Pearson's test of n counted outcomes against `exact`: every count is in, none rescaled (an
    outcome the exact distribution gives probability 0 fails at once)."""
    assert sum(counts.values()) == n, f"{sum(counts.values())} of {n} outputs counted"
    if any(exact.get(k, 0.0) == 0.0 for k in counts):
        return 0.0
    keys = sorted(exact, key=lambda k: -exact[k])
    obs, exp = [], []
    rest_o, rest_e = 0.0, 0.0
    for k in keys:  # bins expected to hold fewer than 5 draws are pooled
        if exact[k] * n >= 5:
            obs.append(counts.get(k, 0))
            exp.append(exact[k] * n)
        else:
            rest_o += counts.get(k, 0)
            rest_e += exact[k] * n
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    total = sum(exp)
    return float(chisquare(obs, [e * n / total for e in exp]).pvalue)


SAMPLING_CASES = {
    "chain-draft-model-t1": ("draft-model", 3, 1, SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)),
    "chain-draft-model-top-p": ("draft-model", 3, 1,
                                SamplingParams(max_tokens=6, temperature=1.0, top_p=0.8, ignore_eos=True)),
    "chain-layer-skip-t0.8": ("layer-skip", 2, 1, SamplingParams(max_tokens=6, temperature=0.8, ignore_eos=True)),
    "tree-ngram-t1": ("ngram", 4, 3, SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)),
    "tree-recycling-top-p": ("recycling", 4, 1,
                             SamplingParams(max_tokens=6, temperature=1.0, top_p=0.8, ignore_eos=True)),
    # chains that end where the draft's confidence in its own (sampled) pick is low
    "chain-draft-model-stopping": ("draft-model", 4, 1, SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True),
                                   0.3),
    "chain-draft-model-logit-bias": ("draft-model", 3, 1, SamplingParams(
        max_tokens=6, temperature=1.0, ignore_eos=True, logit_bias={0: 1.5, 2: -1.0})),
    "tree-ngram-logit-bias": ("ngram", 4, 3, SamplingParams(
        max_tokens=6, temperature=0.8, ignore_eos=True, logit_bias={1: -2.0, 3: 0.7})),
    # a draft whose LM head reads out only tokens 0 and 1 (draft_vocab): it never proposes 2 or 3,
    # which the target draws; the draft's distribution is 0 there
    "chain-draft-model-vocab-cut": ("draft-model", 3, 1, SamplingParams(max_tokens=6, temperature=1.0,
                                                                        ignore_eos=True), 0.0, 2),
}


def _spec(method: str, k: int, width: int, draft: Path, stop_below: float = 0.0, draft_vocab: int | None = None) -> dict:
    spec: dict = dict(method=method, num_tokens=k, width=width, controller="fixed", draft_stop_below=stop_below)
    if method == "draft-model":
        spec["draft_model"] = str(draft)
        spec["draft_vocab"] = draft_vocab
    if method == "layer-skip":
        spec["draft_layers"] = 1
    return spec


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_speculative_sampling_matches_exact_distribution(small_vocab: tuple[Path, Path], case: str) -> None:
    target, draft = small_vocab
    method, k, width, params, *stop = SAMPLING_CASES[case]
    n = 3000
    counts, llm = sample_counts(target, _spec(method, k, width, draft, *stop), params, n)
    totals = llm.engine.draft_totals
    assert totals.proposed > 0 and 0 < totals.accepted < totals.proposed, "needs both accepts and rejections"
    if case.endswith("vocab-cut"):  # the target draws tokens the draft never proposes
        assert any(t >= 2 for k in counts for t in k)
    assert chi2_pvalue(counts, exact_distribution(target, params), n) > 0.001


# ---------------------------------------------------------------------------
# Edge cases


@pytest.fixture(scope="module")
def self_drafting(tiny_llama: Path) -> LLM:
    """The target drafting for itself: every draft is accepted, so runs cross every stop."""
    return LLM(str(tiny_llama), speculative=dict(method="draft-model", num_tokens=6, draft_model=str(tiny_llama)))


def test_accepted_run_is_cut_at_max_tokens(tiny_llama: Path, self_drafting: LLM) -> None:
    prompts = random_prompts(4, seed=22)
    for max_tokens in (1, 2, 5, 9):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        plain = LLM(str(tiny_llama)).generate(prompts, params, use_tqdm=False)
        spec = self_drafting.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
        assert all(len(o.token_ids) == max_tokens and o.finish_reason == "length" for o in spec)


def test_accepted_run_is_cut_at_stop_token(tiny_llama: Path, self_drafting: LLM) -> None:
    prompt = random_prompts(1, seed=23)[0]
    free = self_drafting.generate(prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
                                  use_tqdm=False)[0]
    stop = free.token_ids[7]
    out = self_drafting.generate(prompt, SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop],
                                                        ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == free.token_ids[: free.token_ids.index(stop) + 1]
    assert out.finish_reason == "stop"


def test_request_near_the_context_limit(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), max_model_len=64, speculative=dict(method="draft-model", num_tokens=6,
                                                                 draft_model=str(tiny_llama)))
    plain = LLM(str(tiny_llama), max_model_len=64)
    prompt = random_prompts(1, seed=24, low=60, high=61)[0]
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert out.token_ids == plain.generate(prompt, params, use_tqdm=False)[0].token_ids
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_budget_zero_is_plain_decoding(tiny_llama: Path, plain_outputs: list[list[int]]) -> None:
    llm = LLM(str(tiny_llama), speculative=dict(method="ngram", num_tokens=0))
    assert not llm.engine.speculator.enabled
    outs = llm.generate(random_prompts(8, seed=21), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == plain_outputs


def test_mixed_batch_some_speculate_some_do_not(tiny_llama: Path) -> None:
    """Requests with one token left (no room to draft), greedy and seeded sampled requests share
    steps with speculating ones: each greedy request gets exactly its plain output, and each
    seeded sampled request exactly what it draws when it runs alone with the same drafter."""
    prompts = random_prompts(8, seed=25)
    params = [SamplingParams(max_tokens=1 if i % 3 == 0 else 20, temperature=0, ignore_eos=True) for i in range(6)]
    params += [SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=40 + i, ignore_eos=True)
               for i in range(2)]
    # fixed grants: the target drafting for itself never pays, and the goodput controller would not draft
    spec = dict(method="draft-model", num_tokens=4, draft_model=str(tiny_llama), controller="fixed")
    plain = LLM(str(tiny_llama)).generate(prompts[:6], params[:6], use_tqdm=False)
    llm = LLM(str(tiny_llama), speculative=spec)
    mixed = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in mixed[:6]] == [o.token_ids for o in plain]
    assert all(o.metrics.speculation.steps == 0 for o, p in zip(mixed, params) if p.max_tokens == 1)
    for i in (6, 7):
        alone = LLM(str(tiny_llama), speculative=spec).generate(prompts[i], params[i], use_tqdm=False)[0]
        assert mixed[i].token_ids == alone.token_ids
        assert mixed[i].metrics.speculation.steps > 0


def test_a_seeded_requests_drafts_depend_only_on_its_seed_and_positions(tiny_llama: Path, draft_dir: Path) -> None:
    """A drafter draws a seeded request's draft tokens from generators derived from its seed and
    each token's position, as the target's noise is (the seed is the request's one random state):
    asked twice from the same point, it proposes the same tree; another seed, another tree. (EAGLE
    draws the same way, by position and parent node; it proposes only after target features.)"""
    from specserve.speculation.drafter import DraftRequest, RequestView

    method = "draft-model"
    spec = dict(method=method, num_tokens=4, controller="fixed", draft_model=str(draft_dir))
    llm = LLM(str(tiny_llama), speculative=spec)
    drafter = llm.engine.speculator.drafters[method]
    prompt = tuple(random_prompts(1, seed=30)[0])

    def propose(seed: int) -> list[int]:
        params = SamplingParams(max_tokens=24, temperature=1.0, seed=seed)
        return list(drafter.propose([DraftRequest(RequestView("r", prompt, (), params), 4)])[0].tokens)

    trees = {seed: [propose(seed) for _ in range(3)] for seed in range(6)}
    assert all(t[0] and t[0] == t[1] == t[2] for t in trees.values()), trees
    assert len({tuple(t[0]) for t in trees.values()}) > 1, trees


def test_no_blocks_leak_after_aborts_with_speculation(tiny_llama: Path, draft_dir: Path) -> None:
    llm = LLM(str(tiny_llama), num_kv_blocks=30, block_size=4,
              speculative=dict(method="draft-model", num_tokens=4, draft_model=str(draft_dir)))
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True))
           for p in random_prompts(8, seed=26)]
    for step in itertools.count():
        if not engine.has_unfinished_requests():
            break
        engine.step()
        if step == 3:
            engine.abort_request(ids[1])
            engine.abort_request(ids[6])
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    pool = engine.speculator.drafters["draft-model"].kv
    assert pool.blocks.num_free_blocks == pool.blocks.num_blocks  # the draft model's own cache too


# ---------------------------------------------------------------------------
# The bundled model, 16 Spec-Bench prompts in one mixed batch


@pytest.fixture(scope="module")
def smollm_prompts(bundled_model_dir: Path) -> list[list[int]]:
    from specserve.bench.spec import load_by_category
    from specserve.tokenizer import apply_chat_template, load_tokenizer

    try:
        questions = load_by_category(None, 2)[:16]
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tok = load_tokenizer(bundled_model_dir)
    return [apply_chat_template(tok, [{"role": "user", "content": q}]) for _, q in questions]


@pytest.fixture(scope="module")
def smollm_plain(smollm_prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM("smollm2-135m")
    return [o.token_ids for o in llm.generate(smollm_prompts, SMOLLM_GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def smollm_draft_dir(bundled_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real smaller draft with the same tokenizer: SmolLM2's first 8 layers, norm and head."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("smollm-8-layers")
    cfg = json.loads((bundled_model_dir / "config.json").read_text())
    cfg["num_hidden_layers"] = 8
    (out / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(bundled_model_dir / "model.safetensors"))
    keep = {k: v for k, v in state.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < 8}
    save_file(keep, str(out / "model.safetensors"))
    for f in bundled_model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            shutil.copy(f, out / f.name)
    return out


SMOLLM_GREEDY = SamplingParams(max_tokens=40, temperature=0)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "suffix", "recycling", "layer-skip", "draft-model", "eagle"])
def test_bundled_model_greedy_equivalence_every_drafter(
    smollm_prompts: list[list[int]], smollm_plain: list[list[int]], smollm_draft_dir: Path, method: str
) -> None:
    # Grants drawn at random step by step (0 to K nodes a request): every drafter drafts on every
    # run, whatever the machine's timing (under the goodput controller a draft that does not pay on
    # this model can be kept off for a whole run, and then nothing would be checked).
    spec: dict = dict(method=method, num_tokens=4, controller="fixed")
    if method == "draft-model":
        spec["draft_model"] = str(smollm_draft_dir)
    for opts in (dict(max_num_batched_tokens=256), dict(num_kv_blocks=48)):  # chunked prefill; preemption
        llm = shuffle_grants(LLM("smollm2-135m", speculative=spec, **opts), seed=len(method))
        outs = llm.generate(smollm_prompts, SMOLLM_GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == smollm_plain, (method, opts)
        engine = llm.engine
        assert engine.draft_totals.steps > 0
        if "num_kv_blocks" in opts:
            assert engine.stats().num_preemptions > 0
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(method="nope"), "spec"),
        (dict(method="ngram", num_tokens=-1), "spec_tokens"),
        (dict(method="suffix", width=2), "spec_width"),
        (dict(method="draft-model"), "draft_model"),
        (dict(method="layer-skip", draft_layers=0), "draft_layers"),
        (dict(method="draft-model", draft_model="d.gguf", draft_quantization="q8_0"), "draft_quantization"),
        (dict(method="draft-model", draft_model="d.gguf", draft_window=0), "draft_window"),
        (dict(method="draft-model", draft_model="d.gguf", draft_vocab=0), "draft_vocab"),
        (dict(method="auto", latency_slo_ms=0), "spec_latency_slo"),
        (dict(method="auto", latency_slack=-0.5), "spec_latency_slack"),
    ],
)
def test_bad_spec_options_name_the_field(kwargs: dict, field: str) -> None:
    from specserve.speculation.config import SpeculativeConfig

    with pytest.raises(ValueError, match=f"^{field}:"):
        SpeculativeConfig(**kwargs)


@pytest.mark.parametrize("method", ["auto", "ngram"])
def test_greedy_speculation_with_a_logit_bias_matches_plain(tiny_llama: Path, plain_outputs: list[list[int]],
                                                          method: str) -> None:
    """A logit bias moves greedy output (it bans each plain output's most frequent token), and with
    speculation under any grants the biased output is still plain decoding's, token for token."""
    prompts = random_prompts(8, seed=21)
    banned = max(set(plain_outputs[0]), key=plain_outputs[0].count)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logit_bias={banned: -100, 65: 3.0})
    plain = [o.token_ids for o in LLM(str(tiny_llama)).generate(prompts, params, use_tqdm=False)]
    assert plain != plain_outputs and all(banned not in p for p in plain)
    llm = shuffle_grants(LLM(str(tiny_llama), speculative=dict(method=method, num_tokens=4)), seed=3)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == plain
    assert llm.engine.draft_totals.proposed > 0


def test_a_draft_model_far_behind_catches_up_apart_and_drafts_the_same(tiny_llama: Path, draft_dir: Path) -> None:
    """A request more tokens behind than a drafting step feeds (its prompt, or the steps decoded
    plainly since it last drafted) is fed to the draft model in a forward of its own, timed apart
    (`catch_up_seconds`, which the speculator does not count as the drafts' cost): the drafts are
    those of feeding it all in the first draft forward."""
    prompts = random_prompts(3, seed=26, low=30, high=40)
    seen: dict[int, list] = {}
    for catch_up in (8, 10**9):
        llm = LLM(str(tiny_llama), speculative=dict(method="draft-model", num_tokens=4, controller="fixed",
                                                    draft_model=str(draft_dir)))
        drafter = llm.engine.speculator.drafters["draft-model"]
        drafter.CATCH_UP = catch_up
        propose, log = drafter.propose, seen.setdefault(catch_up, [])

        def spy(requests, propose=propose, log=log, drafter=drafter):  # type: ignore[no-untyped-def]
            trees = propose(requests)
            log.append(([t.tokens for t in trees], drafter.catch_up_seconds))
            return trees

        drafter.propose = spy
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [t for t, _ in seen[8]] == [t for t, _ in seen[10**9]]
    assert seen[8][0][1] > 0 and all(s == 0 for _, s in seen[10**9])
    assert sum(1 for _, s in seen[8] if s > 0) < len(seen[8])  # only the first step of each is behind here


def test_a_draft_model_reads_only_its_window_of_a_long_prompt(tiny_llama: Path, draft_dir: Path) -> None:
    """With `draft_window` W, a draft model fed a prompt longer than W reads only its last W tokens
    (from its own position 0): it drafts what it drafts for those tokens as a whole prompt, is fed
    nothing before them, and follows the generated tokens after; the output stays plain decoding's."""
    from specserve.speculation.drafter import DraftRequest, RequestView

    prompt = random_prompts(1, seed=28, low=30, high=31)[0]
    llm = LLM(str(tiny_llama), speculative=dict(method="draft-model", num_tokens=4, controller="fixed",
                                                draft_model=str(draft_dir), draft_window=12))
    drafter = llm.engine.speculator.drafters["draft-model"]
    forward, fed = drafter.forward, []

    def spy(items, *args, **kwargs):  # type: ignore[no-untyped-def]
        fed.extend(items)
        return forward(items, *args, **kwargs)

    drafter.forward = spy

    def drafts(rid: str, ids: list[int]) -> list[int]:
        return list(drafter.propose([DraftRequest(RequestView(rid, tuple(ids), (), GREEDY), 4)])[0].tokens)

    windowed = drafts("long", prompt)
    assert fed[0].start == 0 and list(fed[0].tokens) == prompt[-12:-1]  # caught up apart: the window but its last token
    assert sum(len(item.tokens) for item in fed) == 12 + len(windowed) - 1
    drafter.window = None
    assert windowed == drafts("alone", prompt[-12:])
    assert windowed != drafts("whole", prompt)  # the prompt's head changes the drafts: the window mattered
    drafter.window = 12
    fed.clear()
    assert [o.token_ids for o in llm.generate([prompt], GREEDY, use_tqdm=False)] == \
        [o.token_ids for o in LLM(str(tiny_llama)).generate([prompt], GREEDY, use_tqdm=False)]
    assert fed and min(item.start for item in fed) == 0 and max(item.start for item in fed) < 12 + GREEDY.max_tokens


def test_a_draft_model_is_not_run_where_its_catch_up_costs_more_than_the_request_has_left(
    tiny_llama: Path, draft_dir: Path
) -> None:
    """A request whose draft model would first catch up on more tokens than a step feeds (its
    prompt here) is not drafted for by the model when that catch-up, at the measured seconds a token,
    costs more than MAX_CATCH_UP_SHARE of the request's remaining plain decoding and CATCH_UP_SHARE
    of what its drafts are expected to save: with catching up
    priced at 10 s a token the model is never asked (nor explored), priced at nothing it is; the
    output is plain decoding's either way."""
    prompts = random_prompts(3, seed=29, low=30, high=40)
    plain = [o.token_ids for o in LLM(str(tiny_llama)).generate(prompts, GREEDY, use_tqdm=False)]
    for per_token, asked in ((10.0, False), (0.0, True)):
        llm = LLM(str(tiny_llama), speculative=dict(method="draft-model", num_tokens=4, draft_model=str(draft_dir)))
        drafter = llm.engine.speculator.drafters["draft-model"]
        propose, seen = drafter.propose, []

        def spy(requests, propose=propose, seen=seen, drafter=drafter, per_token=per_token):  # type: ignore[no-untyped-def]
            seen.extend(r for r in requests if r.budget > 0)
            out = propose(requests)
            drafter._per_token = per_token  # as if measured so
            return out

        drafter._per_token = per_token
        drafter.propose = spy
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == plain
        assert bool(seen) is asked


def test_a_draft_models_catch_up_is_weighed_against_what_its_drafts_save_beyond_the_lookups(
    tiny_llama: Path, draft_dir: Path
) -> None:
    """The catch-up rule's arithmetic, on one request whose draft is 39 tokens behind (its prompt),
    at 10 ms a plain step: a catch-up of 0.3 s, above MAX_CATCH_UP_SHARE (5%) of 200 tokens' plain
    time (0.1 s), runs where the model's chain (0.8, 0.7, 0.6, 0.5 at 0.3 tokens a node: 1.4 tokens
    net in 3.6 a step, 0.39 of a token's time saved, 0.78 s over 200 tokens) pays twice for it and
    no lookup is on; not where a lookup is on and expected to give more (its drafts need no catch-up),
    nor where 20 tokens are left to repay it (0.08 s saved); a catch-up within 5% always runs (the
    estimates are then tried, not trusted)."""
    from specserve.speculation.controller import StepShape
    from specserve.speculation.drafter import DraftRequest, RequestView
    from specserve.speculation.speculator import Decode, _Offer, _Step

    llm = LLM(str(tiny_llama), speculative=dict(method="auto", draft_model=str(draft_dir)))
    speculator = llm.engine.speculator
    model = speculator.drafters["draft-model"]
    values, per_node = (0.8, 0.7, 0.6, 0.5, 0.2), 0.3

    def unpaid(lookups: bool, left: int, per_token: float = 0.3 / 39) -> bool:
        view = RequestView("r", tuple(range(1, 41)), (), SamplingParams(max_tokens=left))
        speculator._step = _Step(shape=StepShape(1, 0, 41))
        speculator._step.plain_seconds = speculator._step.token_seconds = 0.01  # a decode-only step of one
        speculator._active = {n: d for n, d in speculator.drafters.items() if lookups or d.runs_a_model}
        speculator._worth = lambda name, rid, nodes, cost=0.0: 2.0  # a lookup expected to give 2 tokens a step
        model._per_token = per_token  # as if measured so: 39 tokens to catch up (the last is fed when drafting)
        offer = _Offer(Decode(0, DraftRequest(view, 8)), "draft-model")
        return speculator._catch_up_unpaid(offer, values, per_node, 1)

    assert not unpaid(lookups=False, left=200)
    assert unpaid(lookups=True, left=200)
    assert unpaid(lookups=False, left=20)
    assert not unpaid(lookups=True, left=200, per_token=0.0025)  # 0.0975 s: within 5% of 200 tokens' 2 s


def test_a_draft_model_whose_node_costs_a_token_is_not_run(tiny_llama: Path) -> None:
    """Once a model drafter's forward is measured, a request is not drafted for by it where a node
    costs a token or more (its depth's forward charged to the request, and its row): the target
    drafting for itself (its forwards slowed by 5 ms, so that the cost is clear of the clock's
    noise; a plain step predicted at about one), at three requests a step, is asked once or twice
    (before its cost is known), not on every step its estimates grant it nodes (granted all of them
    here, the guard aside); the output is plain decoding's."""
    prompts = random_prompts(3, seed=30, low=4, high=8)
    params = SamplingParams(max_tokens=160, temperature=0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(tiny_llama)).generate(prompts, params, use_tqdm=False)]
    asked = {}
    for gate in (True, False):
        llm = LLM(str(tiny_llama), speculative=dict(method="draft-model", num_tokens=4, draft_model=str(tiny_llama)))
        speculator = llm.engine.speculator
        speculator.guard = None  # the clock's verdict aside: which requests the model is run for is the point
        # A plain step's time as a tiny model's (about a millisecond, nearly all of it overhead), not
        # as learnt from the clock: in CI's run (one thread) the learnt rate made a token cost more
        # than the slowed draft forward, and the rule, right on its inputs, let the model run.
        speculator.controller.predict = lambda shape: 1e-3 + 1e-5 * shape.tokens
        select = speculator.controller.select  # and estimates that grant every node (the controller's own
        speculator.controller.select = lambda base, rows, candidates, behind=False, select=select: dataclasses.replace(
            select(base, rows, candidates, behind), counts=tuple(len(c.values) for c in candidates))  # pricing aside)
        if not gate:  # a node's cost as if nothing (the rule's input), its price in the grant aside
            speculator._model_node_cost = lambda *args: 0.0
        drafter = speculator.drafters["draft-model"]
        forward = drafter.forward

        def slow(*args, forward=forward, **kwargs):  # type: ignore[no-untyped-def]
            time.sleep(0.005)  # a draft forward well above a tiny target step (its own is about one)
            return forward(*args, **kwargs)

        drafter.forward = slow
        propose, calls = drafter.propose, []
        drafter.propose = lambda requests, propose=propose, calls=calls: calls.append(1) or propose(requests)
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == plain
        asked[gate] = len(calls)
    assert asked[True] <= 2 < asked[False], asked


def test_a_model_drafters_chain_ends_where_its_confidence_falls_below_min_value(tiny_llama: Path,
                                                                               draft_dir: Path) -> None:
    """Given a request's `min_value`, a draft model's chain goes on while the product of its own
    picks' probabilities (the node scores) stays at or above it, and ends at the first node where it
    falls below (or at the budget); the output is plain decoding's."""
    prompts = random_prompts(4, seed=27)
    llm = LLM(str(tiny_llama), speculative=dict(method="draft-model", num_tokens=6, controller="fixed",
                                                draft_model=str(draft_dir)))
    drafter = llm.engine.speculator.drafters["draft-model"]
    propose, trees = drafter.propose, []

    def at_min_value(requests):  # type: ignore[no-untyped-def]
        out = propose([dataclasses.replace(r, min_value=0.02) for r in requests])
        trees.extend(zip(requests, out))
        return out

    drafter.propose = at_min_value
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == \
        [o.token_ids for o in LLM(str(tiny_llama)).generate(prompts, GREEDY, use_tqdm=False)]
    lengths = set()
    for request, tree in trees:
        reach = list(itertools.accumulate(tree.scores, lambda a, b: a * b))
        assert all(r >= 0.02 for r in reach[:-1])
        assert len(tree) == request.budget or reach[-1] < 0.02
        lengths.add(len(tree))
    assert len(lengths) > 2  # chains of several lengths: the rule was exercised


def test_a_draft_model_cut_to_its_first_token_ids_proposes_only_them_and_output_is_plain(tiny_llama: Path) -> None:
    """With draft_vocab, a draft model's LM head computes the kept rows' logits as the full head
    does and -inf for the rest: it never proposes another token, and greedy output is plain
    decoding's. The target drafting for itself, every draft would be accepted; cut to 64 of its 258
    tokens, it is wrong exactly where the target's token lies beyond them."""
    prompts = random_prompts(6, seed=31)
    llm = LLM(str(tiny_llama), speculative=dict(method="draft-model", num_tokens=4, controller="fixed",
                                                draft_model=str(tiny_llama), draft_vocab=64))
    drafter = llm.engine.speculator.drafters["draft-model"]
    draft = drafter.forward.__self__.model
    hidden = torch.randn(3, draft.config.hidden_size)
    with torch.inference_mode():
        cut, full = draft.compute_logits(hidden), llm.engine.model.compute_logits(hidden)
    assert cut.shape == full.shape
    torch.testing.assert_close(cut[:, :64], full[:, :64])
    assert torch.isneginf(cut[:, 64:]).all()
    proposed = record_proposed_tokens(drafter)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in LLM(str(tiny_llama)).generate(prompts, GREEDY,
                                                                                                  use_tqdm=False)]
    totals = llm.engine.draft_totals
    assert proposed and max(proposed) < 64
    assert 0 < totals.accepted < totals.proposed
    assert any(t >= 64 for o in outs for t in o.token_ids)  # the target did say what the draft cannot
