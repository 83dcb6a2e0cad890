"""The EAGLE-style learned drafter: its trainer learns (and resumes), its drafts never change greedy
output (chunked prefill, preemption, prefix-cache hits, any grants), its sampled chains keep the
target's exact distribution, published EAGLE-1/2 checkpoints load, and bad heads fail at load naming
the option."""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.model.eagle import EagleHead, HeadConfig, load_head, save_head
from specserve.train.drafter import DrafterTrainer, TrainConfig

from conftest import shuffle_grants, write_copy_head, write_random_head
from test_spec_decoding import VOCAB, chi2_pvalue, exact_distribution, sample_counts

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def _text_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefgh ") for _ in range(rng.randint(5, 30))) for _ in range(n)]


def _train_config(target: Path, root: Path) -> TrainConfig:
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in _text_prompts(60, seed=0)))
    return TrainConfig(out=str(root / "head"), model=str(target), data=str(data), num_prompts=48,
                       max_prompt_tokens=64, max_new_tokens=24, epochs=6, lr=1e-2, token_weight=1.0,
                       batch_tokens=1024, draft_vocab=100, eval_every=5, eval_fraction=0.1, gen_batch=16)


def test_trainer_learns_and_resumes(tiny_llama: Path, tmp_path: Path) -> None:
    """The loss falls; a second run over the same directory generates and trains nothing more; the
    head reads out the most frequent answer tokens and serves."""
    config = _train_config(tiny_llama, tmp_path)
    head = DrafterTrainer(config).run()
    log = [json.loads(line) for line in (head / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < 0.9 * log[0]["loss"], "training must lower the loss"
    assert {"acc1", "acc2", "chain5", "tokens_seen"} <= set(log[-1])
    before = (head / "model.safetensors").read_bytes()
    DrafterTrainer(config).run()
    assert len((head / "train_log.jsonl").read_text().splitlines()) == len(log)
    assert (head / "model.safetensors").read_bytes() == before
    assert len((head / "data" / "answers.jsonl").read_text().splitlines()) == config.num_prompts
    loaded = load_head(head)
    assert loaded.config.draft_vocab_size == 100
    answers = [json.loads(line)["answer"] for line in (head / "data" / "answers.jsonl").read_text().splitlines()]
    counts = Counter(t for a in answers for t in a)
    top = {t for t, _ in counts.most_common(50)}
    assert top <= set(loaded.vocab_ids.tolist())
    llm = LLM(str(tiny_llama), speculative=dict(method="eagle", draft_model=str(head), num_tokens=4))
    assert llm.generate("abc", GREEDY, use_tqdm=False)[0].token_ids
    # the labels: the target's choice after every position (taken from its greedy answers within
    # them, computed from the features elsewhere) is the argmax of its LM head over the features
    from safetensors.torch import load_file

    from specserve.model.eagle import lm_head_weight

    stored = load_file(str(head / "data" / "features-00000.safetensors"))
    choices = torch.load(str(head / "data" / "choices.pt"), weights_only=True)
    lm = lm_head_weight(llm.engine.model).float()
    argmax = (stored["hidden"].float() @ lm.T).argmax(-1)
    assert choices.shape == argmax.shape and (choices == argmax).float().mean() > 0.99


def test_data_only_stores_the_data_and_a_later_run_trains_on_it(tiny_llama: Path, tmp_path: Path) -> None:
    """`data_only` stops after the answers and their states (no head, no training log); the same
    command without it then trains on exactly that data, generating nothing again."""
    config = dataclasses.replace(_train_config(tiny_llama, tmp_path), num_prompts=12, epochs=1, data_only=True)
    data = DrafterTrainer(config).run()
    head = Path(config.out)
    assert data == head / "data"
    shards = sorted(data.glob("features-*.safetensors"))
    stored = {p: p.read_bytes() for p in [data / "answers.jsonl", *shards]}
    assert shards and len((data / "answers.jsonl").read_text().splitlines()) == 12
    assert not (head / "model.safetensors").exists() and not (head / "train_log.jsonl").exists()
    assert DrafterTrainer(dataclasses.replace(config, data_only=False)).run() == head
    assert (head / "model.safetensors").exists() and (head / "train_log.jsonl").exists()
    assert {p: p.read_bytes() for p in stored} == stored, "the trained run must not generate the data again"


def test_a_fusing_head_trains_on_states_added_to_an_earlier_feature_store(tiny_llama: Path, tmp_path: Path) -> None:
    """--feature-layers (EAGLE-3's fused features): a run over the feature store of a run without
    them adds the states after those layers to its shards, the same a fresh run stores, beside the
    unchanged last-layer states; the head fuses them, learns and serves. A value that names no
    layers of the target is an error naming the field."""
    import dataclasses
    import shutil

    from safetensors.torch import load_file

    roots = [tmp_path / name for name in ("plain", "fresh")]
    for root in roots:
        root.mkdir()
    plain = DrafterTrainer(_train_config(tiny_llama, roots[0]))
    plain.answers()
    plain.features()
    fresh = DrafterTrainer(dataclasses.replace(_train_config(tiny_llama, roots[1]), feature_layers="1"))
    fresh.answers()
    fresh.features()
    upgraded = dataclasses.replace(_train_config(tiny_llama, roots[0]), out=str(tmp_path / "upgraded"), feature_layers="1",
                                   epochs=4)
    shutil.copytree(roots[0] / "head" / "data", tmp_path / "upgraded" / "data")
    head = DrafterTrainer(upgraded).run()
    shard = "features-00000.safetensors"
    a, b = load_file(str(head / "data" / shard)), load_file(str(roots[1] / "head" / "data" / shard))
    assert torch.equal(a["hidden"], load_file(str(roots[0] / "head" / "data" / shard))["hidden"])
    assert a["aux"].shape == a["hidden"].shape and a["aux_layers"].tolist() == [1]
    assert torch.allclose(a["aux"].float(), b["aux"].float(), atol=1e-3)
    assert torch.allclose(a["hidden"].float(), b["hidden"].float(), atol=1e-3)
    # the states the generation recorded (batched, chunked, verifying drafts) are those of a forward
    # over the sample alone, and every recorded sample ends a token before its answer does
    answers = [json.loads(line) for line in (roots[1] / "head" / "data" / "answers.jsonl").read_text().splitlines()]
    lengths = b["lengths"].tolist()
    assert lengths == [len(r["prompt"]) + len(r["answer"]) - 1 for r in answers[: len(lengths)]]
    assert fresh.llm.engine.draft_totals.accepted > 0, "some states come from verified drafts"
    for i in range(len(lengths)):
        first = sum(lengths[:i])
        seq = b["tokens"][first : first + lengths[i]].tolist()
        alone = fresh._states(seq, (1,)).to(torch.float16)
        assert torch.equal(torch.cat((b["aux"], b["hidden"]), 1)[first : first + lengths[i]], alone), i
    log = [json.loads(line) for line in (head / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < 0.9 * log[0]["loss"], "training must lower the loss"
    assert load_head(head).config.feature_layers == (1,)
    llm = LLM(str(tiny_llama), speculative=dict(method="eagle", draft_model=str(head), num_tokens=4, controller="fixed"))
    assert llm.generate("abc", GREEDY, use_tqdm=False)[0].token_ids and llm.engine.draft_totals.proposed > 0
    with pytest.raises(ValueError, match="^feature_layers: .*checkpoint.pt trains another head"):
        DrafterTrainer(dataclasses.replace(upgraded, feature_layers="")).train()  # resumed without fusion
    with pytest.raises(ValueError, match="^feature_layers"):
        dataclasses.replace(upgraded, feature_layers="low")
    with pytest.raises(ValueError, match="^feature_layers: '2' gives layers"):
        DrafterTrainer(dataclasses.replace(upgraded, feature_layers="2")).train()


def test_answers_resumed_off_a_shard_boundary_give_every_sample_its_states(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A data stage stopped off a shard's boundary (or asked for more prompts later) resumes: the
    rows up to the boundary are generated unrecorded and the features stage computes the shard
    they complete; every sample of every shard then holds the states of a forward over it alone."""
    import dataclasses

    from safetensors.torch import load_file

    monkeypatch.setattr(DrafterTrainer, "SHARD", 16)
    config = dataclasses.replace(_train_config(tiny_llama, tmp_path), num_prompts=20)
    DrafterTrainer(config).answers()
    data = tmp_path / "head" / "data"
    assert load_file(str(data / "features-00001.safetensors"))["lengths"].shape[0] == 4  # rows 16 .. 19
    trainer = DrafterTrainer(dataclasses.replace(config, num_prompts=48))
    trainer.answers()
    trainer.features()
    answers = [json.loads(line) for line in (data / "answers.jsonl").read_text().splitlines()]
    assert len(answers) == 48
    for shard in range(3):
        saved = load_file(str(data / f"features-{shard:05d}.safetensors"))
        lengths = saved["lengths"].tolist()
        assert len(lengths) == 16
        for row, seq, states in zip(answers[16 * shard :], saved["tokens"].split(lengths), saved["hidden"].split(lengths)):
            whole = row["prompt"] + row["answer"]
            assert seq.tolist() in (whole, whole[:-1]), "each shard holds its own rows' samples"
            assert torch.equal(states, trainer._states(seq.tolist(), ()).to(torch.float16))


def test_bfloat16_training_learns_and_keeps_float32_weights(tiny_llama: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """--precision bfloat16 runs the head's matmuls in bfloat16 under autocast (half the step on
    CPUs with BF16 dot products): the loss still falls, the weights stay float32; any other value
    is an error naming the field."""
    import dataclasses

    from specserve.model.eagle import EagleHead

    seen: set[object] = set()
    forward = EagleHead.forward

    def recording(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.training:  # what the training steps ran under (evaluation runs in float32)
            seen.add(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else torch.float32)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(EagleHead, "forward", recording)
    config = dataclasses.replace(_train_config(tiny_llama, tmp_path), precision="bfloat16")
    head = DrafterTrainer(config).run()
    assert seen == {torch.bfloat16}
    log = [json.loads(line) for line in (head / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < 0.9 * log[0]["loss"], "training must lower the loss"
    assert all(p.dtype == torch.float32 for p in load_head(head).parameters())
    with pytest.raises(ValueError, match="precision"):
        dataclasses.replace(config, precision="float16")


def test_soft_token_targets_are_the_targets_distribution_at_the_row() -> None:
    """--soft-tokens: the token loss is the cross-entropy against the target's distribution from its
    next state at the same row, so it is least (the distribution's entropy) when the head's output is
    that state, higher for the row before's state, and higher for a sharpened copy, which the loss on
    the choice alone prefers; accuracy is judged on the choice either way."""
    from specserve.train.drafter import _terms, target_distribution

    torch.manual_seed(0)
    lm_rows, nxt = torch.randn(50, 16), torch.randn(2, 7, 16)
    probs = target_distribution(nxt, lm_rows)
    assert torch.allclose(probs, (nxt @ lm_rows.T).softmax(-1)) and probs.shape == (2, 7, 50)
    labels = probs.argmax(-1)
    labels[0, :2] = -100
    fmask = torch.ones(2, 7, dtype=torch.bool)

    def losses(out: torch.Tensor) -> tuple[float, float]:
        soft = _terms(out, lm_rows, nxt, labels, fmask, probs)
        hard = _terms(out, lm_rows, nxt, labels, fmask)
        assert soft[2] == hard[2] and soft[3] == hard[3] == 12  # the same accuracy on the same rows
        return soft[1].item(), hard[1].item()

    kept = probs[labels >= 0]
    entropy = -(kept * kept.log()).sum(-1).mean().item()
    at_target, sharper, shifted = losses(nxt), losses(3 * nxt), losses(nxt.roll(1, dims=1))
    assert at_target[0] == pytest.approx(entropy, rel=1e-5)
    assert sharper[0] > at_target[0] + 0.1 and shifted[0] > at_target[0] + 0.1
    assert sharper[1] < at_target[1], "the choice alone rewards a sharper copy; the distribution does not"


def test_soft_token_training_learns_from_the_distribution_and_is_judged_on_the_choice(
        tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With --soft-tokens every training step's token loss takes the target's distribution (one
    computation a step, shared by its passes), the held-out evaluation none (it is judged on the
    choice), and the loss falls; the head records how it was trained."""
    from specserve.train import drafter

    calls: list[bool] = []
    distribution = drafter.target_distribution

    def counting(next_feats: torch.Tensor, lm_rows: torch.Tensor) -> torch.Tensor:
        calls.append(torch.is_grad_enabled())
        return distribution(next_feats, lm_rows)

    monkeypatch.setattr(drafter, "target_distribution", counting)
    config = dataclasses.replace(_train_config(tiny_llama, tmp_path), soft_tokens=True)
    head = DrafterTrainer(config).run()
    log = [json.loads(line) for line in (head / "train_log.jsonl").read_text().splitlines()]
    assert len(calls) == log[-1]["step"] and all(calls), "one distribution a training step, none in evaluation"
    assert log[-1]["loss"] < log[0]["loss"] - 0.2, "training must lower the loss"
    assert json.loads((head / "config.json").read_text())["trained"]["soft_tokens"] is True


@pytest.fixture(scope="module")
def one_layer(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    target = tiny_model_factory("one-layer", num_hidden_layers=1, seed=5)
    return target, write_copy_head(target, tmp_path_factory.mktemp("copy-head"))


@pytest.fixture(scope="module")
def chat_prompts(one_layer: tuple[Path, Path]) -> list[list[int]]:
    from specserve.tokenizer import apply_chat_template, load_tokenizer

    tok = load_tokenizer(one_layer[0])
    return [apply_chat_template(tok, [{"role": "user", "content": p}]) for p in _text_prompts(8, seed=5)]


@pytest.fixture(scope="module")
def plain(one_layer: tuple[Path, Path], chat_prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in LLM(str(one_layer[0])).generate(chat_prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("opts", [dict(max_num_batched_tokens=24), dict(num_kv_blocks=24, block_size=4), {}],
                         ids=["chunked-prefill", "preemption", "prefix-cache"])
def test_eagle_greedy_is_plain_decoding(
    one_layer: tuple[Path, Path], chat_prompts: list[list[int]], plain: list[list[int]], opts: dict
) -> None:
    """With a head that computes what the target does, most drafts are accepted (features, tokens
    and positions line up), and the output is plain decoding's under any grants."""
    target, head = one_layer
    spec = dict(method="eagle", draft_model=str(head), num_tokens=6, controller="fixed")
    llm = LLM(str(target), speculative=spec, **opts)
    outs = llm.generate(chat_prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == plain
    totals = llm.engine.draft_totals
    first, second = totals.accepted_per_position[:2]
    assert first > 0.8 * totals.steps and second > 0.6 * first, "a head computing the target's outputs is accepted"
    shuffle_grants(llm, seed=3)
    for _ in range(2):  # the second round hits the prefix cache: the head sees no prompt features then
        outs = llm.generate(chat_prompts, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == plain
    if "num_kv_blocks" in opts:
        assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_a_head_fusing_several_layers_drafts_from_what_the_target_computed(
    one_layer: tuple[Path, Path], chat_prompts: list[list[int]], plain: list[list[int]], tmp_path: Path
) -> None:
    """An EAGLE-3-style head (the target's states after layer 1 and the last, fused) gets both
    from every step and drafts from them: the copy head, fusing, is accepted as often as without,
    and the output is plain decoding's."""
    target, _ = one_layer
    head = write_copy_head(target, tmp_path / "fused", fused=True)
    llm = LLM(str(target), speculative=dict(method="eagle", draft_model=str(head), num_tokens=6, controller="fixed"))
    assert llm.engine.speculator.feature_layers == (1,)
    assert [o.token_ids for o in llm.generate(chat_prompts, GREEDY, use_tqdm=False)] == plain
    totals = llm.engine.draft_totals
    first, second = totals.accepted_per_position[:2]
    assert first > 0.8 * totals.steps and second > 0.6 * first, "a fused head computing the target's outputs"
    with pytest.raises(ValueError, match="^feature_layers: the drafter reads layers"):
        llm.engine.core.record_states(lambda *args: None, ())  # a recording must ask for what the drafter reads


def test_untrained_head_with_a_vocabulary_subset_is_still_lossless(
    one_layer: tuple[Path, Path], chat_prompts: list[list[int]], plain: list[list[int]], tmp_path: Path
) -> None:
    head = write_random_head(one_layer[0], tmp_path / "head", draft_vocab=100)
    llm = LLM(str(one_layer[0]), speculative=dict(method="eagle", draft_model=str(head), num_tokens=5,
                                                 controller="fixed"))
    assert [o.token_ids for o in llm.generate(chat_prompts, GREEDY, use_tqdm=False)] == plain
    assert llm.engine.draft_totals.proposed > 0


@pytest.fixture(scope="module")
def small_vocab_head(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    opts = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, initializer_range=0.15)
    target = tiny_model_factory("v4-target", **opts, seed=3)
    return target, write_random_head(target, tmp_path_factory.mktemp("v4-head"), seed=1)


def test_eagle_sampling_matches_exact_distribution(small_vocab_head: tuple[Path, Path]) -> None:
    """Chains drawn from the head's processed distribution (temperature and top-p here), verified
    with that q: the first three tokens follow the target's exact distribution."""
    target, head = small_vocab_head
    params = SamplingParams(max_tokens=6, temperature=0.7, top_p=0.8, ignore_eos=True)
    n = 3000
    spec = dict(method="eagle", draft_model=str(head), num_tokens=3, controller="fixed")
    counts, llm = sample_counts(target, spec, params, n)
    totals = llm.engine.draft_totals
    assert totals.proposed > 0 and 0 < totals.accepted < totals.proposed, "needs both accepts and rejections"
    assert chi2_pvalue(counts, exact_distribution(target, params), n) > 0.001


def _head(hidden: int = 64, vocab: int = 258, feature_layers: tuple[int, ...] = ()) -> EagleHead:
    torch.manual_seed(0)
    return EagleHead(HeadConfig(hidden_size=hidden, num_heads=4, num_kv_heads=2, head_dim=hidden // 4,
                                intermediate_size=128, vocab_size=vocab, draft_vocab_size=vocab,
                                feature_layers=feature_layers)).eval()


def _out(head: EagleHead) -> torch.Tensor:
    from specserve.model.eagle import causal_attend

    g = torch.Generator().manual_seed(1)
    f, e = torch.randn(1, 5, 64, generator=g), torch.randn(1, 5, 64, generator=g)
    with torch.no_grad():
        return head(f, e, torch.arange(5).unsqueeze(0), causal_attend)


def test_a_published_eagle1_checkpoint_loads_and_computes_the_same(tmp_path: Path) -> None:
    """EAGLE-1/2 release layout: a Llama config.json, pytorch_model.bin with fc.* and layers.0.* (no
    input norm), an embed_tokens copy the loader ignores."""
    head = _head()
    state = {k: v for k, v in head.state_dict().items() if k != "vocab_ids"}
    state["embed_tokens.weight"] = torch.zeros(258, 64)
    torch.save(state, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 258, "rms_norm_eps": 1e-5,
        "num_hidden_layers": 1, "bias": True,
    }))
    loaded = load_head(tmp_path)
    assert loaded.config.draft_vocab_size == 258 and not loaded.config.input_norm
    assert torch.allclose(_out(loaded), _out(head))


def test_saved_head_round_trips_in_fp16(tmp_path: Path) -> None:
    head = _head()
    save_head(head, tmp_path)
    assert torch.allclose(_out(load_head(tmp_path)), _out(head), atol=2e-2)


def test_bad_heads_fail_at_load_naming_the_option(tiny_llama: Path, tiny_model_factory, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="^draft_model:.*needs a draft head"):
        LLM(str(tiny_llama), speculative="eagle")
    narrow = tiny_model_factory("h32", hidden_size=32, intermediate_size=64)
    wrong = write_random_head(narrow, tmp_path / "narrow")
    with pytest.raises(ValueError, match="^draft_model:.*hidden size is 32 but the target's is 64"):
        LLM(str(tiny_llama), speculative=dict(method="eagle", draft_model=str(wrong)))
    eagle3 = tmp_path / "eagle3"
    eagle3.mkdir()
    (eagle3 / "config.json").write_text("{}")
    torch.save({"midlayer.self_attn.q_proj.weight": torch.zeros(1)}, eagle3 / "pytorch_model.bin")
    with pytest.raises(ValueError, match="^draft_model:.*EAGLE-3"):
        LLM(str(tiny_llama), speculative=dict(method="eagle", draft_model=str(eagle3)))
    with pytest.raises(ValueError, match="^draft_model:.*not a draft head directory"):
        LLM(str(tiny_llama), speculative=dict(method="eagle", draft_model=str(tmp_path / "nowhere")))


def test_a_greedy_tree_keeps_the_budget_most_probable_paths() -> None:
    """EAGLE-2's selection: of the nodes drafted, the `budget` with the highest cumulative draft
    probability, parents before children, each scored with its probability given its parent."""
    import math

    from specserve.sampling_params import SamplingParams as SP
    from specserve.speculation.drafter import DraftRequest, RequestView
    from specserve.speculation.drafters.eagle import EagleDrafter, _Node, _Work

    probs = {  # node: (parent, q given parent)
        0: (-1, 0.6), 1: (-1, 0.3), 2: (-1, 0.1), 3: (0, 0.9), 4: (0, 0.1), 5: (1, 0.5), 6: (3, 0.8),
    }
    nodes: list[_Node] = []
    for i, (parent, q) in probs.items():
        base = 0.0 if parent < 0 else nodes[parent].cum
        depth = 1 if parent < 0 else nodes[parent].depth + 1
        nodes.append(_Node(100 + i, parent, depth, base + math.log(q), q))
    view = RequestView("r", (1, 2), (), SP(temperature=0))
    work = _Work(DraftRequest(view, budget=4), side=None, root_out=None, greedy=True, nodes=nodes)  # type: ignore[arg-type]
    tree = EagleDrafter._tree(None, work)  # type: ignore[arg-type]
    # cumulative: 0: .6, 3: .54, 6: .432, 1: .3, 5: .15, ... -> the top four
    assert tree.tokens == (100, 101, 103, 106)
    assert tree.parents == (-1, -1, 0, 2)
    assert tree.scores == (0.6, 0.3, 0.9, 0.8)


def test_a_fusing_head_starts_as_the_head_without_fusion() -> None:
    """A new fusing head passes the last layer's state through and is otherwise initialised as a
    head without fusion from the same seed: training starts where the last-layer head does and
    learns what the other layers add."""
    plain, fused = _head(), _head(feature_layers=(1, 3))
    ref = plain.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in fused.state_dict().items() if k in ref)
    states = torch.randn(5, 3 * 64)
    assert torch.equal(fused.target_features(states), states[:, -64:])


@pytest.mark.parametrize("feature_layers", [(), (1, 3)], ids=["last-layer", "fused"])
def test_training_passes_compute_what_drafting_computes(feature_layers: tuple[int, ...]) -> None:
    """Training-time test (EAGLE-3): pass k of training, at the row of a depth-(k - 1) draft node,
    computes the head output drafting computes for that node, reading the head's own predicted
    features and attending to the target-fed rows and the node's own chain only. With the earlier
    passes' rows attended causally instead (a head trained on contexts it never drafts in), the
    depth-2 and deeper nodes differ. A head fusing several layers' states does the same with the
    target's states fused (in training as the batch is read, in serving as they arrive)."""
    from specserve.sampling_params import SamplingParams as SP
    from specserve.speculation.drafter import DraftRequest, RequestView
    from specserve.speculation.drafters.eagle import EagleDrafter
    from specserve.train.drafter import head_passes

    head = _head(feature_layers=feature_layers)
    width = 64 * (len(feature_layers) + 1)
    g = torch.Generator().manual_seed(3)
    emb = torch.randn(258, 64, generator=g)
    readout = torch.nn.Linear(64, 258, bias=False)
    torch.nn.init.normal_(readout.weight, generator=g)
    drafter = EagleDrafter(head, lambda ids: emb[ids], 258, readout, torch.Generator(), top_k=1, max_depth=4)
    m = 9
    prompt = tuple(torch.randint(0, 258, (m + 1,), generator=g).tolist())
    feats = torch.randn(m, width, generator=g)
    drafter.features([("r", 0, feats)])
    with torch.no_grad():
        work = drafter._catch_up([DraftRequest(RequestView("r", prompt, (), SP(temperature=0)), budget=4)])["r"]
        assert work is not None
        drafter._grow([work])
    chain = [n for n in work.nodes]
    assert [n.depth for n in chain] == [1, 2, 3, 4]
    seq = list(prompt) + [n.token for n in chain]
    length = len(seq) - 1
    f = torch.zeros(1, length, width)
    f[0, :m] = feats
    e = emb[torch.tensor(seq[1:])].unsqueeze(0)
    with torch.no_grad():
        outs = head_passes(head, f, e, torch.arange(length).unsqueeze(0), passes=4)
    assert torch.allclose(outs[0][0, m - 1], work.root_out, atol=1e-5)  # the root: the target-fed rows
    for depth, node in enumerate(chain[:3], start=1):  # node at depth d: pass d + 1, row m - 1 + d
        assert torch.allclose(outs[depth][0, m - 1 + depth], node.out, atol=1e-5), depth


def test_a_step_of_several_requests_gives_each_its_own_states() -> None:
    """`features` takes a step's committed states for all its requests at once (a fusing head fuses
    them in one product): each request drafts exactly what it drafts when fed alone, its states
    arriving in uneven chunks over several steps."""
    from specserve.sampling_params import SamplingParams as SP
    from specserve.speculation.drafter import DraftRequest, RequestView
    from specserve.speculation.drafters.eagle import EagleDrafter

    head = _head(feature_layers=(1,))
    g = torch.Generator().manual_seed(5)
    emb = torch.randn(258, 64, generator=g)
    readout = torch.nn.Linear(64, 258, bias=False)
    torch.nn.init.normal_(readout.weight, generator=g)

    def drafter() -> EagleDrafter:
        return EagleDrafter(head, lambda ids: emb[ids], 258, readout, torch.Generator(), top_k=2, max_depth=3)

    lengths = {"a": 7, "b": 4, "c": 11}
    prompts = {r: tuple(torch.randint(0, 258, (n + 1,), generator=g).tolist()) for r, n in lengths.items()}
    states = {r: torch.randn(n, 128, generator=g) for r, n in lengths.items()}
    chunks = {"a": [(0, 5), (5, 6), (6, 7)], "b": [(0, 4)], "c": [(0, 9), (9, 10), (10, 11)]}

    def trees(d: EagleDrafter, rids: list[str]) -> dict[str, list[tuple[int, int]]]:
        reqs = [DraftRequest(RequestView(r, prompts[r], (), SP(temperature=0)), budget=6) for r in rids]
        return {r: list(zip(tree.tokens, tree.parents)) for r, tree in zip(rids, d.propose(reqs))}

    together = drafter()
    for step in range(3):
        together.features([(r, c[step][0], states[r][c[step][0] : c[step][1]]) for r, c in chunks.items() if step < len(c)])
    alone = {}
    for r in lengths:
        d = drafter()
        for s, e in chunks[r]:
            d.features([(r, s, states[r][s:e])])
        alone.update(trees(d, [r]))
    got = trees(together, list(lengths))
    assert all(alone[r] for r in lengths), "each request must draft"
    assert got == alone
