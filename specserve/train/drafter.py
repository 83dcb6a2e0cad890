"""`specserve train-drafter`: an EAGLE-style head for a target, trained on the target's own answers.

Three stages, each kept in the output directory so that a stopped run resumes where it stopped:

1. answers (`data/answers.jsonl`): the target's greedy answers to the prompts (self-distillation:
   the head learns what this model says, not what ChatGPT said), generated in batches;
2. features (`data/features-*.safetensors`): the final-normed hidden state of every token (fp16),
   and with `--feature-layers` those after the low and middle layers (EAGLE-3), taken from the
   forward that generates the answers (`EngineCore.record_states`; the last answer token, never fed
   back, is left out); a forward over prompt + answer makes what the answers stage did not;
3. training (`checkpoint.pt`, `train_log.jsonl`): row j of the head reads (f_j, t_{j+1}) and is
   trained to predict f_{j+1} (smooth L1) and the target's choice after t_{j+1}, the argmax of its
   LM head over f_{j+1} (cross-entropy over the head's vocabulary), at every position: on answer
   tokens that is the token the target went on to generate, on prompt tokens what it would have
   said (`--answer-only` keeps only the former). A second pass feeds the head its own predicted
   features (as drafting deeper than one token does). Held-out accuracy is judged on answer tokens.

The head (`model.safetensors`, `config.json`) is written at the end; `--spec eagle --draft-model OUT`
serves it. The vocabulary it reads out is the `draft_vocab` most frequent tokens of the answers
(FR-Spec).
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from specserve.model.eagle import EagleHead, HeadConfig, causal_attend, lm_head_weight, save_head
from specserve.model.forward import ForwardItem
from specserve.model.loader import DEFAULT_MODEL

logger = logging.getLogger("specserve.train")
FUSE_LR_SCALE = 0.1  # the fusing projection's learning rate against the rest of the head's


@dataclass(frozen=True)
class TrainConfig:
    """What `train-drafter` does. Every field is a command-line option of the same name."""

    out: str
    model: str = DEFAULT_MODEL
    # sharegpt, spec-bench, humaneval, code-edits (prompts made from the standard library's functions:
    # `code_corpus`), or a file: ShareGPT json, or jsonl with "prompt"/"turns"; a mixture as
    # "SOURCE:COUNT,SOURCE:COUNT" (each part's prompts in turn, the first COUNT that fit)
    data: str = "sharegpt"
    num_prompts: int = 512
    max_prompt_tokens: int = 512
    max_new_tokens: int = 192
    draft_vocab: int = 8192  # 0: the whole vocabulary
    epochs: int = 4
    lr: float = 1e-3
    batch_tokens: int = 2048
    token_weight: float = 1.0  # features 1.0 and tokens 1.0 (EAGLE-1's 0.1 for tokens learned slower here)
    feature_noise: float = 0.1  # uniform noise on input features, as EAGLE trains
    own_feature_weight: float = 0.5  # each pass on the head's own features (0: none)
    own_feature_passes: int = 1  # passes on the head's own features: pass k trains drafting depth k + 1
    answer_only: bool = False  # token loss on answer tokens only (else everywhere, on the target's choice)
    # the token loss against the target's whole distribution over the draft vocabulary (softmax of
    # its LM head over the stored next state: EAGLE-1's classification loss) instead of its choice
    # alone; the same rows either way, and held-out accuracy is judged on the choice
    soft_tokens: bool = False
    # EAGLE-3's fused features: the target's states after these layers join the last one's, as
    # "2,14" (layer counts from the input), "auto" (2 and half the layers) or "" (the last only)
    feature_layers: str = ""
    eval_fraction: float = 0.05
    eval_every: int = 50  # steps
    gen_batch: int = 32
    spec: str = "auto"  # speculation while generating the answers (lossless: the same greedy answers)
    device: str = "cpu"
    quantization: str = "auto"
    precision: str = "float32"  # of the head's training matmuls: float32, or bfloat16 (autocast; weights stay float32)
    seed: int = 0
    # stop once the answers and their states are stored (OUT/data, resumable; timings.json says what
    # they cost): to make the data on one machine and train on another, or to measure the data alone
    data_only: bool = False

    def __post_init__(self) -> None:
        for name in ("num_prompts", "max_prompt_tokens", "max_new_tokens", "epochs", "batch_tokens", "eval_every",
                     "gen_batch", "own_feature_passes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.draft_vocab < 0:
            raise ValueError(f"draft_vocab: must be >= 0 (0: the whole vocabulary), got {self.draft_vocab}")
        if not 0.0 <= self.eval_fraction < 0.5:
            raise ValueError(f"eval_fraction: must be in [0, 0.5), got {self.eval_fraction}")
        if self.lr <= 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        if self.precision not in ("float32", "bfloat16"):
            raise ValueError(f"precision: must be float32 or bfloat16, got {self.precision!r}")
        data_parts(self.data, self.num_prompts)  # raises on a malformed mixture
        if self.feature_layers not in ("", "auto") and not re.fullmatch(r"\d+(,\d+)*", self.feature_layers):
            raise ValueError(f"feature_layers: a comma-separated list of layer counts, 'auto' or '', "
                             f"got {self.feature_layers!r}")


def feature_layers(spec: str, num_layers: int) -> tuple[int, ...]:
    """The layer counts `spec` names for a target of `num_layers` layers (`TrainConfig.feature_layers`):
    "auto" is EAGLE-3's low and middle layers, 2 and num_layers // 2."""
    if spec == "":
        return ()
    layers = sorted({min(2, num_layers - 1), num_layers // 2} - {0}) if spec == "auto" else \
        sorted(int(x) for x in spec.split(","))
    if any(not 1 <= f < num_layers for f in layers) or len(set(layers)) != len(layers):
        raise ValueError(f"feature_layers: {spec!r} gives layers {layers}; the target has {num_layers} "
                         f"(each in 1 .. {num_layers - 1}, distinct)")
    return tuple(layers)


def data_parts(data: str, num_prompts: int) -> list[tuple[str, int]]:
    """`data` as (source, count) parts: one bare source takes `num_prompts`; in a mixture every part
    names its count (`sharegpt:640,code-edits:400`)."""
    items = [p.strip() for p in data.split(",")]
    if len(items) == 1 and not re.fullmatch(r".+:\d+", items[0]):
        return [(items[0], num_prompts)]
    parts = []
    for item in items:
        m = re.fullmatch(r"(.+):(\d+)", item)
        if m is None or int(m.group(2)) < 1:
            raise ValueError(f"data: each part of a mixture is SOURCE:COUNT with COUNT >= 1, got {item!r} in {data!r}")
        parts.append((m.group(1), int(m.group(2))))
    return parts


# ------------------------------------------------------------------------------------------------ prompts


def load_prompts(data: str, n: int, seed: int) -> list[str]:
    """Up to `n` first-turn prompts, shuffled with `seed`."""
    from specserve.bench.datasets import ShareGPT, open_dataset

    path = Path(data)
    if data == "code-edits":
        from specserve.train.code_corpus import CodeEditCorpus

        return CodeEditCorpus().prompts(max(n * 2, n + 64), seed)
    if data == "sharegpt" or (path.is_file() and path.suffix == ".json"):
        pairs, _ = ShareGPT(path if path.is_file() else None).pairs()
        prompts = [p.prompt for p in pairs if p.prompt.strip()]
    elif path.is_file():
        prompts = []
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                text = row.get("prompt") or (row.get("turns") or [""])[0]
                if text:
                    prompts.append(str(text))
    else:
        from specserve.bench.datasets import SampleSpec

        prompts = [s.prompt for s in open_dataset(data).sample(SampleSpec(), None).samples]
    random.Random(seed).shuffle(prompts)
    return prompts[: max(n * 2, n + 64)]  # spares, for those over max_prompt_tokens


# ------------------------------------------------------------------------------------------------ stages


class DrafterTrainer:
    def __init__(self, config: TrainConfig) -> None:
        self.c = config
        self.out = Path(config.out)
        self.data = self.out / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self._llm: Any = None

    @property
    def llm(self) -> Any:
        if self._llm is None:
            from specserve.entrypoints.llm import LLM

            self._llm = LLM(self.c.model, device=self.c.device, quantization=self.c.quantization,
                            max_num_seqs=self.c.gen_batch, enable_prefix_caching=False, seed=self.c.seed,
                            speculative=self.c.spec,
                            max_model_len=self.c.max_prompt_tokens + self.c.max_new_tokens + 1)
        return self._llm

    def run(self) -> Path:
        """The head's directory; with `data_only`, the data's (nothing trained)."""
        self.answers()
        self.features()
        return self.data if self.c.data_only else self.train()

    # -- 1. answers --------------------------------------------------------------------------------
    def answers(self) -> Path:
        from specserve.sampling_params import SamplingParams
        from specserve.tokenizer import apply_chat_template

        path = self.data / "answers.jsonl"
        done = path.read_text().splitlines() if path.exists() else []
        if len(done) >= self.c.num_prompts:
            return path
        tok = self.llm.tokenizer
        prompts: list[list[int]] = []
        for source, count in data_parts(self.c.data, self.c.num_prompts):
            taken = 0
            for text in load_prompts(source, count, self.c.seed):
                ids = apply_chat_template(tok, [{"role": "user", "content": text}]) if tok is not None else []
                if 0 < len(ids) <= self.c.max_prompt_tokens and taken < count:
                    prompts.append(ids)
                    taken += 1
        for i, line in enumerate(done):
            if i >= len(prompts) or json.loads(line)["prompt"] != prompts[i]:
                raise ValueError(f"data: {path} answers other prompts than data={self.c.data!r}, "
                                 f"max_prompt_tokens={self.c.max_prompt_tokens}, seed={self.c.seed} give "
                                 f"(row {i}); use another out directory")
        prompts = prompts[len(done) : self.c.num_prompts]
        params = SamplingParams(max_tokens=self.c.max_new_tokens, temperature=0.0)
        # whole shards a chunk: the states the generation computes make each chunk's feature shards
        # (a run resumed off a shard's boundary first generates up to the next one unrecorded: the
        # features stage makes that shard)
        chunk = self.SHARD * max(1, round(4 * self.c.gen_batch / self.SHARD))
        first = -len(done) % self.SHARD
        bounds = ([(0, first, False)] if first else []) + \
            [(i, i + chunk, True) for i in range(first, len(prompts), chunk)]
        layers = self._feature_layers()
        core = self.llm.engine.core
        start = time.perf_counter()
        with path.open("a") as f:
            for i, end, record in bounds:
                part = prompts[i:end]
                if not part:
                    continue
                logger.info("answers %d-%d of %d", len(done) + i, len(done) + i + len(part), self.c.num_prompts)
                recorder = _StateRecorder()
                if record:
                    core.record_states(recorder, layers)
                try:
                    outs = self.llm.generate(part, params)
                finally:
                    core.record_states(None)
                if record:  # the last answer token's state is never computed: its sample ends a token early
                    seqs = [ids + o.token_ids[:-1] for ids, o in zip(part, outs)]
                    states = [recorder.take(o.request_id, len(seq)) for o, seq in zip(outs, seqs)]
                    for j in range(0, len(part), self.SHARD):
                        self._save_shard(self._shard_path(len(done) + i + j), [len(ids) for ids in part[j : j + self.SHARD]],
                                         seqs[j : j + self.SHARD], states[j : j + self.SHARD], layers)
                for ids, o in zip(part, outs):
                    f.write(json.dumps({"prompt": ids, "answer": o.token_ids}) + "\n")
                f.flush()
        self._note("answers_seconds", time.perf_counter() - start)
        return path

    # -- 2. features -------------------------------------------------------------------------------
    SHARD = 64

    def features(self) -> list[Path]:
        """Shards of the target's states over prompt + answer: "hidden" (the last layer's, final-normed)
        and, with `feature_layers`, "aux" (the normed states after those layers, side by side) with
        "aux_layers". The answers stage writes them from its own forward (without the last answer
        token); what it did not (answers from an earlier run, a shard cut short) a forward over
        prompt + answer computes here, and a shard without the aux states a run now asks for gets
        them added (a forward through the layers up to the highest alone)."""
        from safetensors.torch import load_file, save_file
        from tqdm import tqdm

        layers = self._feature_layers()
        rows = [json.loads(line) for line in (self.data / "answers.jsonl").read_text().splitlines()]
        shards = [self._shard_path(i) for i in range(0, len(rows), self.SHARD)]
        held = [self._shard_holds(s) if s.exists() else (0, ()) for s in shards]
        whole = [n == len(rows[i * self.SHARD : (i + 1) * self.SHARD]) for i, (n, _) in enumerate(held)]
        todo = [(i, s) for i, s in enumerate(shards) if not whole[i] or (layers and held[i][1] != layers)]
        start = time.perf_counter()
        for i, shard in tqdm(todo, desc="features", unit="shard"):
            part = rows[i * self.SHARD : (i + 1) * self.SHARD]
            if whole[i]:  # add the aux states to a shard that has the rest
                saved = load_file(str(shard))
                seqs = saved["tokens"].split(saved["lengths"].tolist())
                aux = [self._states(seq.tolist(), layers, num_layers=max(layers))[:, : -self._width] for seq in seqs]
                save_file({**saved, "aux": torch.cat(aux).to(torch.float16),
                           "aux_layers": torch.tensor(layers, dtype=torch.int32)}, str(shard))
                continue
            seqs = [r["prompt"] + r["answer"] for r in part]
            self._save_shard(shard, [len(r["prompt"]) for r in part], seqs, [self._states(ids, layers) for ids in seqs],
                             layers)
        if todo:
            self._note("features_seconds", time.perf_counter() - start)
        return shards

    def _shard_path(self, row: int) -> Path:
        return self.data / f"features-{row // self.SHARD:05d}.safetensors"

    def _save_shard(self, path: Path, prompt_lengths: list[int], seqs: list[list[int]], states: list[torch.Tensor],
                    layers: tuple[int, ...]) -> None:
        """One shard: per sample its tokens and the target's states at them ([n, (len(layers) + 1) * H])."""
        from safetensors.torch import save_file

        every = torch.cat([s.to(torch.float16).cpu() for s in states])
        width = self._width
        tensors = {
            "hidden": every[:, -width:].contiguous(),
            "tokens": torch.tensor([t for seq in seqs for t in seq], dtype=torch.int32),
            "lengths": torch.tensor([len(seq) for seq in seqs], dtype=torch.int32),
            "prompt_lengths": torch.tensor(prompt_lengths, dtype=torch.int32),
        }
        if layers:
            tensors["aux"] = every[:, :-width].contiguous()
            tensors["aux_layers"] = torch.tensor(layers, dtype=torch.int32)
        save_file(tensors, str(path))

    @staticmethod
    def _shard_holds(shard: Path) -> tuple[int, tuple[int, ...]]:
        """A stored shard's number of samples and the layers of its aux states (() without)."""
        from safetensors import safe_open

        with safe_open(str(shard), "pt") as f:
            layers = tuple(f.get_tensor("aux_layers").tolist()) if "aux_layers" in f.keys() else ()
            return int(f.get_slice("lengths").get_shape()[0]), layers

    @property
    def _width(self) -> int:
        return self.llm.engine.model.config.hidden_size

    def _feature_layers(self) -> tuple[int, ...]:
        return feature_layers(self.c.feature_layers, self.llm.engine.model.config.num_layers)

    def _states(self, ids: list[int], layers: tuple[int, ...], num_layers: int | None = None) -> torch.Tensor:
        """The target's final-normed states at every token of `ids`, from the engine's own forward
        (the features serving will see): [n, (len(layers) + 1) * H], the normed states after each of
        `layers` first, then the last layer's (or, with `num_layers`, the state after that many).
        Writes K/V into blocks no request holds (none runs now; prefix caching is off)."""
        runner = self.llm.engine.runner
        bs = runner.block_size
        table = list(range(-(-len(ids) // bs)))
        out = runner.run([ForwardItem(table, 0, ids)], num_layers=num_layers, all_hidden=True, feature_layers=layers)
        assert out.all_hidden is not None
        return out.all_hidden

    # -- 3. training -------------------------------------------------------------------------------
    def train(self) -> Path:
        from safetensors.torch import load_file
        from tqdm import tqdm

        c = self.c
        torch.manual_seed(c.seed)
        shards = sorted(self.data.glob("features-*.safetensors"))
        if not shards:
            raise ValueError(f"out: no features in {self.data}; the answers stage produced nothing")
        layers = self._feature_layers()
        parts = [load_file(str(s)) for s in shards]
        for s, p in zip(shards, parts):
            if layers and tuple(p.get("aux_layers", torch.zeros(0)).tolist()) != layers:
                raise ValueError(f"feature_layers: {s} holds no states for layers {layers}; run the features stage")
        aux = torch.cat([p["aux"] for p in parts]) if layers else None
        hidden = torch.cat([p["hidden"] for p in parts])
        if aux is not None and aux.shape[0] != hidden.shape[0]:
            raise ValueError(f"feature_layers: the stored states after layers {layers} cover {aux.shape[0]} positions, "
                             f"the last layer's {hidden.shape[0]}; delete the features-*.safetensors and run again")
        tokens = torch.cat([p["tokens"] for p in parts]).long()
        lengths = torch.cat([p["lengths"] for p in parts]).tolist()
        prompt_lengths = torch.cat([p["prompt_lengths"] for p in parts]).tolist()
        starts = [0]
        for n in lengths[:-1]:
            starts.append(starts[-1] + n)
        samples = [(s, n, p) for s, n, p in zip(starts, lengths, prompt_lengths) if n - p >= 2]
        random.Random(c.seed).shuffle(samples)
        n_eval = max(1, int(len(samples) * c.eval_fraction)) if c.eval_fraction > 0 and len(samples) > 4 else 0
        evals, trains = samples[:n_eval], samples[n_eval:]

        target = self.llm.engine.model
        cfg = target.config
        vocab_ids = self._draft_vocab(tokens, samples, cfg.vocab_size)
        head_cfg = HeadConfig.for_target(cfg, len(vocab_ids), target=c.model, feature_layers=layers)
        head = EagleHead(head_cfg, cfg.rope_theta, cfg.rope_scaling).to(c.device)
        head.vocab_ids.copy_(vocab_ids)
        embed = target.embed_tokens.weight.detach().float().to(c.device)
        lm = lm_head_weight(target)
        lm_rows = lm.detach().float()[vocab_ids.to(lm.device)].to(c.device).clone()
        to_draft = torch.full((cfg.vocab_size,), -100, dtype=torch.long)
        to_draft[vocab_ids] = torch.arange(len(vocab_ids))
        choices = None if c.answer_only else self._choices(hidden, tokens, starts, lengths, prompt_lengths, lm)
        data = _Data(hidden, tokens, embed, to_draft, c.device, choices, aux)
        held_out = _Data(hidden, tokens, embed, to_draft, c.device, aux=aux)  # judged on answer tokens only

        # bfloat16 matmuls (float32 weights, optimizer and losses) halve a step on CPUs with BF16
        # dot products: 9 -> 4.5 s a 2048-token step of the 1.5B's head on a 2-core Zen 4.
        def amp() -> Any:
            return torch.autocast(torch.device(c.device).type, dtype=torch.bfloat16,
                                  enabled=c.precision == "bfloat16")

        batches_per_epoch = len(list(_batches(trains, c.batch_tokens, random.Random(0))))
        total = max(1, batches_per_epoch * c.epochs)
        # the fusing projection learns at a tenth of the rate: it starts passing the last layer's state
        # through, and Adam's steps of size ~lr on each of its (layers + 1) * H * H weights at the full
        # rate scrambled that pass-through in the first 20 steps (held-out top-1 0.07 against 0.23
        # without fusion, the 1.5B's code edits)
        fuse = [p for n, p in head.named_parameters() if n.startswith("fuse.")]
        rest = [p for n, p in head.named_parameters() if not n.startswith("fuse.")]
        groups = [{"params": rest}] + ([{"params": fuse, "lr": c.lr * FUSE_LR_SCALE}] if fuse else [])
        opt = torch.optim.AdamW(groups, lr=c.lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _schedule(s, total))
        ckpt = self.out / "checkpoint.pt"
        step, seen = 0, 0
        if ckpt.exists():
            state = torch.load(str(ckpt), map_location=c.device, weights_only=False)
            if state.get("config", asdict(head_cfg)) != asdict(head_cfg):
                raise ValueError(f"feature_layers: {ckpt} trains another head ({state['config']}), not {asdict(head_cfg)}; "
                                 f"delete it or use another out directory")
            head.load_state_dict(state["head"])
            opt.load_state_dict(state["opt"])
            sched.load_state_dict(state["sched"])
            step, seen = state["step"], state["seen"]
            logger.info("resuming at step %d of %d", step, total)
        passes = c.own_feature_passes + 1 if c.own_feature_weight > 0 else 1  # the passes the loss counts
        log = (self.out / "train_log.jsonl").open("a")
        start = time.perf_counter()
        bar = tqdm(total=total, initial=step, desc="train", unit="step")
        for epoch in range(step // batches_per_epoch if batches_per_epoch else 0, c.epochs):
            batches = list(_batches(trains, c.batch_tokens, random.Random(c.seed + epoch)))
            for batch in batches[step - epoch * batches_per_epoch:]:
                head.train()
                with amp():
                    losses = self._losses(head, lm_rows, data, batch, passes, noise=c.feature_noise,
                                          soft=c.soft_tokens)
                    loss = losses["feature"] + c.token_weight * losses["token"]
                    for k in range(2, passes + 1):
                        loss = loss + c.own_feature_weight * (losses[f"feature{k}"] + c.token_weight * losses[f"token{k}"])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
                opt.step()
                sched.step()
                step += 1
                seen += sum(n for _, n, _ in batch)
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{losses['acc'].item():.2f}")
                if step % c.eval_every == 0 or step == total:
                    row = {"step": step, "tokens_seen": seen, "seconds": time.perf_counter() - start,
                           "loss": loss.item(), **self._evaluate(head, lm_rows, held_out, evals)}
                    log.write(json.dumps(row) + "\n")
                    log.flush()
                    torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                                "step": step, "seen": seen, "config": asdict(head_cfg)}, str(ckpt))
        bar.close()
        self._note("train_seconds", time.perf_counter() - start)
        save_head(head, self.out, extra={"trained": {**asdict(c), "steps": step, "tokens_seen": seen,
                                                     "train_samples": len(trains), "eval_samples": len(evals)}})
        return self.out

    def _choices(self, hidden: torch.Tensor, tokens: torch.Tensor, starts: list[int], lengths: list[int],
                 prompt_lengths: list[int], lm: torch.Tensor) -> torch.Tensor:
        """The target's greedy choice after every stored position. Within an answer that is the
        token it went on to generate (its greedy answer); elsewhere (prompt tokens, and after an
        answer's last token) the argmax of its LM head over the stored feature, which costs a
        vocabulary-wide product per position (for all 462k positions of 1280 code edits, 20 minutes
        of 2 cores; about half of them are answer positions). Kept in the data directory once
        computed."""
        path = self.data / "choices.pt"
        if path.exists():
            saved = torch.load(str(path), weights_only=True)
            if saved.shape[0] == hidden.shape[0]:
                return saved
        out = torch.empty(hidden.shape[0], dtype=torch.long)
        known = torch.zeros(hidden.shape[0], dtype=torch.bool)
        for s, n, p in zip(starts, lengths, prompt_lengths):
            if p >= 1:  # positions p - 1 .. n - 2: the answer's tokens follow them
                out[s + p - 1 : s + n - 1] = tokens[s + p : s + n]
                known[s + p - 1 : s + n - 1] = True
        rest = (~known).nonzero().squeeze(1)
        w = lm.detach().float()
        with torch.inference_mode():
            for i in range(0, rest.shape[0], 1024):
                rows = rest[i : i + 1024]
                out[rows] = (hidden[rows].to(w.device).float() @ w.T).argmax(-1).cpu()
        torch.save(out, str(path))
        return out

    def _draft_vocab(self, tokens: torch.Tensor, samples: list[tuple[int, int, int]], vocab: int) -> torch.Tensor:
        """The `draft_vocab` most frequent answer tokens (FR-Spec), the end-of-sequence ids among them."""
        if self.c.draft_vocab == 0 or self.c.draft_vocab >= vocab:
            return torch.arange(vocab)
        counts = torch.zeros(vocab)
        for s, n, p in samples:
            counts += torch.bincount(tokens[s + p : s + n], minlength=vocab)[:vocab].float()
        for e in self.llm.engine.eos_token_ids:
            counts[e] = float("inf")
        return counts.topk(self.c.draft_vocab).indices.sort().values

    def _losses(self, head: EagleHead, lm_rows: torch.Tensor, data: "_Data", batch: list[tuple[int, int, int]],
                passes: int, noise: float = 0.0, soft: bool = False) -> dict[str, torch.Tensor]:
        """Pass 1 reads the target's features; pass k > 1 reads, at row j, the head's own prediction
        of f_j from pass k - 1 (row j - 1), as drafting does when it expands a depth-(k - 1) node into
        depth k, and attends as that node does (EAGLE-3's training-time test): to the target-fed rows up to j - k + 1 and to
        its own chain of earlier passes' rows (`_ChainAttend`). Keys: feature{k}, token{k}, acc{k},
        labels{k} (how many rows acc{k} counts; pass 1 without the number). With `soft`, the token
        loss of every pass is against the target's distribution at the row (`target_distribution`)."""
        feats, embeds, positions, next_feats, labels, fmask = data.batch(batch)
        if noise > 0:
            feats = feats + (torch.rand_like(feats) * 2 - 1) * noise
        probs = target_distribution(next_feats, lm_rows) if soft else None
        outs = head_passes(head, feats, embeds, positions, passes)
        names = ("feature", "token", "acc", "labels")
        result = dict(zip(names, _terms(outs[0], lm_rows, next_feats, labels, fmask, probs)))
        for k, out in enumerate(outs[1:], start=2):
            valid = torch.arange(out.shape[1], device=out.device) >= k - 1  # rows with a whole chain
            keep = labels.masked_fill(~valid, -100)
            result.update(zip((f"{n}{k}" for n in names),
                              _terms(out, lm_rows, next_feats, keep, fmask & valid, probs)))
        return result

    @torch.no_grad()
    def _evaluate(self, head: EagleHead, lm_rows: torch.Tensor, data: "_Data",
                  evals: list[tuple[int, int, int]]) -> dict[str, float]:
        """Held-out top-1 accuracy on the target's next token, from the target's features (acc1) and
        from the head's own (acc2, and acc3 .. for more passes: depth k reads features the head
        predicted k - 1 times over); `chain5`: the accepted tokens a five-token greedy chain would get
        if depth k were right with acc{k} (the last pass's for deeper ones; an estimate, not a
        measurement)."""
        if not evals:
            return {}
        head.eval()
        passes = max(2, self.c.own_feature_passes + 1)
        hits = [0.0] * passes
        counts = [0.0] * passes
        for batch in _batches(evals, self.c.batch_tokens, None):
            losses = self._losses(head, lm_rows, data, batch, passes)
            for k in range(passes):
                suffix = "" if k == 0 else str(k + 1)
                n = losses[f"labels{suffix}"].item()
                hits[k] += losses[f"acc{suffix}"].item() * n
                counts[k] += n
        accs = [h / max(n, 1.0) for h, n in zip(hits, counts)]
        chain, reach = 0.0, 1.0
        for depth in range(5):
            reach *= accs[min(depth, passes - 1)]
            chain += reach
        return {**{f"acc{k + 1}": a for k, a in enumerate(accs)}, "chain5": chain}

    def _note(self, key: str, value: float) -> None:
        path = self.out / "timings.json"
        notes = json.loads(path.read_text()) if path.exists() else {}
        notes[key] = notes.get(key, 0.0) + value
        path.write_text(json.dumps(notes, indent=2) + "\n")


class _StateRecorder:
    """The target's states per request as the engine commits them (`EngineCore.record_states`),
    kept in float16; a recomputed stretch (a preempted request) replaces what was there."""

    def __init__(self) -> None:
        self._chunks: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def __call__(self, request_id: str, start: int, states: torch.Tensor) -> None:
        chunks = self._chunks.setdefault(request_id, [])
        while chunks and chunks[-1][0] >= start:
            chunks.pop()
        if chunks and chunks[-1][0] + chunks[-1][1].shape[0] > start:
            first, kept = chunks[-1]
            chunks[-1] = (first, kept[: start - first])
        chunks.append((start, states.to(torch.float16).cpu()))

    def take(self, request_id: str, n: int) -> torch.Tensor:
        """The request's states at positions 0 .. n - 1 [n, width] (and forgets the request)."""
        chunks = self._chunks.pop(request_id, [])
        end = 0
        for first, states in chunks:
            if first != end:
                raise ValueError(f"request {request_id}: no states recorded for positions {end} .. {first - 1}")
            end += states.shape[0]
        if end < n:
            raise ValueError(f"request {request_id}: states recorded for {end} positions, {n} needed")
        return torch.cat([t for _, t in chunks])[:n]


def _schedule(step: int, total: int) -> float:
    """Warm-up over the first 5% of the steps (at most 50), then cosine decay to zero at `total`."""
    warm = max(1, min(50, total // 20))
    return min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(step, total) / total))


def head_passes(head: EagleHead, feats: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                passes: int) -> list[torch.Tensor]:
    """The head's outputs [B, L, H] in each training pass: the first reads the target's features
    (row j: its states at j through `target_features`, and the embedding of t_{j+1}); pass k reads
    at row j pass k - 1's output at row j - 1 and attends as `_ChainAttend` says, so that its row j
    computes what drafting computes for the depth-(k - 1) node t_{j+1} over the target-fed rows
    0 .. j - k + 1."""
    chain = _ChainAttend()
    feats = head.target_features(feats)
    outs = [head(feats, embeds, positions, chain)]
    for _ in range(passes - 1):
        own = torch.cat((feats[:, :1], outs[-1][:, :-1]), dim=1)
        outs.append(head(own, embeds, positions, chain))
    return outs


class _ChainAttend:
    """Attention for the passes of `_losses` (EAGLE-3's training-time test): pass 1 is causal over
    its own rows; in pass k, row j attends to pass 1's rows 0 .. j - k + 1 (what the target fed)
    and to row j - k + i of each pass i = 2 .. k (its chain of drafted nodes, itself last). Each
    call records its keys and values for the passes after it."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.keys.append(k)
        self.values.append(v)
        passes = len(self.keys)
        if passes == 1:
            return causal_attend(q, k, v)
        length = q.shape[1]
        rows = torch.arange(length, device=q.device).unsqueeze(1)
        cols = torch.arange(length, device=q.device).unsqueeze(0)
        masks = [cols <= rows - passes + 1] + [cols == rows - passes + i for i in range(2, passes + 1)]
        mask = torch.cat(masks, dim=1)  # [L, passes * L]
        return causal_attend(q, torch.cat(self.keys, dim=1), torch.cat(self.values, dim=1), mask)


def target_distribution(next_feats: torch.Tensor, lm_rows: torch.Tensor) -> torch.Tensor:
    """The target's next-token distribution over the draft vocabulary at each row [B, L, V]: its LM
    head's rows over its stored state f_{j+1} (final-normed: the logits exactly), renormalized over
    those rows. Float32 outside autocast: bfloat16 logits would move probabilities by ~10%."""
    with torch.no_grad(), torch.autocast(next_feats.device.type, enabled=False):
        return (next_feats.float() @ lm_rows.float().T).softmax(-1)


def _terms(out: torch.Tensor, lm_rows: torch.Tensor, next_feats: torch.Tensor, labels: torch.Tensor,
           fmask: torch.Tensor, probs: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Feature loss, token loss (against `labels`, or with `probs` against the target's distribution
    on the same rows), top-1 accuracy on `labels` and the number of labelled rows of one pass."""
    feature = F.smooth_l1_loss(out[fmask].float(), next_feats[fmask])
    keep = labels >= 0
    logits = out[keep] @ lm_rows.T
    target = labels[keep] if probs is None else probs[keep]
    token = F.cross_entropy(logits.float(), target) if logits.shape[0] else out.sum() * 0
    acc = (logits.argmax(-1) == labels[keep]).float().mean() if logits.shape[0] else out.new_zeros(())
    return feature, token, acc, keep.sum()


class _Data:
    """Padded training batches from the flat feature store."""

    def __init__(self, hidden: torch.Tensor, tokens: torch.Tensor, embed: torch.Tensor, to_draft: torch.Tensor,
                 device: str, choices: torch.Tensor | None = None, aux: torch.Tensor | None = None) -> None:
        self.hidden, self.tokens, self.embed, self.to_draft, self.device = hidden, tokens, embed, to_draft, device
        self.choices = choices  # the target's choice after each position: labels for every row
        self.aux = aux  # the states after the feature layers, read with `hidden` (the target's side)

    def batch(self, batch: list[tuple[int, int, int]]) -> tuple[torch.Tensor, ...]:
        """Rows j = 0 .. n - 2 of each sample: the target's states at j (with `aux`, those after the
        feature layers and then f_j), embeddings of t_{j+1}, positions; targets f_{j+1} (all rows) and the draft-vocabulary index of the target's choice after j + 1: with
        `choices`, at every row; else t_{j+2} where it is an answer token (-100 elsewhere, and where
        the choice is outside the draft vocabulary)."""
        length = max(n for _, n, _ in batch) - 1
        b = len(batch)
        h = self.hidden.shape[1]
        width = h + (self.aux.shape[1] if self.aux is not None else 0)
        feats = torch.zeros(b, length, width)
        nxt = torch.zeros(b, length, h)
        ids = torch.zeros(b, length, dtype=torch.long)
        labels = torch.full((b, length), -100, dtype=torch.long)
        fmask = torch.zeros(b, length, dtype=torch.bool)
        for i, (s, n, p) in enumerate(batch):
            rows = n - 1
            feats[i, :rows, -h:] = self.hidden[s : s + rows].float()
            if self.aux is not None:
                feats[i, :rows, :-h] = self.aux[s : s + rows].float()
            nxt[i, :rows] = self.hidden[s + 1 : s + n].float()
            ids[i, :rows] = self.tokens[s + 1 : s + n]
            fmask[i, :rows] = True
            if self.choices is not None:
                labels[i, :rows] = self.to_draft[self.choices[s + 1 : s + n]]
                continue
            # row j predicts t_{j+2}: the target's choice when j + 2 >= p
            lab = self.to_draft[self.tokens[s + 2 : s + n]]
            first = max(0, p - 2)
            labels[i, first : n - 2] = lab[first:]
        positions = torch.arange(length).expand(b, length)
        dev = self.device
        return (feats.to(dev), self.embed[ids.to(dev)], positions.to(dev), nxt.to(dev), labels.to(dev),
                fmask.to(dev))


def _batches(samples: list[tuple[int, int, int]], batch_tokens: int,
             rng: random.Random | None) -> Iterator[list[tuple[int, int, int]]]:
    """Samples of similar length together, up to `batch_tokens` padded tokens a batch; the batches
    shuffled when `rng` is given."""
    ordered = sorted(samples, key=lambda x: x[1])
    out: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    for s in ordered:
        if cur and (len(cur) + 1) * s[1] > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(s)
    if cur:
        out.append(cur)
    if rng is not None:
        rng.shuffle(out)
    yield from out
