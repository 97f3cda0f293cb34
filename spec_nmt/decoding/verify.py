"""Verification rules: pure functions on tensors (no models, caches or dictionaries).

Letters follow the design documents: p is the drafter, q the verifier. A rule looks at a block of
k drafted tokens and the verifier's scores for the k+1 positions of
``[pending token, d_1 .. d_k]`` and returns how many drafted tokens are *accepted* and the token the
verifier puts after them: the *correction* token at the first rejection, or the *bonus* token after
a fully accepted block.
"""

from typing import Tuple

import torch
from torch import Tensor

from spec_nmt.errors import SpecNmtError


def check_top_beta_params(beta: int, tau: float) -> None:
    """Raise a one-line ValueError for parameters the top-beta/tau rule cannot use."""
    if int(beta) != beta or beta < 1:
        raise SpecNmtError(f"--beta must be an integer >= 1, got {beta}")
    if not tau >= 0:  # also rejects NaN
        raise SpecNmtError(f"--tau must be >= 0, got {tau}")


def accept_top_beta(
    draft_tokens: Tensor,  # [B, k] long
    verifier_logprobs: Tensor,  # [B, k+1, V] float
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

    Returns ``(n_accepted [B], next_tokens [B])``: ``next_tokens`` is the verifier's best token at
    position ``n_accepted`` (meaningless for rows whose accepted drafts end with EOS).
    """
    batch, k = draft_tokens.shape
    if verifier_logprobs.shape[:2] != (batch, k + 1):  # a caller's bug, not a user's
        raise ValueError(
            f"verifier_logprobs must be [B, k+1, V] = [{batch}, {k + 1}, V], "
            f"got {list(verifier_logprobs.shape)}"
        )
    # The same top-k call picks both the best token and the candidates, so beta=1 accepts a
    # draft exactly when it is the token greedy decoding would choose (ties included).
    top_logprobs, top_tokens = verifier_logprobs.topk(beta, dim=-1)  # [B, k+1, beta]
    next_candidates = top_tokens[:, :, 0]  # [B, k+1]
    if k == 0:
        return draft_tokens.new_zeros(batch), next_candidates[:, 0]

    block_top_tokens = top_tokens[:, :k]
    in_top_beta = block_top_tokens.eq(draft_tokens.unsqueeze(-1)).any(dim=-1)  # [B, k]
    draft_logprobs = verifier_logprobs[:, :k].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    within_tau = draft_logprobs >= top_logprobs[:, :k, 0] - tau
    passes = in_top_beta & within_tau

    # A draft after an EOS is never accepted: shift the EOS indicator one position right.
    eos_before = torch.zeros_like(passes)
    eos_before[:, 1:] = draft_tokens[:, :-1].eq(eos).cumsum(dim=1).gt(0)
    passes &= ~eos_before

    n_accepted = passes.long().cumprod(dim=1).sum(dim=1)
    next_tokens = next_candidates.gather(1, n_accepted.unsqueeze(1)).squeeze(1)
    return n_accepted, next_tokens
