"""Batched logits processing and sampling.

All rows are processed together: penalties, temperature, top-k, top-p and
min-p are tensor operations over [batch, vocab]. Sampling uses the
exponential race (argmax of p / E with E ~ Exp(1)), which draws exactly from
p. A seeded request's noise for output position j is a function of (seed, j) alone
(`position_noise`), so its tokens depend neither on what else is in the batch nor on what
drafts it was granted: verification accepts a draft token exactly when it is the token this
noise picks (see the verifier).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from specserve.model import cpu_ops
from specserve.outputs import TokenLogprob
from specserve.sampling_params import SamplingParams
from specserve.structured import TokenGrammar, allow_all, apply_bitmask


class SamplingRow(Protocol):
    """What drawing a request's next token reads of it."""

    @property
    def request_id(self) -> str: ...
    @property
    def params(self) -> SamplingParams: ...
    @property
    def prompt_token_ids(self) -> "list[int] | tuple[int, ...]": ...
    @property
    def output_token_ids(self) -> "list[int] | tuple[int, ...]": ...
    @property
    def grammar(self) -> TokenGrammar | None: ...  # where the request is in its structured-output grammar


_MASK64 = (1 << 64) - 1


def _mix(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): independent-looking generator seeds for nearby pairs."""
    z = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


# Mixed into a request's seed for its drafters' draws, so that they are independent of the target's noise.
_DRAFT_SALT = 0x5EED_D4AF_7EA5


def draft_generator(seed: int, position: int, stream: int, device: torch.device) -> torch.Generator:
    """The generator a drafter draws the token at `position` of a request seeded with `seed` from
    (`stream`: which of several draws at that position, e.g. a tree node's parent): derived from
    the seed as the target's noise is (the request's one seed form), independent of it, and the
    same whatever else is in the batch or how the request was scheduled."""
    gen = torch.Generator(device=device)
    gen.manual_seed(_mix(_mix(seed ^ _DRAFT_SALT, stream), position))
    return gen


def position_noise(seed: int, position: int, vocab: int, device: torch.device) -> torch.Tensor:
    """Exp(1) noise over the vocabulary for output position `position` of a request seeded with
    `seed`: the same tensor every time it is asked for, whoever asks."""
    gen = torch.Generator(device=device)
    gen.manual_seed(_mix(seed, position))
    return torch.empty(vocab, device=device).exponential_(generator=gen)


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    errors: list[str | None]  # per row: why no token could be drawn (the row's token id is then meaningless)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value, the first where several tie (NaN counts as largest),
    as torch.argmax. Every greedy choice and every exponential race goes through here, so plain
    decoding, verification and seeded draws pick alike. On the CPU numpy's vectorized argmax: ATen's
    keeps an index per element and took 190 us for 8 rows of a 49k vocabulary, a twelfth of a small
    model's batch-8 step (numpy: 25 us). Float32 rows: the native pass (`_native_argmax`)."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and not x.requires_grad:
        if _native_argmax(x):
            return cpu_ops.row_argmax(x)[0]
        return torch.from_numpy(np.argmax(x.numpy(), axis=-1))
    return x.argmax(dim=-1)


def _native_argmax(x: torch.Tensor) -> bool:
    """Whether `cpu_ops.row_argmax` takes x: float32 rows of at least one column on the CPU. One native
    call, its columns split among the threads, in place of numpy's calls: right after a forward each
    of those on the fresh logits took 8-33 us (greedy_choice's five, 212 us of a batch-4 step on the
    bundled model against 95; BENCHMARKS.md, session 32)."""
    return cpu_ops.fits(x) and x.dim() == 2 and x.shape[1] > 0 and not x.requires_grad


def row_topk_ids(x: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's `k` largest values' indices, largest first (as torch.topk's). On the CPU one
    native pass a row (`cpu_ops.row_topk`): right after a forward, when the caches hold weights
    rather than the interpreter's working set, the dozen small operators of `chunked_topk_ids` took
    184 us for 8 rows of 49k against the native pass's 93 (54 and 30 in a loop; BENCHMARKS.md,
    `benchmarks/after_forward.py`)."""
    if cpu_ops.fits(x) and not x.requires_grad and 1 <= k <= min(x.shape[1], cpu_ops.ROW_TOPK_MAX):
        return cpu_ops.row_topk(x, k)
    return chunked_topk_ids(x, k)


def chunked_topk_ids(x: torch.Tensor, k: int, chunk: int = 64) -> torch.Tensor:
    """`row_topk_ids` in torch operators, in two stages: the k chunks of `chunk` columns with the
    largest maxima hold the k largest values (a chunk holding one of them has a maximum at least
    that value, and fewer than k chunks have a larger one), then a top-k over those k * chunk
    candidates (79 us against topk's 257 for 8 rows of 49k, in a loop); whole rows where the shape
    does not split, or off the CPU."""
    rows, vocab = x.shape
    if x.device.type != "cpu" or vocab % chunk or k * chunk * 4 > vocab:
        return x.topk(min(k, vocab), dim=-1).indices
    blocks = x.reshape(rows, vocab // chunk, chunk)
    best = blocks.amax(dim=-1).topk(k, dim=-1).indices  # [rows, k] chunk numbers
    cand = blocks.gather(1, best[:, :, None].expand(rows, k, chunk)).reshape(rows, k * chunk)
    j = cand.topk(k, dim=-1).indices
    return best.gather(1, j // chunk) * chunk + j % chunk


def row_errors(processed: torch.Tensor, params: list[SamplingParams]) -> list[str | None]:
    """Per row of processed logits: None when tokens can be drawn from it, else what went wrong.

    A row is broken when it holds NaN or +inf, or masks every token: it has no distribution to
    draw from. One batched check and one host sync for the whole batch; the message names the
    request's own sampling parameters, since those are what a request can change.
    """
    # The row maximum is NaN if any entry is, +inf if one is, -inf if all are: one pass decides.
    bad = ~torch.isfinite(processed.amax(dim=-1))
    if not bool(bad.any()):
        return [None] * len(params)
    return [
        _describe_failure(p) if b else None for b, p in zip(bad.tolist(), params)
    ]


def greedy_choice(x: torch.Tensor, params: list[SamplingParams]) -> tuple[list[int], list[str | None]]:
    """Each row's `row_argmax` and its `row_errors`, in one pass on the CPU: the value at a row's
    argmax is NaN if the row holds one (NaN counts as largest), +inf if it holds one and -inf if every
    entry is, so it alone says whether the row is broken. Torch's max, isfinite and any before the
    argmax made a plain batch-8 step's verify 496 us against 313-331 us with this one pass (the first
    touch of the fresh logits is the costly one; BENCHMARKS.md, `benchmarks/step_phases.py`). A broken
    row's token is meaningless, as in `Sampler`'s output."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or x.requires_grad:
        return row_argmax(x).tolist(), row_errors(x, params)
    if _native_argmax(x):
        picks, finite = cpu_ops.row_argmax(x).tolist()
        if all(finite):
            return picks, [None] * len(params)
        return picks, [None if f else _describe_failure(p) for f, p in zip(finite, params)]
    a = x.numpy()
    picks = np.argmax(a, axis=-1)
    bad = ~np.isfinite(a[np.arange(a.shape[0]), picks])
    errors: list[str | None] = [None] * len(params)
    if bad.any():
        errors = [_describe_failure(p) if b else None for b, p in zip(bad.tolist(), params)]
    return picks.tolist(), errors


def argmax_only(row: SamplingRow) -> bool:
    """Whether the row's next token is its raw logits' argmax, whatever else is drawn: greedy, with
    no logit bias, penalty, grammar or logprobs (what `Sampler` and the verifier would compute for
    it is the argmax of the logits as they are, and an error where that value is not finite)."""
    p = row.params
    return p.greedy and not p.logit_bias and not p.needs_penalties and p.logprobs is None and row.grammar is None


def _describe_failure(p: SamplingParams) -> str:
    shown = ", ".join(
        f"{name}={getattr(p, name)!r}"
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                     "presence_penalty")
    )
    return f"sampling failed: the next-token probabilities are not finite numbers (with {shown})"


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    params: list[SamplingParams],
) -> torch.Tensor:
    """Repetition (prompt + output), frequency and presence (output only) penalties, in place."""
    b, vocab = logits.shape
    dev = logits.device
    rep = torch.tensor([p.repetition_penalty for p in params], device=dev, dtype=logits.dtype)
    freq = torch.tensor([p.frequency_penalty for p in params], device=dev, dtype=logits.dtype)
    pres = torch.tensor([p.presence_penalty for p in params], device=dev, dtype=logits.dtype)
    out_counts = _bincount_rows(output_ids, vocab, dev)
    seen = out_counts > 0
    if bool((rep != 1.0).any()):
        seen_all = seen | (_bincount_rows(prompt_ids, vocab, dev) > 0)
        factor = torch.where(logits > 0, 1.0 / rep[:, None], rep[:, None])
        logits = torch.where(seen_all, logits * factor, logits)
    logits = logits - freq[:, None] * out_counts - pres[:, None] * seen.to(logits.dtype)
    # An extreme penalty may push a logit past the float range: keep it the largest finite value.
    big = torch.finfo(logits.dtype).max
    return logits.clamp(-big, big)


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row's logit_bias added to its logits (a new tensor; rows without one unchanged)."""
    rows = [r for r, p in enumerate(params) for _ in p.logit_bias]
    ids = [t for p in params for t, _ in p.logit_bias]
    values = [v for p in params for _, v in p.logit_bias]
    dev = logits.device
    return logits.index_put((torch.tensor(rows, device=dev), torch.tensor(ids, device=dev)),
                            torch.tensor(values, device=dev, dtype=logits.dtype), accumulate=True)


def _bincount_rows(rows: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    counts = torch.zeros(len(rows), vocab, device=device)
    lengths = [len(r) for r in rows]
    if sum(lengths) == 0:
        return counts
    flat = torch.tensor([t for r in rows for t in r], dtype=torch.long, device=device)
    row_idx = torch.repeat_interleave(torch.arange(len(rows), device=device), torch.tensor(lengths, device=device))
    counts.index_put_((row_idx, flat), torch.ones_like(flat, dtype=counts.dtype), accumulate=True)
    return counts


def apply_filters(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature-scaled logits with top-k, top-p and min-p applied (masked entries -inf)."""
    dev = logits.device
    vocab = logits.shape[1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=logits.dtype)
    min_p = torch.tensor([p.min_p for p in params], device=dev, dtype=logits.dtype)
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=dev)[None, :]
        remove = ranks >= top_k[:, None]
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked before it already cover top_p; the first always stays.
        # Only rows that ask: for top_p = 1 rounding in the cumulative sum would cut the tail.
        remove |= ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p < 1.0)[:, None]
        remove[:, 0] = False
        logits = logits.masked_fill(torch.zeros_like(remove).scatter_(1, order, remove), float("-inf"))
    if any(p.min_p > 0 for p in params):
        probs = logits.softmax(dim=-1)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    @staticmethod
    def processed_logits(
        logits: torch.Tensor,
        params: list[SamplingParams],
        prompts: list[list[int]],
        outputs: list[list[int]],
    ) -> torch.Tensor:
        """Logits after logit bias, penalties (given each row's prompt and output so far),
        temperature and filters: what tokens are drawn from. Greedy rows are left unscaled."""
        if any(p.logit_bias for p in params):
            logits = apply_logit_bias(logits, params)
        if any(p.needs_penalties for p in params):
            logits = apply_penalties(logits, prompts, outputs, params)
        if not all(p.greedy or p.temperature == 1.0 for p in params):
            # Shift each row's maximum to 0 before dividing: the distribution is the same, and no
            # temperature, however small, can overflow it (the top token stays 0, the rest go to -inf).
            temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=logits.device)
            logits = (logits - logits.amax(dim=-1, keepdim=True)) / temps[:, None]
        if any(p.needs_filters and not p.greedy for p in params):
            logits = apply_filters(logits, params)
        return logits

    def __call__(self, logits: torch.Tensor, seqs: list[SamplingRow]) -> SamplerOutput:
        if not seqs:
            return SamplerOutput([], [], [])
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1) if any(s.params.logprobs is not None for s in seqs) else None
        )
        params = [s.params for s in seqs]
        logits = constrain(logits, seqs)
        processed = self.processed_logits(
            logits, params, [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs]
        )
        if all(p.greedy for p in params):
            token_list, errors = greedy_choice(processed, params)
        else:
            errors = row_errors(processed, params)
            if any(errors):  # draw the other rows from a harmless stand-in; the broken ones fail
                ok = torch.tensor([e is None for e in errors], device=processed.device)
                processed = torch.where(ok[:, None], processed, torch.zeros_like(processed))
            greedy = torch.tensor([s.params.greedy for s in seqs], device=logits.device)
            probs = processed.softmax(dim=-1)
            noise = self._exponential_noise(seqs, probs.shape[1])
            sampled = row_argmax(probs / noise)
            token_list = torch.where(greedy, row_argmax(processed), sampled).tolist()
        if raw_logprobs is not None and any(errors):
            raw_logprobs = torch.nan_to_num(raw_logprobs)
        return SamplerOutput(token_list, self._logprobs(raw_logprobs, token_list, seqs), errors)

    def _exponential_noise(self, seqs: list[SamplingRow], vocab: int) -> torch.Tensor:
        noise = torch.empty(len(seqs), vocab, device=self.device)
        noise.exponential_(generator=self.generator)
        for row, seq in enumerate(seqs):
            seed = seq.params.seed
            if seed is not None and not seq.params.greedy:
                noise[row] = position_noise(seed, len(seq.output_token_ids), vocab, self.device)
        return noise

    @staticmethod
    def _logprobs(
        raw: torch.Tensor | None, tokens: list[int], seqs: list[SamplingRow]
    ) -> list[TokenLogprob | None]:
        if raw is None:
            return [None] * len(seqs)
        return token_logprobs(raw, tokens, [s.params.logprobs for s in seqs])


def constrain(logits: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
    """Each row's logits with the tokens its request's grammar forbids next set to -inf (the rows
    of requests without one as they are)."""
    grammars = [s.grammar for s in seqs if s.grammar is not None]
    if not grammars:
        return logits
    bitmask = allow_all(len(seqs), max(g.mask_size for g in grammars))
    for row, s in enumerate(seqs):
        if s.grammar is not None:
            s.grammar.fill(bitmask, row)
    return apply_bitmask(logits, bitmask)


def token_logprobs(raw: torch.Tensor, tokens: list[int], top_n: list[int | None]) -> list[TokenLogprob | None]:
    """For each row of raw log-probabilities: the chosen token's logprob and the top-n alternatives
    (None for rows that did not ask)."""
    k = max((n or 0) for n in top_n)
    top_vals, top_ids = raw.topk(k, dim=-1) if k > 0 else (raw[:, :0], raw[:, :0].long())
    chosen_t = raw.gather(1, torch.tensor(tokens, device=raw.device)[:, None])
    ranks = ((raw > chosen_t).sum(dim=-1) + 1).tolist()
    chosen = chosen_t[:, 0].tolist()
    top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
    out: list[TokenLogprob | None] = []
    for row, n in enumerate(top_n):
        if n is None:
            out.append(None)
        else:
            top = tuple(zip(top_ids_l[row][:n], top_vals_l[row][:n]))
            out.append(TokenLogprob(tokens[row], chosen[row], top, ranks[row]))
    return out
