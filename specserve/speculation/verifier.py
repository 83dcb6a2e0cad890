"""Accepting draft tokens without changing the output distribution.

Greedy: follow the target's argmax from the root; a child is accepted when its
token is that argmax; the target's argmax after the last accepted node is the
bonus token. Output is token for token what plain greedy decoding gives.

Sampling: recursive rejection sampling over the tree (SpecInfer's multi-step
speculative sampling, SpecTr/RSD for several candidates). At a node with target
distribution p, its children are tried in order; child c (token x, drawn from
proposal q_c) is accepted with probability min(1, p(x) / q_c(x)). On rejection
p becomes norm(max(p - q_c, 0)) and the next child is tried. When no child is
accepted, the bonus token is drawn from the current p. A deterministic proposal
(no probs) is the point mass q_c = 1[x]: accept with probability p(x), else
remove x from p. With independent proposals this samples exactly from the
target, whatever the drafts are (Leviathan et al. 2023; Miao et al. 2024).

A seeded request is verified against its own per-position noise instead (the sampler's
`position_noise`): the target's token at output position j is argmax(p / E(seed, j)), exactly
what plain decoding draws there, and a child is accepted when it is that token. The output is
then the same token for token with any drafts or none (a draw from p at each position, so still
the target's distribution); a draft is accepted with chance p(x), as for a point-mass proposal.

With a structured-output grammar, the target's logits at the root and after every node are first
masked to the tokens the grammar allows after that node's path, as plain constrained decoding masks
them; drafts are then judged against that constrained target.

The target distribution at each node is the fully processed one (penalties on
the output including the path to that node, temperature, top-k, top-p, min-p),
the same processing plain decoding uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.outputs import TokenLogprob
from specserve.speculation.grammar import masks
from specserve.speculation.sampler import (
    Sampler,
    SamplingRow,
    greedy_choice,
    position_noise,
    row_argmax,
    row_errors,
    token_logprobs,
)
from specserve.speculation.tree import DraftTree
from specserve.structured import apply_bitmask


@dataclass(frozen=True)
class Verdict:
    accepted: list[int]  # accepted node indices, root to leaf (node at depth d is accepted[d - 1])
    tokens: list[int]  # emitted tokens: the accepted nodes' tokens, then the target's own token
    logprobs: list[TokenLogprob | None]
    error: str | None = None  # set when the request's distribution broke down: nothing is emitted


def failed(error: str) -> Verdict:
    """The verdict of a request that cannot go on: no tokens, and why."""
    return Verdict([], [], [], error)


class Verifier:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator  # for requests without a seed of their own

    def verify(self, seq: SamplingRow, tree: DraftTree, logits: torch.Tensor) -> Verdict:
        """`logits` [len(tree) + 1, vocab]: the target at the root (row 0) and after each node (row i + 1)."""
        params = seq.params
        n = len(tree)
        paths = self._paths(tree)
        done = list(seq.output_token_ids)
        outputs = [done] + [done + path for path in paths]
        raw = logits
        if seq.grammar is not None:
            logits = apply_bitmask(logits, masks(tree, seq.grammar))
        processed = Sampler.processed_logits(
            logits, [params] * (n + 1), [list(seq.prompt_token_ids)] * (n + 1), outputs
        )
        picks, errors = (greedy_choice(processed, [params] * (n + 1)) if params.greedy
                         else (None, row_errors(processed, [params] * (n + 1))))
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            return failed(error)
        children = self._children(tree)
        if picks is not None:
            accepted, bonus = self._greedy(tree, children, picks)
        elif params.seed is not None:
            # Row r is drawn at output position len(output) + depth(r): the root's row at depth 0.
            start = len(seq.output_token_ids)
            vocab = processed.shape[1]
            noise = torch.stack([
                position_noise(params.seed, start + d, vocab, processed.device) for d in [0] + tree.depths()
            ])
            picks = row_argmax(processed.softmax(dim=-1) / noise).tolist()
            accepted, bonus = self._greedy(tree, children, picks)
        else:
            accepted, bonus = self._sample(tree, children, processed.softmax(dim=-1), self.generator)
        tokens = [tree.tokens[a] for a in accepted] + [bonus]
        logprobs: list[TokenLogprob | None] = [None] * len(tokens)
        if params.logprobs is not None:
            rows = [0] + [a + 1 for a in accepted]  # the row each emitted token was drawn at
            raw_logprobs = torch.log_softmax(raw[rows], dim=-1)
            logprobs = token_logprobs(raw_logprobs, tokens, [params.logprobs] * len(tokens))
        return Verdict(accepted, tokens, logprobs)

    @classmethod
    def greedy_verdict(cls, tree: DraftTree, picks: list[int]) -> Verdict:
        """The verdict of `verify` for a request whose every row's pick is its raw argmax
        (`sampler.argmax_only`), given those argmaxes (`picks`, one a row, all finite)."""
        accepted, bonus = cls._greedy(tree, cls._children(tree), picks)
        tokens = [tree.tokens[a] for a in accepted] + [bonus]
        return Verdict(accepted, tokens, [None] * len(tokens))

    @staticmethod
    def _children(tree: DraftTree) -> dict[int, list[int]]:
        """Each node's children (-1: the root's), in the drafter's order of preference."""
        children: dict[int, list[int]] = {}
        for i, p in enumerate(tree.parents):
            children.setdefault(p, []).append(i)
        return children

    @staticmethod
    def _paths(tree: DraftTree) -> list[list[int]]:
        """Tokens from the root to each node, inclusive."""
        paths: list[list[int]] = []
        for i, p in enumerate(tree.parents):
            paths.append((paths[p] if p >= 0 else []) + [tree.tokens[i]])
        return paths

    @staticmethod
    def _greedy(tree: DraftTree, children: dict[int, list[int]], argmax: list[int]) -> tuple[list[int], int]:
        accepted: list[int] = []
        node = -1
        while True:
            target = argmax[node + 1]
            match = next((c for c in children.get(node, []) if tree.tokens[c] == target), None)
            if match is None:
                return accepted, target
            accepted.append(match)
            node = match

    @staticmethod
    def _sample(
        tree: DraftTree, children: dict[int, list[int]], probs: torch.Tensor, gen: torch.Generator
    ) -> tuple[list[int], int]:
        accepted: list[int] = []
        node = -1
        while True:
            p = probs[node + 1]
            chosen = None
            for c in children.get(node, []):
                x = tree.tokens[c]
                q = None if tree.probs is None else tree.probs[c].to(p.device, p.dtype)
                u = torch.rand((), generator=gen, device=gen.device).to(p.device)
                if bool(u < Verifier._acceptance(p, q, x)):
                    chosen = c
                    break
                residual = Verifier._residual(p, q, x)
                if residual is None:  # p == q up to rounding: nothing left to correct
                    p = probs[node + 1]
                    break
                p = residual
            if chosen is None:
                bonus = int(torch.multinomial(p.to(gen.device), 1, generator=gen).item())
                return accepted, bonus
            accepted.append(chosen)
            node = chosen

    @staticmethod
    def _acceptance(p: torch.Tensor, q: torch.Tensor | None, x: int) -> torch.Tensor:
        """The chance of accepting draft token x drawn from q (None: the point mass on x) when
        the target is p: min(1, p(x) / q(x))."""
        return p[x] if q is None else p[x] / q[x].clamp_min(1e-30)

    @staticmethod
    def _residual(p: torch.Tensor, q: torch.Tensor | None, x: int) -> torch.Tensor | None:
        """What the target becomes after x is rejected: norm(max(p - q, 0)) (for a point mass, p
        without x); None when nothing is left."""
        if q is None:
            r = p.clone()
            r[x] = 0.0
        else:
            r = (p - q).clamp_min(0.0)
        total = r.sum()
        return r / total if bool(total > 0) else None
