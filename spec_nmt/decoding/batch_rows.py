"""A batch's per-row output and its one commit, for both loops (``Rows``: the dynamic loop's
``BatchRows``, the static loop's ``static_decoder.Batch``), and what the dynamic loop (loop.py)
carries beside it from iteration to iteration (``BatchDecoding``).
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from spec_nmt.decoding.drafter import Drafter
from spec_nmt.settings import DraftPlan


@dataclass
class Rows:
    """Each row's verified output and counts; ``commit`` changes them in place (the static
    loop's captured graph reads and writes the same tensors every replay)."""

    tokens: Tensor  # [B, T] BOS, then the verified output; room for one block past the limit
    scores: Tensor  # [B, T - 1] each output token's log-prob under the verifier
    lengths: Tensor  # [B] verified output tokens; tokens[b, lengths[b]] is the pending token
    max_lens: Tensor  # [B] each sentence's output limit
    live: Tensor  # [B] bool: not finished
    iterations: Tensor  # [B] per row, while it was live
    accepted: Tensor  # [B]
    drafted: Tensor  # [B] drafts proposed while live: none at an empty slot or past an EOS

    def commit(self, drafts: Tensor, n_accepted: Tensor, next_tokens: Tensor, logits: Tensor,
               normalizer: Tensor, n_drafted: Tensor, eos: int,
               kept: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """Append to each live row its accepted ``drafts`` [B, k] (along the accepted path, the
        first ``n_accepted``) and ``next_tokens``, scored by the block's constrained ``logits``
        [B, W, V] and log-normaliser [B, W] at the entries ``kept`` [B, k + 1] (a tree's root
        and path; None: a chain's first k + 1); count the iteration and ``n_drafted``. A
        finished row writes past its end, where nothing is read. Returns the tokens emitted
        [B, k + 1], how many count (0 for a finished row) and the rows this commit finished."""
        emitted, n_emitted, ended = emitted_tokens(drafts, n_accepted, next_tokens, eos)
        if kept is None:
            scores = logits.gather(2, emitted.unsqueeze(2)).squeeze(2) - normalizer
        else:
            row = torch.arange(kept.size(0), device=kept.device).unsqueeze(1)
            scores = logits[row, kept, emitted] - normalizer.gather(1, kept)
        # entry i put emitted[i] at output step lengths + i (token slot lengths + 1 + i)
        steps = self.lengths.unsqueeze(1) + torch.arange(emitted.size(1), device=emitted.device)
        self.tokens.scatter_(1, steps + 1, emitted)
        self.scores.scatter_(1, steps, scores)
        live = self.live.long()
        n_emitted = n_emitted * live
        self.lengths.add_(n_emitted)
        self.iterations.add_(live)
        self.accepted.add_(n_accepted * live)
        self.drafted.add_(n_drafted * live)
        ended = ended & self.live
        self.live.logical_and_(~ended)
        return emitted, n_emitted, ended


@dataclass
class BatchRows(Rows):
    """The dynamic loop's rows, one per state row; ``sentences`` holds each state row's
    sentence in the batch (finished rows leave: ``select``)."""

    sentences: List[int]

    @classmethod
    def start(cls, tokens: Tensor, scores: Tensor, max_lens: Tensor) -> "BatchRows":
        lengths = tokens.new_zeros(tokens.size(0))
        return cls(tokens, scores, lengths, max_lens, torch.ones_like(lengths, dtype=torch.bool),
                   torch.zeros_like(lengths), torch.zeros_like(lengths), torch.zeros_like(lengths),
                   list(range(tokens.size(0))))  # fmt: skip

    def select(self, keep: Tensor) -> None:
        """Keep only rows ``keep``, in place."""
        for name in ("tokens", "scores", "max_lens", "lengths", "iterations", "accepted",
                     "drafted", "live"):  # fmt: skip
            setattr(self, name, getattr(self, name)[keep])
        self.sentences = [self.sentences[i] for i in keep.tolist()]


@dataclass
class BatchDecoding:
    """What decoding one batch carries from iteration to iteration."""

    drafter: Drafter
    plan: DraftPlan
    finalized: List[List[Dict]]
    verifier_state: object
    drafter_state: object
    position_limit: int  # the drafter's last position
    rows: BatchRows
    finished: int = 0  # rows finished since the states were last compacted
    # an upper bound of the longest live prefix: the position limit is checked on the device
    # only when it could be near
    longest: int = 0


def emitted_tokens(drafts: Tensor, n_accepted: Tensor, next_tokens: Tensor, eos: int):
    """What an iteration appends to each row, given the drafts along the accepted path [B, k]
    (the first n_accepted count): tokens [B, k+1] (the accepted drafts, then the
    correction/bonus token unless an accepted EOS ended the sentence), how many of them count
    [B], and whether the row is finished [B]."""
    k = drafts.size(1)
    emitted = torch.cat([drafts, drafts.new_zeros(drafts.size(0), 1)], dim=1)
    emitted.scatter_(1, n_accepted.unsqueeze(1), next_tokens.unsqueeze(1))
    accepted_mask = torch.arange(k, device=drafts.device) < n_accepted.unsqueeze(1)
    eos_accepted = (drafts.eq(eos) & accepted_mask).any(dim=1)
    ended = eos_accepted | next_tokens.eq(eos)
    return emitted, n_accepted + (~eos_accepted).long(), ended
