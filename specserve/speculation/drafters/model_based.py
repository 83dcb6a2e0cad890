"""Drafters that run a model: the target's own first layers (layer skipping) or a smaller model.

Both draft chains autoregressively, one batched forward per draft position for all
requests. Greedy requests take the draft's argmax (a point-mass proposal); sampling
requests draw from the draft's distribution after the same logits processing the
target uses and return it, so verification can stay lossless.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from specserve.model.forward import Forward, ForwardItem
from specserve.speculation.drafter import Drafter, DraftRequest, RequestView
from specserve.speculation.sampler import Sampler, draft_generator
from specserve.speculation.tree import EMPTY_TREE, DraftTree


@dataclass
class _Chain:
    request: DraftRequest
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # the draft's probability of each pick
    reach: float = 1.0  # their product: the draft's own chance that the whole chain is right


class _ChainDrafter(Drafter):
    """Shared chain drafting: feed what each request needs before its first draft token, then feed
    each drafted token back until its budget is used, the draft's confidence in its own pick falls
    below `stop_below`, or its confidence in the whole chain (the product) below the request's
    `min_value` (a chain that is likely wrong costs forwards and buys nothing). Each node's score
    is the draft's probability of its pick (the acceptance model calibrates it).

    Where a chain ends depends only on the draft's own picks, drawn before the target sees them:
    verification of each drafted position is unchanged, so the output's distribution is too."""

    runs_a_model = True
    stops_by_value = True

    def __init__(
        self, forward: Forward, generator: torch.Generator, num_layers: int | None, stop_below: float = 0.0
    ) -> None:
        self.forward = forward
        self.generator = generator
        self.num_layers = num_layers
        self.stop_below = stop_below

    def _draft(self, chains: list[_Chain], first: list[ForwardItem], starts: list[int]) -> list[DraftTree]:
        items = first
        live = list(range(len(chains)))
        step = 0
        while live:
            logits, rows = self.forward(items, self.num_layers)
            picked = self._pick([chains[i] for i in live], logits[[r[0] for r in rows]])  # type: ignore[index]
            confident = set()
            for i, (tok, prob, conf) in zip(live, picked):
                c = chains[i]
                c.tokens.append(tok)
                c.scores.append(conf)
                c.reach *= conf
                if prob is not None:
                    c.probs.append(prob)
                if conf >= self.stop_below and c.reach >= c.request.min_value:
                    confident.add(i)
            step += 1
            live = [i for i in live if i in confident and len(chains[i].tokens) < chains[i].request.budget]
            items = [
                ForwardItem(self._table(chains[i].request), starts[i] + step, [chains[i].tokens[-1]])
                for i in live
            ]
        return [
            DraftTree.chain(c.tokens, torch.stack(c.probs) if c.probs else None, c.scores) if c.tokens else EMPTY_TREE
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
            view = c.request.view
            gen = self.generator if p.seed is None else draft_generator(
                p.seed, len(view.prompt_token_ids) + len(view.output_token_ids) + len(c.tokens), 0,
                self.generator.device)
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


class PagedKV(Protocol):
    """A draft model's own paged KV cache, one block table per request."""

    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        """The request's block table, grown to hold `num_tokens`; None when no blocks are free."""

    def release(self, request_id: str) -> None:
        """Free every block of the request."""


@dataclass
class _DraftSide:
    tokens: list[int]  # what the draft model has been fed (K/V valid for the first num_computed)
    offset: int = 0  # the request's tokens before this are not the draft's (its window's start)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)


class DraftModelDrafter(_ChainDrafter):
    """A smaller model with the same tokenizer, with its own paged KV cache.

    Each request keeps a draft-side sequence; before drafting, the draft model catches up on the
    tokens committed since its last step (its K/V for rejected drafts is simply overwritten),
    batched across requests, then drafts the chain. A request more than CATCH_UP tokens behind (its
    prompt, or the steps decoded plainly since it last drafted) catches up in a forward of its own,
    whose time is `catch_up_seconds`: what keeping the draft in step costs, paid once, not what
    the drafts cost (counted as theirs, the probe that could turn drafting back on looked several
    times a drafted step, and the guard kept the draft off; BENCHMARKS.md, session 21).

    The draft reads at most the last `window` tokens of a request's prompt (its first position is
    the window's first token; RoPE sees only distances, so that is the text as if it began there),
    then follows everything generated: a draft is only a proposal, catching up on a prompt costs
    the draft in proportion to the prompt (for every request, at a batch's first drafted steps),
    and its drafts after the first tokens lean on the answer so far (BENCHMARKS.md, session 22).
    None reads every prompt whole.
    """

    CATCH_UP = 8

    def __init__(
        self, forward: Forward, kv: PagedKV, generator: torch.Generator, stop_below: float = 0.0,
        window: int | None = None,
    ) -> None:
        super().__init__(forward, generator, None, stop_below)
        if window is not None and window < 1:
            raise ValueError(f"draft_window: must be at least 1, got {window}")
        self.kv = kv
        self.window = window
        self._sides: dict[str, _DraftSide] = {}
        self._per_token: float | None = None  # seconds a token caught up, measured (a moving average)

    def catch_up_cost(self, view: RequestView) -> float:
        if self._per_token is None:
            return 0.0
        side = self._sides.get(view.request_id)
        total = len(view.prompt_token_ids) + len(view.output_token_ids)  # (token_ids would build the tuple)
        behind = total - self._offset(view) if side is None else total - side.offset - side.num_computed
        return self._per_token * (behind - 1) if behind > self.CATCH_UP else 0.0

    def _offset(self, view: RequestView) -> int:
        prompt = len(view.prompt_token_ids)
        return 0 if self.window is None else max(0, prompt - self.window)

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        chains: list[_Chain] = []
        first: list[ForwardItem] = []
        starts: list[int] = []
        ok: list[bool] = []
        for r in requests:
            side = self._sync(r.view) if r.budget > 0 else None
            table = None if side is None else self.kv.reserve(r.view.request_id, len(side.tokens) + r.budget)
            if side is None or table is None:
                ok.append(False)
                continue
            side.block_table = table
            ok.append(True)
            chains.append(_Chain(r))
            first.append(ForwardItem(list(table), side.num_computed, side.tokens[side.num_computed:]))
            starts.append(len(side.tokens) - 1)
        self._catch_up(chains, first)
        trees = iter(self._draft(chains, first, starts) if chains else [])
        for c in chains:  # the draft has K/V for everything fed: committed tokens and chain[:-1]
            side = self._sides[c.request.view.request_id]
            side.tokens = list(c.request.view.token_ids[side.offset:]) + c.tokens[:-1]
            side.num_computed = len(side.tokens)
        return [next(trees) if good else EMPTY_TREE for good in ok]

    def _catch_up(self, chains: list[_Chain], first: list[ForwardItem]) -> None:
        """Feed the requests far behind all but their last token in a forward of its own (no
        logits), timed into `catch_up_seconds`; their first draft forward then feeds one token."""
        self.catch_up_seconds = 0.0
        behind = [i for i, item in enumerate(first) if len(item.tokens) > self.CATCH_UP]
        if not behind:
            return
        start = time.perf_counter()
        self.forward([replace(first[i], tokens=first[i].tokens[:-1], logits="none") for i in behind])
        fed = 0
        for i in behind:
            item = first[i]
            fed += len(item.tokens) - 1
            first[i] = replace(item, start=item.start + len(item.tokens) - 1, tokens=item.tokens[-1:])
            self._sides[chains[i].request.view.request_id].num_computed = first[i].start
        self.catch_up_seconds = time.perf_counter() - start
        per = self.catch_up_seconds / fed
        self._per_token = per if self._per_token is None else 0.8 * self._per_token + 0.2 * per

    def _table(self, request: DraftRequest) -> list[int]:
        return self._sides[request.view.request_id].block_table

    def _sync(self, view: RequestView) -> _DraftSide:
        """The draft side for `view`, holding its tokens from its window's start, K/V valid for
        the common prefix."""
        side = self._sides.get(view.request_id)
        if side is None:
            offset = self._offset(view)
            side = self._sides[view.request_id] = _DraftSide(list(view.token_ids[offset:]), offset)
            return side
        tokens = list(view.token_ids[side.offset:])
        common = 0
        old = side.tokens
        limit = min(len(old), len(tokens), side.num_computed)
        while common < limit and old[common] == tokens[common]:
            common += 1
        side.tokens = tokens
        side.num_computed = min(common, len(tokens) - 1)  # the last token is fed again
        return side

    def finish(self, request_id: str, view: RequestView) -> None:
        if self._sides.pop(request_id, None) is not None:
            self.kv.release(request_id)


def check_same_tokenizer(target: Any, draft: Any) -> None:
    """Draft and target must map text to the same ids, or drafts are meaningless."""
    if target is None or draft is None:
        raise ValueError("draft_model: both models need a tokenizer to check they share one")
    if target is not draft and target.get_vocab() != draft.get_vocab():  # (one object: 0.3 s of a 151k vocabulary saved)
        raise ValueError("draft_model: the draft model's tokenizer differs from the target's; "
                         "speculative decoding needs the same vocabulary")
