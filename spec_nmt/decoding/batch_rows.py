"""What the dynamic loop (loop.py) carries for a batch from iteration to iteration: its per-row
tensors (``BatchRows``) and the drafter, plan and states beside them (``BatchDecoding``).
"""

from dataclasses import dataclass
from typing import Dict, List

import torch
from torch import Tensor

from spec_nmt.decoding.drafter import Drafter
from spec_nmt.settings import DraftPlan


@dataclass
class BatchRows:
    """A batch's per-row decoding tensors, one row per state row; ``sentences`` holds each state
    row's sentence in the batch."""

    sentences: List[int]
    tokens: Tensor  # [B, T]: BOS, then the verified output
    token_scores: Tensor  # [B, T - 1]
    max_lens: Tensor  # [B]
    lengths: Tensor  # [B] verified output tokens
    iterations: Tensor
    accepted: Tensor
    drafted: Tensor
    live: Tensor  # [B] bool: not finished

    @classmethod
    def start(cls, tokens: Tensor, token_scores: Tensor, max_lens: Tensor) -> "BatchRows":
        lengths = tokens.new_zeros(tokens.size(0))
        return cls(list(range(tokens.size(0))), tokens, token_scores, max_lens, lengths,
                   torch.zeros_like(lengths), torch.zeros_like(lengths), torch.zeros_like(lengths),
                   torch.ones_like(lengths, dtype=torch.bool))  # fmt: skip

    def select(self, keep: Tensor) -> None:
        """Keep only rows ``keep``, in place."""
        for name in ("tokens", "token_scores", "max_lens", "lengths", "iterations", "accepted",
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
