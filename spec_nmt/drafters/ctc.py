"""The cached drafter with a CTC output (``--ctc-upsample N``, an experiment of issue 57): each
block holds N x k mask slots instead of k, and the drafts are the slots' best tokens with CTC's
collapse (repeats merged, blanks dropped), the first k of them.

Masks filled position by position cannot move a token: when the drafter is unsure whether the
next word takes one token or two, every later mask drafts at the wrong offset. CTC (Graves et
al., 2006; the NAT drafters of Libovicky & Helcl 2018, Gu & Kong 2021) lets each block choose
where its tokens go, and which slots stay blank. The blank is the ``[MASK]`` symbol: it is never a
draft, and its output row already exists, so a drafter trained position by position starts the
CTC training as it drafted (each slot's best token, no blanks yet).
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from spec_nmt.decoding.scorer import ScorerState
from spec_nmt.decoding.tree import DraftTree, before_any_eos, chain
from spec_nmt.drafters.cached_drafting import CachedDrafter
from spec_nmt.errors import SpecNmtError
from spec_nmt.settings import DraftPlan


def collapse(best: Tensor, blank: int, k: int) -> Tuple[Tensor, Tensor]:
    """CTC's reading of the slots' best tokens ``best`` [B, S]: a token that repeats the slot
    before it is merged into it, blanks are dropped, and the first ``k`` tokens left are the
    drafts. Returns (drafts [B, k], filled [B, k] bool: whether the slots left a token for that
    place; the drafts past them hold ``blank``)."""
    batch, slots = best.shape
    previous = torch.cat([best.new_full((batch, 1), blank), best[:, :-1]], dim=1)
    kept = best.ne(blank) & best.ne(previous)
    place = kept.long().cumsum(dim=1) - 1  # each kept token's place among the drafts
    # the tokens not kept, and those past k, go to a spare column that is cut off
    column = torch.where(kept & (place < k), place, torch.full_like(place, k))
    drafts = best.new_full((batch, k + 1), blank).scatter_(1, column, best)[:, :k]
    filled = torch.arange(k, device=best.device) < kept.sum(dim=1, keepdim=True)
    return drafts, filled


class CtcCachedDrafter(CachedDrafter):
    """A cached drafter trained with CTC: N x k mask slots per call, collapsed to k drafts. It
    drafts greedy chains (the lossless and top-beta/tau rules): CTC gives no distribution per
    draft for the sampling rules, nor a best-but-one token per place for trees."""

    def __init__(self, model, pad: int, eos: int, vocabulary: Optional[Tensor] = None):
        if vocabulary is not None:  # its output projection lacks the blank's row
            raise SpecNmtError(
                "a CTC drafter (--ctc-upsample) drafts over its whole output projection: "
                "export it with --draft-vocab-size 0"
            )
        super().__init__(model, pad, eos, vocabulary)
        self.upsample = model.ctc_upsample

    def propose(self, state: ScorerState, tokens: Tensor, lengths: Tensor, plan: DraftPlan,
                generator) -> DraftTree:  # fmt: skip
        if plan.sample or not plan.is_chain or plan.beam_width or plan.stop_below:
            raise SpecNmtError(
                "a CTC drafter (--ctc-upsample) drafts greedy chains only: use the lossless or "
                "top-beta/tau rule without --draft-tree, --beam-tree or --draft-stop"
            )
        logits = self.mask_logits(state, tokens, lengths, self.mask_slots(plan.depth))
        drafts, filled = self.collapsed_drafts(logits, plan.depth)
        return chain(drafts, valid=filled & before_any_eos(drafts, self.eos))

    def mask_slots(self, k: int) -> int:
        return k * self.upsample

    def best_drafts(self, logits: Tensor, k: int) -> Tensor:
        return self.collapsed_drafts(logits, k)[0]

    def collapsed_drafts(self, logits: Tensor, k: int) -> Tuple[Tensor, Tensor]:
        """The k drafts [B, k] of the slots' logits [B, N x k, V], PAD in the places the slots
        leave empty (the blank is the drafter's own symbol, which the verifier's embeddings
        lack), and which places they fill [B, k]; on either loop (logits changed in place)."""
        logits = logits.float()
        logits[:, :, self.pad] = float("-inf")
        drafts, filled = collapse(logits.max(dim=-1).indices, self.mask, k)
        return drafts.masked_fill(~filled, self.pad), filled
