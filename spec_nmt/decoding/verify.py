"""Verification rules: pure functions on tensors (no models, caches or dictionaries).

Letters follow the design documents: p is the drafter, q the verifier. A rule looks at a block of
k drafted tokens and the verifier's scores for the k+1 positions of
``[pending token, d_1 .. d_k]`` and returns how many drafted tokens are *accepted* and the token the
verifier puts after them: the *correction* token at the first rejection, or the *bonus* token after
a fully accepted block.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from spec_nmt.errors import SpecNmtError


def check_top_beta_params(beta: int, tau: float) -> None:
    """Raise a one-line ValueError for parameters the top-beta/tau rule cannot use."""
    if int(beta) != beta or beta < 1:
        raise SpecNmtError(f"--beta must be an integer >= 1, got {beta}")
    if not tau >= 0:  # also rejects NaN
        raise SpecNmtError(f"--tau must be >= 0, got {tau}")


def before_any_eos(tokens: Tensor, eos: int) -> Tensor:
    """[B, k] bool: whether no EOS comes before each position of ``tokens`` [B, k] (the position
    itself may hold one)."""
    is_eos = tokens.eq(eos)
    return is_eos.cumsum(dim=1) <= is_eos


def accepted_count(passes: Tensor, draft_tokens: Tensor, eos: int) -> Tensor:
    """Accepted drafts per row [B]: the leading run of drafts that pass [B, k], none after an
    accepted EOS (the sentence ends there)."""
    return (passes & before_any_eos(draft_tokens, eos)).long().cumprod(dim=1).sum(dim=1)


def accept_top_beta(
    draft_tokens: Tensor,  # [B, k] long
    verifier_scores: Tensor,  # [B, k+1, V] float: log-probs, or logits
    beta: int,
    tau: float,
    eos: int,
) -> Tuple[Tensor, Tensor]:
    """SpecDec's top-beta/tau rule (Xia et al., 2023).

    Drafted token i is accepted while every token before it was accepted, it is among the
    verifier's ``beta`` best tokens at i, and its log-prob is within ``tau`` of the best one.
    Nothing is accepted after an accepted EOS: the sentence ends there.
    With ``beta=1, tau=0`` a drafted token is accepted only when it is the verifier's own pick,
    so the output is exactly the verifier's greedy decoding.

    The rule compares only tokens of the same position, so logits (log-probs shifted by each
    position's normaliser) give the same decisions without normalising [B, k+1, V].

    Returns ``(n_accepted [B], next_tokens [B])``: ``next_tokens`` is the verifier's best token at
    position ``n_accepted`` (meaningless for rows whose accepted drafts end with EOS).
    """
    batch, k = draft_tokens.shape
    if verifier_scores.shape[:2] != (batch, k + 1):  # a caller's bug, not a user's
        raise ValueError(
            f"verifier_scores must be [B, k+1, V] = [{batch}, {k + 1}, V], "
            f"got {list(verifier_scores.shape)}"
        )
    # The same call picks both the best token and the candidates, so beta=1 accepts a draft
    # exactly when it is the token the rule puts there itself (ties included). For beta=1 that
    # call is max (the first best index, as topk(1)), 2.3x faster than topk over 8k columns.
    if beta == 1:
        best_scores, best_tokens = verifier_scores.max(dim=-1)
        top_logprobs, top_tokens = best_scores.unsqueeze(-1), best_tokens.unsqueeze(-1)
    else:
        top_logprobs, top_tokens = verifier_scores.topk(beta, dim=-1)  # [B, k+1, beta]
    next_candidates = top_tokens[:, :, 0]  # [B, k+1]
    if k == 0:
        return draft_tokens.new_zeros(batch), next_candidates[:, 0]

    block_top_tokens = top_tokens[:, :k]
    in_top_beta = block_top_tokens.eq(draft_tokens.unsqueeze(-1)).any(dim=-1)  # [B, k]
    draft_logprobs = verifier_scores[:, :k].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    within_tau = draft_logprobs >= top_logprobs[:, :k, 0] - tau
    passes = in_top_beta & within_tau

    n_accepted = accepted_count(passes, draft_tokens, eos)
    next_tokens = next_candidates.gather(1, n_accepted.unsqueeze(1)).squeeze(1)
    return n_accepted, next_tokens


def check_sampling_params(temperature: float, topk: int, topp: float) -> None:
    """Raise a one-line error for sampling settings no distribution can be made from."""
    if not temperature > 0:
        raise SpecNmtError(f"--temperature must be > 0, got {temperature}")
    if int(topk) != topk or (topk < 1 and topk != -1):
        raise SpecNmtError(
            f"--sampling-topk must be a positive integer (or -1 for all), got {topk}"
        )
    if topp != -1.0 and not 0 < topp <= 1:
        raise SpecNmtError(f"--sampling-topp must be in (0, 1] (or -1 for all), got {topp}")


def sampling_probs(scores: Tensor, topk: int = -1, topp: float = -1.0) -> Tensor:
    """The distribution fairseq's ``--sampling`` draws from, normalised: [..., V] log-probs or
    logits (temperature already applied) → probs. As in fairseq's ``Sampling`` search, top-p wins
    over top-k, and top-p keeps the smallest set of best tokens whose mass reaches p."""
    probs = torch.softmax(scores.float(), dim=-1)
    if topp > 0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep_sorted = mass_before < topp
        keep_sorted[..., 0] = True
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
    elif topk > 0:
        threshold = probs.topk(min(topk, probs.size(-1)), dim=-1).values[..., -1:]
        probs = probs * (probs >= threshold)
    return probs / probs.sum(dim=-1, keepdim=True)


def residual(verifier_probs: Tensor, draft_probs: Tensor) -> Tensor:
    """norm(max(0, q - p)): where to sample after rejecting a draft taken from p [..., V].

    Where q <= p everywhere (only possible when q == p, when no draft is ever rejected, or from
    float rounding) the residual has no mass; q itself is then returned.
    """
    excess = (verifier_probs - draft_probs).clamp(min=0)
    mass = excess.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, excess / mass.clamp(min=1e-30), verifier_probs)


def sample_from(probs: Tensor, generator: Optional[torch.Generator]) -> Tensor:
    """One token per row of probs [..., V] (rows need not be normalised)."""
    flat = probs.reshape(-1, probs.size(-1))
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def speculative_sample(
    draft_tokens: Tensor,  # [B, k] long, d_i drawn from draft_probs[:, i]
    draft_probs: Tensor,  # [B, k, V] p_i
    verifier_probs: Tensor,  # [B, k+1, V] q_i (q_k gives the bonus token)
    eos: int,
    generator: Optional[torch.Generator] = None,
    uniforms: Optional[Tensor] = None,  # [B, k]; drawn from generator when None
) -> Tuple[Tensor, Tensor]:
    """Speculative sampling (Leviathan et al., 2023; Chen et al., 2023): accept d_i with
    probability min(1, q_i(d_i) / p_i(d_i)) while all earlier drafts were accepted; at the first
    rejection the next token is a *correction* from norm(max(0, q_i - p_i)); after a fully
    accepted block it is a *bonus* token from q_k. The output is distributed exactly as sampling
    from q. Nothing is accepted after an accepted EOS.

    Returns ``(n_accepted [B], next_tokens [B])``.
    """
    batch, k = draft_tokens.shape
    if uniforms is None:
        uniforms = torch.rand(batch, k, generator=generator, device=draft_tokens.device)
    index = draft_tokens.unsqueeze(-1)
    q_of_draft = verifier_probs[:, :k].gather(-1, index).squeeze(-1)
    p_of_draft = draft_probs.gather(-1, index).squeeze(-1)
    # u < q/p, written without a division so that p = 0 (never drawn) cannot produce NaN.
    passes = uniforms * p_of_draft < q_of_draft
    n_accepted = accepted_count(passes, draft_tokens, eos)

    rows = torch.arange(batch, device=draft_tokens.device)
    q_next = verifier_probs[rows, n_accepted]  # [B, V]
    rejected = n_accepted < k
    p_next = torch.zeros_like(q_next)
    p_next[rejected] = draft_probs[rows[rejected], n_accepted[rejected]].to(q_next.dtype)
    next_dist = torch.where(rejected.unsqueeze(1), residual(q_next, p_next), q_next)
    return n_accepted, sample_from(next_dist, generator)
