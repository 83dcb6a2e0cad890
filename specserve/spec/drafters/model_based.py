"""Drafters that run a model: the target's own first layers (layer skipping) or a smaller model.

Both draft chains autoregressively, one batched forward per draft position for all
requests. Greedy requests take the draft's argmax (a point-mass proposal); sampling
requests draw from the draft's distribution after the same logits processing the
target uses and return it, so verification can stay lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from specserve.engine.block_manager import BlockManager
from specserve.engine.model_runner import ForwardItem, ModelRunner
from specserve.engine.sampler import Sampler
from specserve.engine.sequence import Sequence
from specserve.sampling_params import SamplingParams
from specserve.spec.drafter import Drafter, DraftRequest, RequestView
from specserve.spec.tree import EMPTY_TREE, DraftTree


@dataclass
class _Chain:
    request: DraftRequest
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)


class _ChainDrafter(Drafter):
    """Shared chain drafting: feed what each request needs before its first draft token, then feed
    each drafted token back until its budget is used or the draft's confidence in its own pick
    falls below `stop_below` (a chain that is likely wrong costs forwards and buys nothing)."""

    def __init__(
        self, runner: ModelRunner, generator: torch.Generator, num_layers: int | None, stop_below: float = 0.0
    ) -> None:
        self.runner = runner
        self.generator = generator
        self.num_layers = num_layers
        self.stop_below = stop_below

    def _draft(self, chains: list[_Chain], first: list[ForwardItem], starts: list[int]) -> list[DraftTree]:
        items = first
        live = list(range(len(chains)))
        step = 0
        while live:
            logits, rows = self.runner.run(items, num_layers=self.num_layers)
            picked = self._pick([chains[i] for i in live], logits[[r[0] for r in rows]])  # type: ignore[index]
            confident = set()
            for i, (tok, prob, conf) in zip(live, picked):
                chains[i].tokens.append(tok)
                if prob is not None:
                    chains[i].probs.append(prob)
                if conf >= self.stop_below:
                    confident.add(i)
            step += 1
            live = [i for i in live if i in confident and len(chains[i].tokens) < chains[i].request.budget]
            items = [
                ForwardItem(self._table(chains[i].request), starts[i] + step, [chains[i].tokens[-1]])
                for i in live
            ]
        return [
            DraftTree.chain(c.tokens, torch.stack(c.probs) if c.probs else None) if c.tokens else EMPTY_TREE
            for c in chains
        ]

    def _pick(self, chains: list[_Chain], logits: torch.Tensor) -> list[tuple[int, torch.Tensor | None, float]]:
        """Per chain: the next draft token, the distribution it was drawn from (None when greedy),
        and the draft's probability of it."""
        params = [c.request.view.params for c in chains]
        processed = Sampler.processed_logits(
            logits.float(),
            params,
            [list(c.request.view.prompt_token_ids) for c in chains],
            [list(c.request.view.output_token_ids) + c.tokens for c in chains],
        )
        out: list[tuple[int, torch.Tensor | None, float]] = []
        for row, (c, p) in enumerate(zip(chains, params)):
            probs = processed[row].softmax(-1)
            if p.greedy:
                tok = int(probs.argmax())
                out.append((tok, None, float(probs[tok])))
                continue
            gen = c.request.generator or self.generator
            tok = int(torch.multinomial(probs.to(gen.device), 1, generator=gen).item())
            out.append((tok, probs, float(probs[tok])))
        return out

    def _table(self, request: DraftRequest) -> list[int]:
        return list(request.block_table)


class LayerSkipDrafter(_ChainDrafter):
    """Self-speculation with no extra weights: the target's first `num_layers` layers, its final
    norm and LM head (Draft & Verify, SWIFT, LayerSkip).

    The first layers' K/V for committed tokens is exactly what the draft needs, so the drafter
    reads the target's cache, and writes its draft tokens' K/V (first layers only) into the slots
    the scheduler reserved past the committed tokens, which verification then overwrites.
    """

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        chains = [_Chain(r) for r in requests if r.budget > 0]
        if not chains:
            return [EMPTY_TREE for _ in requests]
        first = [ForwardItem(list(c.request.block_table), c.request.num_computed,
                             [c.request.view.token_ids[-1]]) for c in chains]
        trees = iter(self._draft(chains, first, [c.request.num_computed for c in chains]))
        return [next(trees) if r.budget > 0 else EMPTY_TREE for r in requests]


class DraftModelDrafter(_ChainDrafter):
    """A smaller model with the same tokenizer, with its own paged KV cache.

    Each request keeps a draft-side sequence; before drafting, the draft model catches up on the
    tokens committed since its last step (its K/V for rejected drafts is simply overwritten),
    batched across requests, then drafts the chain.
    """

    def __init__(
        self, runner: ModelRunner, blocks: BlockManager, generator: torch.Generator, stop_below: float = 0.0
    ) -> None:
        super().__init__(runner, generator, None, stop_below)
        self.blocks = blocks
        self._seqs: dict[str, Sequence] = {}

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        chains: list[_Chain] = []
        first: list[ForwardItem] = []
        starts: list[int] = []
        ok: list[bool] = []
        for r in requests:
            seq = self._sync(r.view) if r.budget > 0 else None
            if seq is None or not self.blocks.allocate(seq, seq.num_tokens + r.budget):
                ok.append(False)
                continue
            ok.append(True)
            chains.append(_Chain(r))
            first.append(ForwardItem(list(seq.block_table), seq.num_computed_tokens,
                                     seq.prompt_token_ids[seq.num_computed_tokens:]))
            starts.append(seq.num_tokens - 1)
        trees = iter(self._draft(chains, first, starts) if chains else [])
        for c in chains:  # the draft has K/V for everything fed: committed tokens and chain[:-1]
            seq = self._seqs[c.request.view.request_id]
            seq.prompt_token_ids = list(c.request.view.token_ids) + c.tokens[:-1]
            seq.num_computed_tokens = len(seq.prompt_token_ids)
        return [next(trees) if good else EMPTY_TREE for good in ok]

    def _table(self, request: DraftRequest) -> list[int]:
        return self._seqs[request.view.request_id].block_table

    def _sync(self, view: RequestView) -> Sequence | None:
        """The draft-side sequence for `view`, holding its tokens, K/V valid for the common prefix."""
        tokens = list(view.token_ids)
        seq = self._seqs.get(view.request_id)
        if seq is None:
            seq = Sequence(view.request_id, tokens, SamplingParams(), 0.0, max_total_len=1 << 30)
            self._seqs[view.request_id] = seq
            return seq
        common = 0
        old = seq.prompt_token_ids
        limit = min(len(old), len(tokens), seq.num_computed_tokens)
        while common < limit and old[common] == tokens[common]:
            common += 1
        seq.prompt_token_ids = tokens
        seq.num_computed_tokens = min(common, len(tokens) - 1)  # the last token is fed again
        return seq

    def finish(self, request_id: str, view: RequestView) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.blocks.free(seq)


def check_same_tokenizer(target: Any, draft: Any) -> None:
    """Draft and target must map text to the same ids, or drafts are meaningless."""
    if target is None or draft is None:
        raise ValueError("draft_model: both models need a tokenizer to check they share one")
    if target.get_vocab() != draft.get_vocab():
        raise ValueError("draft_model: the draft model's tokenizer differs from the target's; "
                         "speculative decoding needs the same vocabulary")
