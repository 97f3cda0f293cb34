"""The autoregressive drafter: any stock fairseq Transformer translation model (trained with
``--task translation`` on the verifier's dictionaries), run on the verifier's block scorer.
"""

from typing import Dict, Optional

import torch
from torch import Tensor

from spec_nmt.decoding.drafter import finished_rows, grow_tree, pending_tokens
from spec_nmt.decoding.scorer import BlockScorer, ScorerState
from spec_nmt.decoding.tree import DraftTree
from spec_nmt.settings import DraftPlan


class ArDrafter:
    """An autoregressive drafter: a small stock fairseq Transformer translation model, run on the
    verifier's block scorer (KV cache with tree attention). Each iteration feeds the pending
    token and then every tree level, leaves included, so that after ``commit`` its cache holds
    the whole verified prefix except the new pending token."""

    def __init__(self, model, pad: int, eos: int):
        self.scorer = BlockScorer(model, role="the autoregressive drafter (--drafter-path)",
                                          drafter=True)
        self.pad, self.eos = pad, eos

    def max_positions(self) -> int:
        return self.scorer.max_positions()

    def max_source_positions(self) -> int:
        return self.scorer.model.encoder.max_positions()

    def start(self, net_input: Dict[str, Tensor], verifier_encoder_out: Dict,
              verifier_state: Optional[ScorerState] = None):  # fmt: skip
        return self.scorer.start(net_input)

    def propose(self, state, tokens, lengths, plan: DraftPlan, generator) -> DraftTree:
        # the leaves too are fed: that keeps the cache complete for the next iteration
        def expand(level_tokens: Tensor, visible: Tensor, level_depth: int, _leaf) -> Tensor:
            depths = torch.full((level_tokens.size(1),), level_depth, device=level_tokens.device)
            logits = self.scorer.score_logits(state, level_tokens, depths, visible)
            logits[:, :, self.pad] = float("-inf")
            return logits.log_softmax(dim=-1)

        pending = pending_tokens(tokens, lengths)
        return grow_tree(plan, pending, expand, self.eos, generator,
                         finished=finished_rows(pending, lengths, self.eos))  # fmt: skip

    def commit(self, state, keep: Optional[Tensor], n_keep: Tensor) -> None:
        self.scorer.commit(state, keep, n_keep)

    def select_rows(self, state, rows: Tensor) -> None:
        self.scorer.select_rows(state, rows)

    def check_depth(self, depth: int) -> None:
        """Any depth: it feeds one level per step."""
