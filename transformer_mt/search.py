"""Greedy and beam search over `Transformer.encode` / `decode_step`, with the KV cache.

The beam *step* (`beam_step`) is a pure function; `beam_search` is the bookkeeping loop around
it. Finished sentences leave the batch, so the work per step shrinks as sentences end.
Id tensors in, hypotheses out: batching many sentences is inference.py's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .model import Transformer
from .vocab import BOS, EOS, PAD

# asked between decoding steps: True ends the search (Cancelled)
StopCheck = Callable[[], bool] | None


class Cancelled(Exception):
    """A search stopped between two decoding steps because its `should_stop` said so (nobody waits
    for it)."""


def _check_stop(should_stop: StopCheck) -> None:
    if should_stop is not None and should_stop():
        raise Cancelled("the search was stopped between decoding steps")


def max_output_len(
    src_lens: torch.Tensor,
    a: float,
    b: int,
    limit: int,
    prefix_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sentence output budget a*|src| + b tokens (EOS included), capped at `limit`; at least
    room for a target prefix and EOS (|prefix| + 1): a prefix is never cut, and one that fills the
    budget ends right after it."""
    budget = (src_lens.float() * a + b).floor().long()
    if prefix_lens is not None:
        budget = torch.maximum(budget, prefix_lens.to(budget.device) + 1)
    return budget.clamp(1, limit)


Prefixes = list[list[int]] | None  # per source row: target ids each output starts with ([]: none)


def _prefix_tensor(
    prefix: Prefixes, B: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Prefixes as (B, P) ids (PAD-padded) and (B,) lengths; None when no row has one."""
    if prefix is None or not any(prefix):
        return None
    if len(prefix) != B:
        raise ValueError(f"{len(prefix)} prefixes for {B} sources")
    P = max(len(p) for p in prefix)
    ids = torch.full((B, P), PAD, dtype=torch.long)
    for row, p in enumerate(prefix):
        ids[row, : len(p)] = torch.tensor(p, dtype=torch.long)
    return ids.to(device), torch.tensor([len(p) for p in prefix], device=device)


def _force_prefix(scores: torch.Tensor, tok: torch.Tensor, on: torch.Tensor) -> None:
    """Rows `on` (n,) still inside their prefix may only take their prefix token `tok` (n,): every
    other token gets -inf, the prefix token keeps its score."""
    keep = scores.gather(1, tok.unsqueeze(1))  # (n, 1); rows not `on` get theirs back unchanged
    scores.masked_fill_(on.unsqueeze(1), -math.inf)
    scores.scatter_(1, tok.unsqueeze(1), keep)


def _budgets(
    model: Transformer,
    src: torch.Tensor,
    max_len_a: float,
    max_len_b: int,
    pre: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """Each source row's output budget (B,): a*|src| + b, and room for its prefix and EOS."""
    lens = None if pre is None else pre[1]
    return max_output_len((src != PAD).sum(1), max_len_a, max_len_b, model.cfg.max_positions, lens)


def _prefix_step(
    pre: tuple[torch.Tensor, torch.Tensor] | None, rows: torch.Tensor, t: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The prefix token of each of `rows` (original source rows) at step t, and whether the row is
    still inside its prefix; None when no prefix reaches step t."""
    if pre is None or t >= pre[0].size(1):
        return None
    ids, lens = pre
    return ids[rows, t], lens[rows] > t


def length_penalty(length: torch.Tensor | int, alpha: float) -> torch.Tensor | float:
    """GNMT length penalty lp(Y) = ((5 + |Y|) / 6) ** alpha (Wu et al., 2016, Eq. 14)."""
    return ((5.0 + length) / 6.0) ** alpha


def _mask_specials(scores: torch.Tensor) -> torch.Tensor:
    scores[:, PAD] = -math.inf  # never generate padding or a second BOS
    scores[:, BOS] = -math.inf
    return scores


def _force_eos(scores: torch.Tensor, forced: torch.Tensor) -> None:
    """Rows out of length budget may only end: every token but EOS gets -inf (EOS keeps its
    score)."""
    eos = scores[:, EOS].clone()
    scores.masked_fill_(forced.unsqueeze(1), -math.inf)  # no boolean indexing: no host sync
    scores[:, EOS] = torch.where(forced, eos, scores[:, EOS])


@dataclass
class Hypothesis:
    """One output of a search, as token ids: what every search returns, n-best lists included."""

    tokens: list[int]  # without EOS
    logprob: float  # log P(Y | X), EOS included
    score: float  # what ranks hypotheses: logprob / lp(|Y| + 1) for beam search, else the logprob
    token_logprobs: list[float]  # log P of each token given the ones before, then of EOS


@dataclass(frozen=True)
class Sampling:
    """Draw each token from the model's distribution at `temperature`, cut to the `topk` most likely
    tokens (0: all) or the smallest set holding `topp` of the probability (nucleus sampling).
    Temperature 0 is greedy search."""

    topk: int = 0
    topp: float = 1.0
    temperature: float = 1.0
    seed: int | None = None  # None: torch's global generator

    def __post_init__(self) -> None:
        if self.temperature < 0 or self.topk < 0 or not 0 < self.topp <= 1:
            raise ValueError(
                f"sampling needs temperature >= 0, topk >= 0 and 0 < topp <= 1, got {self}"
            )

    def generator(self, device: torch.device) -> torch.Generator | None:
        """A generator seeded with `seed`, to be passed along one whole job (not re-seeded per
        batch)."""
        return None if self.seed is None else torch.Generator(device).manual_seed(self.seed)

    def choose(self, logp: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """logp (n, V) log-probabilities (specials masked) -> (n,) next tokens."""
        if self.temperature == 0:
            return logp.argmax(-1)
        # (n, V); softmax(logp / T) = softmax(logits / T). The best token is 0 before dividing, so a
        # tiny T cannot underflow every score to -inf.
        scores = (logp - logp.max(1, keepdim=True).values) / self.temperature
        if self.topk:
            kth = scores.topk(min(self.topk, scores.size(1)), dim=1).values[:, -1:]  # (n, 1)
            scores = scores.masked_fill(scores < kth, -math.inf)
        if self.topp < 1.0:
            ordered, order = scores.sort(dim=1, descending=True)
            # probability of the better tokens
            before = ordered.softmax(1).cumsum(1) - ordered.softmax(1)
            # the best token always stays
            ordered = ordered.masked_fill(before >= self.topp, -math.inf)
            scores = torch.full_like(scores, -math.inf).scatter(1, order, ordered)
        return torch.multinomial(scores.softmax(1), 1, generator=generator).squeeze(1)


@torch.no_grad()
def greedy_search(
    model: Transformer,
    src: torch.Tensor,
    *,
    max_len_a: float = 1.5,
    max_len_b: int = 10,
    sampling: Sampling | None = None,
    generator: torch.Generator | None = None,
    should_stop: StopCheck = None,
    prefix: Prefixes = None,
) -> list[list[Hypothesis]]:
    """The most likely next token at each step (or one drawn by `sampling`); src (B, S) -> one
    hypothesis per sentence (a list of one, like beam search's n-best lists). Each row's `prefix`
    tokens are forced at the first steps (their log-probabilities counted). `should_stop` is asked
    before every step; True raises Cancelled."""
    B, device = src.size(0), src.device
    memory, src_mask = model.encode(src)
    pre = _prefix_tensor(prefix, B, device)
    max_len = _budgets(model, src, max_len_a, max_len_b, pre)  # (B,)
    T = int(max_len.max())
    out_tok = torch.full((B, T), EOS, dtype=torch.long, device=device)  # filled in on the device,
    out_logp = torch.zeros((B, T), device=device)  # read back once at the end
    alive = torch.arange(B, device=device)  # original row of each row still decoding
    tokens = torch.full((B, 1), BOS, dtype=torch.long, device=device)
    cache = model.new_cache()
    for t in range(T):
        _check_stop(should_stop)
        logits = model.decode_step(tokens, memory, src_mask, cache).float()  # (n, V)
        log_z = logits.logsumexp(-1)  # (n,): log-probability = logit - log_z
        # out of budget: this token must be EOS
        _force_eos(_mask_specials(logits), max_len[alive] <= t + 1)
        forced = _prefix_step(pre, alive, t)
        if forced is not None:
            _force_prefix(logits, *forced)
        next_tok = (
            logits.argmax(-1)
            if sampling is None
            else sampling.choose(logits - log_z[:, None], generator)
        )
        out_tok[alive, t] = next_tok
        out_logp[alive, t] = logits.gather(1, next_tok.unsqueeze(1)).squeeze(1) - log_z
        keep = (next_tok != EOS).nonzero().squeeze(1)  # the one host sync of the step
        if len(keep) == 0:
            break
        if len(keep) < len(alive):  # drop finished sentences from the batch
            alive, memory, src_mask = alive[keep], memory[keep], src_mask[keep]
            cache.reorder(keep)
        tokens = next_tok[keep].unsqueeze(1)
    # tokens up to and including the first EOS
    lengths = ((out_tok != EOS).cumprod(1).sum(1) + 1).tolist()
    out = []
    for toks, logps, n in zip(out_tok.tolist(), out_logp.tolist(), lengths):
        lp = logps[:n]
        out.append([Hypothesis(toks[: n - 1], sum(lp), sum(lp), lp)])
    return out


def topk_rows(x: torch.Tensor, k: int, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row of x (R, V) and their columns, best first, like x.topk(k).

    Exact, and faster than torch.topk on CPU for k << V (BENCHMARKS.md): the maxima of blocks of
    `block` columns (a vectorised reduction) pick the k best blocks, and only those are searched. A
    value among the k best lies in a block whose maximum is among the k best maxima.
    """
    R, V = x.shape
    n_blocks = V // block
    if n_blocks < 2 * k:
        return x.topk(k, dim=1)
    main = x[:, : n_blocks * block].unflatten(1, (n_blocks, block))  # (R, n_blocks, block), a view
    best_blocks = main.amax(2).topk(k, dim=1).indices  # (R, k)
    # (R, k*block)
    cols = (best_blocks.unsqueeze(2) * block + torch.arange(block, device=x.device)).flatten(1)
    # columns past the last block
    tail = torch.arange(n_blocks * block, V, device=x.device).expand(R, -1)
    cols = torch.cat([cols, tail], dim=1)
    values, pick = x.gather(1, cols).topk(k, dim=1)  # (R, k)
    return values, cols.gather(1, pick)


def beam_step(
    cum_scores: torch.Tensor, cand_logp: torch.Tensor, cand_tok: torch.Tensor, n_cand: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One beam-search step (pure): the best `n_cand` extensions of the live hypotheses.

    cum_scores (N, K) log-probabilities of the live hypotheses; cand_logp (N, K, C)
    log-probabilities of each hypothesis's C best next tokens, cand_tok (N, K, C) their ids. With C
    >= n_cand this is exact: a token outside its own row's best C cannot be among the best n_cand of
    the sentence. Returns the score, source beam, token and the token's own log-probability of each
    candidate, each (N, n_cand), best first. Taking 2K candidates means hypotheses ending in EOS
    never leave fewer than K to continue (fairseq's trick).
    """
    N, K, C = cand_logp.shape
    scores = (cum_scores.unsqueeze(-1) + cand_logp).view(N, K * C)  # (N, K*C)
    top, idx = scores.topk(min(n_cand, K * C), dim=1)
    return (
        top,
        idx // C,
        cand_tok.view(N, K * C).gather(1, idx),
        cand_logp.view(N, K * C).gather(1, idx),
    )


def _keep_finished(
    final: torch.Tensor,
    top: torch.Tensor,
    src_beam: torch.Tensor,
    tok_logp: torch.Tensor,
    seqs: torch.Tensor,
    seq_logp: torch.Tensor,
    alive: torch.Tensor,
    lp: float,
    finished: list[list[Hypothesis]],
) -> None:
    """Add the candidates marked in `final` (N, K) to their sentences' finished hypotheses, scored
    log P / lp. Their tokens come to the host in one transfer, not one per hypothesis."""
    K = final.size(1)
    n, c = final.nonzero().unbind(1)  # (F,) group and candidate of each finished hypothesis
    rows = n * K + src_beam[n, c]
    # (F, t + 1): + EOS
    logps = torch.cat([seq_logp[rows], tok_logp[n, c].unsqueeze(1)], dim=1).tolist()
    for sent, s, hyp, lps in zip(alive[n].tolist(), top[n, c].tolist(), seqs[rows].tolist(), logps):
        finished[sent].append(Hypothesis(hyp, s, s / lp, lps))


def _candidates(
    logits: torch.Tensor,
    cum: torch.Tensor,
    forced: torch.Tensor,
    in_prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 2K best extensions of each sentence's K live hypotheses (beam_step's four (N, 2K)
    tensors), from the step's logits (N*K, V); `forced` rows (N*K,) may only end; rows inside a
    prefix (`in_prefix`: token and flag per row) may only take its token."""
    N, K = cum.shape
    logp = _mask_specials(F.log_softmax(logits, dim=-1, dtype=torch.float32))  # (N*K, V)
    if forced.any():
        _force_eos(logp, forced)
    if in_prefix is not None:
        _force_prefix(logp, *in_prefix)
    # Each hypothesis's 2K best tokens are enough to find the sentence's 2K best extensions.
    cand_logp, cand_tok = topk_rows(logp, min(2 * K, logp.size(1)))  # (N*K, 2K)
    return beam_step(cum, cand_logp.view(N, K, -1), cand_tok.view(N, K, -1), 2 * K)


def _first_beams(
    B: int, K: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Before the first step: K hypotheses per sentence, of which only the first is real (the
    others score -inf); no tokens yet, BOS to read."""
    cum = torch.full((B, K), -math.inf, device=device)
    cum[:, 0] = 0.0
    seqs = torch.full((B * K, 0), BOS, dtype=torch.long, device=device)  # tokens so far, and
    seq_logp = torch.zeros((B * K, 0), device=device)  # their log-probabilities
    return cum, seqs, seq_logp, torch.full((B * K, 1), BOS, dtype=torch.long, device=device)


def _continuing(
    top: torch.Tensor,
    src_beam: torch.Tensor,
    tok: torch.Tensor,
    tok_logp: torch.Tensor,
    is_eos: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best K candidates (of 2K, each (N, 2K)) not ending in EOS: their scores (N, K), the
    rows they extend (N*K,), their tokens and those tokens' log-probabilities (N*K, 1)."""
    N, K = src_beam.size(0), top.size(1) // 2  # beam_step returned 2K candidates
    scores, pick = top.masked_fill(is_eos, -math.inf).topk(K, dim=1)  # (N, K)
    rows = torch.arange(N, device=top.device).unsqueeze(1) * K + src_beam.gather(1, pick)
    return (
        scores,
        rows.view(-1),
        tok.gather(1, pick).view(-1, 1),
        tok_logp.gather(1, pick).view(-1, 1),
    )


def _nothing() -> Hypothesis:
    """What a sentence gets when no hypothesis finished (a model that gives EOS no chance)."""
    return Hypothesis([], -math.inf, -math.inf, [])


@torch.no_grad()
def beam_search(
    model: Transformer,
    src: torch.Tensor,
    *,
    beam: int = 4,
    alpha: float = 0.6,
    max_len_a: float = 1.5,
    max_len_b: int = 10,
    nbest: int = 1,
    should_stop: StopCheck = None,
    prefix: Prefixes = None,
) -> list[list[Hypothesis]]:
    """Batched beam search; the `nbest` best finished hypotheses of each row, best first, scored
    log P(Y|X) / lp(Y) (GNMT, |Y| counting EOS); a sentence ends with `beam` finished hypotheses or
    at its budget. A row's `prefix` is forced first (the beam opens after it); `should_stop` is
    asked before every step (True raises Cancelled)."""
    B, K, device = src.size(0), beam, src.device
    memory, src_mask = model.encode(src)
    pre = _prefix_tensor(prefix, B, device)
    max_len = _budgets(model, src, max_len_a, max_len_b, pre)  # (B,)
    expand = torch.arange(B, device=device).repeat_interleave(K)  # a sentence's K rows, adjacent
    memory, src_mask = memory[expand], src_mask[expand]  # (B*K, S, d), (B*K, 1, 1, S)
    alive = torch.arange(B, device=device)  # original sentence of each live group
    cum, seqs, seq_logp, tokens = _first_beams(B, K, device)
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    n_finished = torch.zeros(B, dtype=torch.long, device=device)  # len(finished[b]), on device
    cache = model.new_cache()
    for t in range(int(max_len.max())):
        _check_stop(should_stop)
        N = len(alive)
        logits = model.decode_step(tokens, memory, src_mask, cache)  # (N*K, V)
        forced = (max_len[alive] <= t + 1).repeat_interleave(K)  # out of budget: end with EOS
        in_prefix = _prefix_step(pre, alive.repeat_interleave(K), t)
        top, src_beam, tok, tok_logp = _candidates(logits, cum, forced, in_prefix)  # (N, 2K) each
        # Candidates ending in EOS among the best K become finished hypotheses.
        is_eos = tok == EOS  # (N, 2K)
        final = is_eos[:, :K] & torch.isfinite(top[:, :K])
        if final.any():
            lp = length_penalty(t + 1, alpha)
            _keep_finished(final, top, src_beam, tok_logp, seqs, seq_logp, alive, lp, finished)
            n_finished[alive] += final.sum(1)
        # The best K candidates not ending in EOS continue.
        cum, rows, next_tok, next_logp = _continuing(top, src_beam, tok, tok_logp, is_eos)
        seqs = torch.cat([seqs[rows], next_tok], dim=1)
        seq_logp = torch.cat([seq_logp[rows], next_logp], dim=1)
        # A sentence is done with K finished hypotheses, at its budget, or with no live hypothesis.
        done = (n_finished[alive] >= K) | (max_len[alive] <= t + 1) | ~torch.isfinite(cum[:, 0])
        if done.all():
            break
        keep = (~done).nonzero().squeeze(1)  # (N',) live groups
        keep_rows = (keep.unsqueeze(1) * K + torch.arange(K, device=device)).view(-1)
        rows = rows[keep_rows]
        # hypotheses move within their sentence's K rows: the source side stays
        cache.reorder_self(rows)
        if len(keep) < N:  # drop finished sentences from the batch
            memory, src_mask = memory[keep_rows], src_mask[keep_rows]
            cache.reorder_cross(keep_rows)
        alive, cum, tokens = alive[keep], cum[keep], next_tok[keep_rows]
        seqs, seq_logp = seqs[keep_rows], seq_logp[keep_rows]
    return [sorted(hyps, key=lambda h: -h.score)[:nbest] or [_nothing()] for hyps in finished]


def search(
    model: Transformer,
    src: torch.Tensor,
    *,
    beam: int,
    alpha: float,
    max_len_a: float,
    max_len_b: int,
    nbest: int = 1,
    sampling: Sampling | None = None,
    generator: torch.Generator | None = None,
    should_stop: StopCheck = None,
    prefix: Prefixes = None,
) -> list[list[Hypothesis]]:
    """Greedy search for beam 1 (or sampling, when given), else beam search: src (B, S) -> the
    n-best hypotheses of each row, each starting with its row's `prefix` ids (if any)."""
    if beam == 1 or sampling is not None:
        return greedy_search(
            model,
            src,
            max_len_a=max_len_a,
            max_len_b=max_len_b,
            sampling=sampling,
            generator=generator,
            should_stop=should_stop,
            prefix=prefix,
        )
    return beam_search(
        model,
        src,
        beam=beam,
        alpha=alpha,
        max_len_a=max_len_a,
        max_len_b=max_len_b,
        nbest=nbest,
        should_stop=should_stop,
        prefix=prefix,
    )


@torch.no_grad()
def forced_logprobs(
    model: Transformer, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor
) -> torch.Tensor:
    """Forced decoding: log P of each reference token given the source and the tokens before it
    (B, T), 0 at padding. The same log-softmax that search ranks with, so the two agree."""
    logp = F.log_softmax(model(src, tgt_in), dim=-1, dtype=torch.float32)  # (B, T, V)
    return logp.gather(2, tgt_out.unsqueeze(2)).squeeze(2).masked_fill(tgt_out == PAD, 0.0)
