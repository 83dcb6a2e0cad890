"""EAGLE-style drafting: a learned head over the target's hidden states, a dynamic tree (EAGLE-2).

Each request keeps a small K/V cache of the head's own (one layer). The target's final hidden
states of every token it commits (with a fusing head, also those of its `feature_layers`, fused
as they arrive, a step's requests in one product) reach the drafter through `features`; before
drafting, the head catches up on them (one batched forward for all requests: row j reads (f_j,
t_{j+1})), and its
last row predicts the root's hidden state, whose LM-head logits give the first draft tokens. Then,
depth by depth, one batched forward over the nodes being expanded.

Greedy requests (and seeded ones, which verification treats the same way) get an EAGLE-2 tree:
at each depth the `top_k` most probable nodes by cumulative draft probability are expanded into
their `top_k` most probable children, and the `budget` most probable nodes are kept; each node's
score is its probability given its parent, which the controller calibrates. A request that samples
gets a chain, each token drawn from the head's processed distribution q and carried with it, so
that rejection sampling stays exact; its nodes carry no score, so no node is kept or dropped for
the token it drew.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from specserve.model.eagle import EagleHead
from specserve.speculation.drafter import Drafter, DraftRequest, RequestView
from specserve.speculation.sampler import Sampler, draft_generator
from specserve.speculation.tree import EMPTY_TREE, DraftTree


@dataclass
class _Side:
    """One request's head state: K/V [KVH, cap, D] for head rows at positions first .. first+length-1,
    and the target's features not yet fed (positions pend_start ..)."""

    k: torch.Tensor
    v: torch.Tensor
    first: int
    length: int = 0
    pend_start: int = 0
    pend: list[torch.Tensor] = field(default_factory=list)  # chunks as they came; joined once, when fed
    last_out: torch.Tensor | None = None  # the head's output at its last row (predicts the next feature)

    @property
    def pend_end(self) -> int:
        return self.pend_start + sum(t.shape[0] for t in self.pend)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[1]
        need = self.length + n
        if need > self.k.shape[1]:
            cap = max(need, 2 * self.k.shape[1])
            grow = (self.k.shape[0], cap, self.k.shape[2])
            for name in ("k", "v"):
                old = getattr(self, name)
                new = old.new_empty(grow)
                new[:, : self.length] = old[:, : self.length]
                setattr(self, name, new)
        self.k[:, self.length : need] = k
        self.v[:, self.length : need] = v
        self.length = need


@dataclass
class _Node:
    token: int
    parent: int  # index into the request's nodes, -1: the root
    depth: int
    cum: float  # log of the draft's probability of the path to this node
    q: float  # draft probability of the token given its parent
    probs: torch.Tensor | None = None  # the distribution it was drawn from (sampling)
    expanded: int = -1  # its row among the request's expanded nodes, once expanded
    out: torch.Tensor | None = None  # head output at its row, once expanded


@dataclass
class _Work:
    request: DraftRequest
    side: _Side
    root_out: torch.Tensor | None  # the head output predicting the root's feature (set by the catch-up)
    greedy: bool  # a top-k tree (greedy and seeded requests), else a sampled chain
    nodes: list[_Node] = field(default_factory=list)
    hk: list[torch.Tensor] = field(default_factory=list)  # expanded nodes' K/V [KVH, 1, D]
    hv: list[torch.Tensor] = field(default_factory=list)
    anc: list[list[int]] = field(default_factory=list)  # per expanded node: expanded rows it sees


def _attend(q: torch.Tensor, ka: torch.Tensor, va: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor,
            mask_b: torch.Tensor) -> torch.Tensor:
    """q [n, Hq, D] attends to all of (ka, va) [KVH, L, D] and to the rows of (kb, vb) [KVH, E, D]
    that `mask_b` [n, E] allows; [n, Hq, D]."""
    n, hq, d = q.shape
    kvh = ka.shape[0]
    rep = hq // kvh
    qg = q.reshape(n, kvh, rep, d).permute(1, 2, 0, 3).reshape(kvh, rep * n, d)
    sa = qg @ ka.transpose(1, 2)
    sb = (qg @ kb.transpose(1, 2)).masked_fill(~mask_b.repeat(rep, 1), float("-inf"))
    p = (torch.cat((sa, sb), dim=-1) * (1.0 / math.sqrt(d))).softmax(dim=-1)
    length = ka.shape[1]
    out = p[..., :length] @ va + p[..., length:] @ vb
    return out.reshape(kvh, rep, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)


class EagleDrafter(Drafter):
    runs_a_model = True
    wants_hidden = True

    def __init__(
        self, head: EagleHead, embed: Callable[[torch.Tensor], torch.Tensor], vocab_size: int,
        readout: torch.nn.Module, generator: torch.Generator, top_k: int = 4, max_depth: int = 8,
    ) -> None:
        """embed: the target's token embedding (ids [n] -> [n, H]: a module such as the target's
        `embed_tokens`, which for a GGUF table dequantizes only the rows asked for); readout: [.., H]
        -> [.., draft_vocab] logits, the rows of the target's LM head the head reads out, in the order
        of `head.vocab_ids`."""
        self.head = head
        self.embed = embed
        self.readout = readout
        self.device = head.vocab_ids.device
        self.vocab_ids = head.vocab_ids
        self.vocab_size = vocab_size
        self.generator = generator
        self.top_k = top_k
        self.max_depth = max_depth
        c = head.config
        self.feature_layers = c.feature_layers
        self._kv_shape = (c.num_kv_heads, c.head_dim)
        self._sides: dict[str, _Side] = {}

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids).float()

    # -- what the target computed ------------------------------------------------------------------
    def features(self, committed: Sequence[tuple[str, int, torch.Tensor]]) -> None:
        """The step's committed states, fused (with `feature_layers`) in one product for all its
        requests (one read of `fuse`'s weights a step, not one a request), then kept per request
        until its next catch-up: a request's own copy, not a view that holds the step's rows."""
        with torch.inference_mode():
            fused = self.head.target_features(torch.cat([h for _, _, h in committed]).detach().float())
        off = 0
        for request_id, start, hidden in committed:  # (torch.cat made `fused` a new tensor)
            n = hidden.shape[0]
            self._pend(request_id, start, fused[off : off + n].clone() if len(committed) > 1 else fused)
            off += n

    def _pend(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        side = self._sides.get(request_id)
        if side is None:
            kvh, d = self._kv_shape
            empty = hidden.new_empty((kvh, 64, d))
            side = self._sides[request_id] = _Side(empty, empty.clone(), first=start)
        if start < side.first:  # recomputed from earlier than the head has seen: start over
            side.first, side.length, side.last_out = start, 0, None
        elif start < side.first + side.length:  # recomputed (preemption): its rows are fed again
            side.length, side.last_out = start - side.first, None
        end = side.pend_end
        if not side.pend or start > end or start < side.pend_start:  # a gap, or recomputed from earlier
            side.pend_start, side.pend = start, [hidden]
        elif start == end:  # the usual case: appended, not copied (a request may not draft for long)
            side.pend.append(hidden)
        else:  # its tail recomputed
            side.pend = [torch.cat(side.pend)[: start - side.pend_start], hidden]

    def finish(self, request_id: str, view: RequestView) -> None:
        self._sides.pop(request_id, None)

    # -- drafting ----------------------------------------------------------------------------------
    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        with torch.inference_mode():
            work = self._catch_up([r for r in requests if r.budget > 0])
            self._grow([w for w in work.values() if w is not None])
        out = []
        for r in requests:
            w = work.get(r.view.request_id) if r.budget > 0 else None
            out.append(EMPTY_TREE if w is None else self._tree(w))
        return out

    def _catch_up(self, requests: list[DraftRequest]) -> dict[str, _Work | None]:
        """Feed each request's unfed features; its head output at the last committed token."""
        work: dict[str, _Work | None] = {}
        feats, tokens, positions, segs = [], [], [], []
        for r in requests:
            rid = r.view.request_id
            side = self._sides.get(rid)
            ids = r.view.token_ids
            last = len(ids) - 2  # the last position with a target feature (the root is len(ids) - 1)
            work[rid] = None
            if side is None or last < 0:
                continue
            pos = side.first + side.length
            if side.pend and side.pend_start > pos:  # features missing in between: restart there
                side.first, side.length, side.last_out, pos = side.pend_start, 0, None, side.pend_start
            if pos <= last and side.pend_end <= last:  # the latest features have not arrived
                continue
            if pos <= last:
                feats.append(torch.cat(side.pend)[pos - side.pend_start : last + 1 - side.pend_start])
                tokens.extend(ids[pos + 1 : last + 2])
                positions.extend(range(pos, last + 1))
                segs.append((rid, side, last + 1 - pos))
            elif side.last_out is None:
                continue
            side.pend = []
            work[rid] = _Work(r, side, side.last_out, self._greedy(r))  # root_out set below when fed
        if segs:
            dev = self.device
            tok = torch.tensor(tokens, device=dev)
            pos_t = torch.tensor(positions, device=dev)

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                outs, off = [], 0
                for _, side, n in segs:
                    kn, vn = k[off : off + n].transpose(0, 1), v[off : off + n].transpose(0, 1)
                    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
                    outs.append(_attend(q[off : off + n], side.k[:, : side.length], side.v[:, : side.length],
                                        kn, vn, causal))
                    side.append(kn, vn)
                    off += n
                return torch.cat(outs)

            out = self.head(torch.cat(feats), self._embed(tok), pos_t, attend)
            off = 0
            for rid, side, n in segs:
                off += n
                side.last_out = out[off - 1]
                w = work[rid]
                assert w is not None
                w.root_out = side.last_out
        return work

    def _greedy(self, r: DraftRequest) -> bool:
        p = r.view.params
        return p.greedy or p.seed is not None

    def _grow(self, work: list[_Work]) -> None:
        """Expand every request's tree depth by depth, one head forward per depth for all of them."""
        # depth 1: the root's children, from the catch-up's last rows
        if not work:
            return
        self._children(work, [(w, -1) for w in work], torch.stack([w.root_out for w in work]))
        for depth in range(2, self.max_depth + 1):
            frontier = [(w, n) for w in work for n in self._frontier(w, depth - 1)]
            if not frontier:
                return
            outs = self._expand(frontier, depth)
            self._children([w for w, _ in frontier], frontier, outs)

    def _frontier(self, w: _Work, depth: int) -> list[int]:
        """The nodes at `depth` worth expanding: all of a chain's; a tree's `top_k` most probable,
        unless `budget` nodes at least as probable as all of them are in hand already."""
        if depth >= w.request.budget:
            return []
        at = [i for i, n in enumerate(w.nodes) if n.depth == depth]
        if not w.greedy or not at:
            return at
        at = sorted(at, key=lambda i: -w.nodes[i].cum)[: self.top_k]
        best = w.nodes[at[0]].cum
        cums = sorted((n.cum for n in w.nodes), reverse=True)
        if len(cums) >= w.request.budget and cums[w.request.budget - 1] >= best:
            return []
        return at

    def _expand(self, frontier: list[tuple[_Work, int]], depth: int) -> torch.Tensor:
        """One head forward over the frontier nodes (each sees its request's committed rows, its
        expanded ancestors and itself); their outputs [F, H]."""
        feats, tokens, positions = [], [], []
        for w, i in frontier:
            node = w.nodes[i]
            parent_out = w.root_out if node.parent < 0 else w.nodes[node.parent].out
            assert parent_out is not None
            feats.append(parent_out)
            tokens.append(node.token)
            positions.append(w.side.first + w.side.length - 1 + depth - 1)
        groups: dict[int, list[int]] = {}
        for row, (w, _) in enumerate(frontier):
            groups.setdefault(id(w), []).append(row)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = torch.empty_like(q)
            for rows in groups.values():
                w = frontier[rows[0]][0]
                for row in rows:  # register the new rows first: a node sees itself
                    node = w.nodes[frontier[row][1]]
                    node.expanded = len(w.hk)
                    w.hk.append(k[row].unsqueeze(1))
                    w.hv.append(v[row].unsqueeze(1))
                    parent = w.anc[w.nodes[node.parent].expanded] if node.parent >= 0 else []
                    w.anc.append(parent + [node.expanded])
                e = len(w.hk)
                mask = torch.zeros(len(rows), e, dtype=torch.bool, device=q.device)
                for j, row in enumerate(rows):
                    mask[j, w.anc[w.nodes[frontier[row][1]].expanded]] = True
                kb, vb = torch.cat(w.hk, dim=1), torch.cat(w.hv, dim=1)
                idx = torch.tensor(rows, device=q.device)
                out[idx] = _attend(q[idx], w.side.k[:, : w.side.length], w.side.v[:, : w.side.length], kb, vb, mask)
            return out

        dev = self.device
        tok = torch.tensor(tokens, device=dev)
        outs = self.head(torch.stack(feats), self._embed(tok), torch.tensor(positions, device=dev), attend)
        for row, (w, i) in enumerate(frontier):
            w.nodes[i].out = outs[row]
        return outs

    def _children(self, owners: list[_Work], parents: list[tuple[_Work, int]], outs: torch.Tensor) -> None:
        """Add children under each (request, parent node) from the head outputs there."""
        logits = self.readout(outs)  # [F, draft_vocab]
        logp = logits.float().log_softmax(dim=-1)
        k = min(self.top_k, logp.shape[-1])
        top_lp, top_i = logp.topk(k, dim=-1)
        for row, (w, parent) in enumerate(parents):
            base = 0.0 if parent < 0 else w.nodes[parent].cum
            depth = 1 if parent < 0 else w.nodes[parent].depth + 1
            if w.greedy:
                for lp, i in zip(top_lp[row].tolist(), top_i[row].tolist()):
                    w.nodes.append(_Node(int(self.vocab_ids[i]), parent, depth, base + lp, math.exp(lp)))
                continue
            probs = self._processed(w, parent, logits[row])
            view, seed = w.request.view, w.request.view.params.seed
            gen = self.generator if seed is None else draft_generator(
                seed, len(view.prompt_token_ids) + len(view.output_token_ids) + depth - 1, parent + 1,
                self.generator.device)
            tok = int(torch.multinomial(probs.to(gen.device), 1, generator=gen).item())
            q = float(probs[tok])
            w.nodes.append(_Node(tok, parent, depth, base + math.log(max(q, 1e-30)), q, probs=probs))

    def _processed(self, w: _Work, parent: int, sub_logits: torch.Tensor) -> torch.Tensor:
        """The head's distribution over the whole vocabulary after the request's own logits
        processing (penalties on the path so far, temperature, filters): what the token is drawn
        from and what verification divides by."""
        full = sub_logits.new_full((self.vocab_size,), float("-inf"))
        full[self.vocab_ids] = sub_logits.float()
        path: list[int] = []
        node = parent
        while node >= 0:
            path.append(w.nodes[node].token)
            node = w.nodes[node].parent
        view = w.request.view
        processed = Sampler.processed_logits(
            full.unsqueeze(0), [view.params], [list(view.prompt_token_ids)],
            [list(view.output_token_ids) + path[::-1]],
        )
        return processed[0].softmax(dim=-1)

    def _tree(self, w: _Work) -> DraftTree:
        budget = w.request.budget
        if not w.nodes:
            return EMPTY_TREE
        if w.greedy:
            keep = sorted(sorted(range(len(w.nodes)), key=lambda i: (-w.nodes[i].cum, i))[:budget])
        else:
            keep = list(range(min(budget, len(w.nodes))))
        new = {old: j for j, old in enumerate(keep)}
        nodes = [w.nodes[i] for i in keep]
        parents = tuple(-1 if n.parent < 0 else new[n.parent] for n in nodes)
        tokens = tuple(n.token for n in nodes)
        if w.greedy:
            return DraftTree(tokens, parents, None, tuple(n.q for n in nodes))
        return DraftTree(tokens, parents, torch.stack([n.probs for n in nodes]))  # type: ignore[misc]
