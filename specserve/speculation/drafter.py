"""The drafter contract: propose a token tree per decoding request within a budget."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.sampling_params import SamplingParams
from specserve.speculation.tree import DraftTree


@dataclass(frozen=True)
class RequestView:
    """A read-only view of one request, all a drafter may look at."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    params: SamplingParams

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass(frozen=True)
class DraftRequest:
    """One request to draft for. Drafters that run the target itself (layer skipping) also read
    where its K/V lives: they may write draft K/V only into slots from `num_computed` on, which
    verification overwrites."""

    view: RequestView
    budget: int  # at most this many nodes; 0 means propose nothing
    block_table: tuple[int, ...] = ()  # the target's blocks for this request, covering num_computed + 1 + budget slots
    num_computed: int = 0  # target tokens with K/V in the cache (the root token is the next one)
    # A model drafter ends the chain once the product of its own picks' probabilities falls below
    # this: the chance a node must have of being accepted to pay for drafting and verifying it.
    min_value: float = 0.0


Observation = tuple[RequestView, DraftTree, torch.Tensor | None]
"""What `Drafter.observe` is told of one request's step: its view, the tree verified, the target's top ids."""


class Drafter(ABC):
    """Proposes draft trees. One instance serves every request of an engine.

    Contract:
    - `propose` returns one tree per request, in order, each with at most `budget`
      nodes (budget 0 -> the empty tree). It must not change the requests.
    - Trees may be wrong: verification keeps only what the target agrees with.
    - `observe` is called after every step of a decoding request with what the target
      computed: after verifying the drafter's tree; drafters with `target_topk > 0` (that
      learn from the target) also with the empty tree after a plain step or a step verifying
      another drafter's tree;
      `finish` when a request leaves the engine, finished or aborted, so per-request state
      can be dropped.
    - Drafters with `wants_hidden` (learned heads) get, through `features`, the target's final
      hidden state at every token it commits (prefill chunks, the root, accepted nodes), during the
      step, before the next `propose`.
    """

    #: how many of the target's top token ids per verified node `observe` should get (0 = none)
    target_topk: int = 0
    #: whether proposing runs a model forward per draft depth (its cost grows with the chain's
    #: length) rather than a lookup per request
    runs_a_model: bool = False
    #: whether a model drafter ends its proposals where its own confidence falls below the
    #: request's `min_value` (then it is granted its whole budget and decides how far to go)
    stops_by_value: bool = False
    #: whether `features` should get the target's hidden states of committed tokens
    wants_hidden: bool = False
    #: the layers (counted from the input: the residual stream after that many) whose normed
    #: states `features` gets before the final one's, for heads that fuse several (EAGLE-3)
    feature_layers: tuple[int, ...] = ()
    #: seconds of the last `propose` spent catching up on tokens the drafter had not seen for more
    #: than a step (a draft model fed a prompt, or the steps decoded plainly since it last drafted):
    #: what keeping it in step costs, not what its drafts cost (the speculator does not count it
    #: against them)
    catch_up_seconds: float = 0.0

    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        ...

    def catch_up_cost(self, view: RequestView) -> float:
        """Seconds that proposing for `view` now would spend catching up (`catch_up_seconds`), as
        measured so far; 0 for a drafter that never catches up, or before it has measured."""
        return 0.0

    def observe(self, view: RequestView, tree: DraftTree, target_top_ids: torch.Tensor | None) -> None:
        """After a step of `view` (the view before the step's tokens were added) that verified `tree`
        (the empty tree: a step that verified none of this drafter's nodes).

        target_top_ids: [len(tree) + 1, target_topk] the target's most likely next tokens at
        the root (row 0) and at each node (row i + 1), or None when target_topk is 0.
        """

    def observe_many(self, observations: Sequence[Observation]) -> None:
        """`observe` for each of a step's requests, in order (a drafter that learns from every row
        of every step may do them at once)."""
        for view, tree, target_top_ids in observations:
            self.observe(view, tree, target_top_ids)

    def features(self, committed: Sequence[tuple[str, int, torch.Tensor]]) -> None:
        """The target's hidden states of the tokens a step commits, one entry per request: (request
        id, start, [n, H] final-normed states at positions start .. start + n - 1, all committed;
        computed again after a preemption, they replace what was there); [n, (len(feature_layers) +
        1) * H] with feature layers, the final one's columns last. One call a step, so a drafter can
        treat the step's rows together."""

    def finish(self, request_id: str, view: RequestView) -> None:
        """The request left the engine (finished or aborted); `view` is its final state."""
