"""The drafter contract of the decoding loop, the drafter that drafts nothing, and tree growing
for drafters that draw each level from the distribution after its parent (a chain of k drafts is
a tree too, see tree.py). The drafters themselves live in ``spec_nmt/drafters/``, one file each
with its fairseq model.
"""

import sys
from typing import Any, Callable, Dict, Optional, Protocol

import torch
from torch import Tensor

from spec_nmt.decoding.scorer import ScorerState
from spec_nmt.decoding.tree import (
    DraftTree,
    beam_step,
    block_visibility,
    chain,
    gumbel_top_k,
    stochastic_beam_step,
)
from spec_nmt.settings import DraftPlan


class Drafter(Protocol):
    """What the decoding loop asks of a drafter. A state is the drafter's own per-batch object;
    every method that changes it changes it in place (as the verifier's ``select_rows`` and
    ``commit`` do)."""

    def max_positions(self) -> int:
        """Decoder positions the drafter can draft at."""

    def max_source_positions(self) -> int:
        """Source tokens it accepts."""

    def start(self, net_input: Dict[str, Tensor], verifier_encoder_out: Dict,
              verifier_state: Optional[ScorerState] = None) -> Any:  # fmt: skip
        """The state for a batch (``verifier_encoder_out``: the verifier's encoder output;
        ``verifier_state``: the verifier's scorer state for the batch)."""

    def propose(self, state, tokens: Tensor, lengths: Tensor, plan: DraftPlan,
                generator: Optional[torch.Generator]) -> DraftTree:  # fmt: skip
        """A draft tree per row after its verified prefix ``tokens[b, 1 : lengths[b] + 1]``
        (``tokens[b, 0]`` is BOS; ``tokens[b, lengths[b]]`` the pending token). The loop
        changes ``tokens`` and ``lengths`` in place afterwards: keep copies, not them."""

    def commit(self, state, keep: Optional[Tensor], n_keep: Tensor) -> None:
        """Row b's verified prefix grew by the block entries ``keep[b, :n_keep[b]]`` (the
        pending token and the accepted path, in the verifier's scoring order); ``keep=None``:
        by the first ``n_keep[b]`` entries (a chain)."""

    def select_rows(self, state, rows: Tensor) -> None:
        """Keep only ``rows`` of the batch."""

    def check_depth(self, depth: int) -> None:
        """A one-line error for drafts ``depth`` deep that the drafter cannot make (the
        generator asks once, before decoding)."""

    # Optional:
    # - ``drafts_continuations = True``: the drafter drafts to the end of each sentence (the
    #   twin); the loop then plans chains as long as what is left of the batch's length
    #   limits instead of --block-size (``drafts_continuations``).
    # - ``static_form() -> Optional[StaticDrafter]``: the same drafter on the static loop's
    #   preallocated batch (static_loop.py), in the drafter's own file; None where it cannot
    #   run there. Without the method a drafter decodes on the dynamic loop only.


class StaticDrafter(Protocol):
    """A drafter's static form, for the static loop: its buffers are made once per batch shape,
    filled per batch, and ``draft`` computes a chain of ``batch.k`` drafts [B, k] on the
    device without host reads (and without allocating what a captured graph cannot replay).
    ``batch`` is the loop's ``static_decoder.Batch``."""

    def buffers(self, batch, source_length: int, masked_source: bool) -> object:
        """The drafter's tensors for batches of this shape (``batch.drafter``)."""

    def fill(self, batch, net_input: Dict, encoder_out: Dict) -> None:
        """Start ``batch.drafter`` for a new batch of sentences."""

    def draft(self, batch) -> Tensor:
        """[B, k] drafts after each row's pending token."""

    def observe(self, batch, states: Tensor, emitted: Tensor, counts: Tensor) -> None:
        """What the verifier's call left: its final states [B, k + 1, C] of the block, the
        tokens [B, k + 1] they chose, and how many [B] the rows keep (0: a finished row)."""

    def current(self) -> bool:
        """Whether what it was made from is unchanged (its model's weights)."""


def drafts_continuations(drafter) -> bool:
    """Whether ``drafter`` drafts whole continuations (``Drafter.drafts_continuations``)."""
    return getattr(drafter, "drafts_continuations", False)


def static_form(drafter) -> Optional[StaticDrafter]:
    """``drafter`` on the static loop (``Drafter.static_form``), or None."""
    make = getattr(drafter, "static_form", None)
    return None if make is None else make()


# expand(level tokens [B, n], their visibility over uncommitted entries [B, n, U+n], their depth,
#        whether they are the leaves: their children are never drafted)
#   -> log-probs [B, n, V] of each node's children
Expand = Callable[[Tensor, Tensor, int, bool], Tensor]


# DraftPlan.stop_below, row by row: a row's chain goes on after a level while its draft there is
# valid, not EOS, and has at least that probability under the drafter; its later drafts are
# empty slots,
# so what a sentence gets drafted does not depend on its batch. The chain is as long as its
# longest row's. grow_tree, the feature drafter's scripted chain and the NAR drafters' greedy
# chains all end chains so.


def drafter_for_rule(drafter, settings) -> "Drafter":
    """The drafter a rule drafts with, its one home. The verifier's twin
    (drafters/twin_drafter.py), where one was loaded beside the drafter file, drafts for the
    lossless rule. The others take it only where it was asked for by name: the relaxed rule's
    translations are its drafts, which may depend on the batch, and speculative sampling over
    its greedy continuations ran 0.66x fairseq sampling at batch 1 against the drafter-less
    loop's 1.42x (BENCHMARKS.md, "The twin drafter"). The relaxed rule otherwise takes a bf16
    drafter's fp32 copy where it has one (loading.load_drafter: bf16 drafts depend a little on
    the batch). Trees and RSD keep the drafter file (a twin's draft distribution is one-hot)."""
    twin = getattr(drafter, "twin", None)
    lossless = settings.verify == "top_beta" and not settings.relaxed
    if twin is not None and settings.draft_plan.is_chain and (lossless or twin.chosen_by_name):
        return twin
    if settings.relaxed:
        return getattr(drafter, "fp32_copy", None) or drafter
    return drafter


def goes_on(drafts: Tensor, draft_probs: Tensor, valid: Tensor, stop_below: float,
            eos: int) -> Tensor:  # fmt: skip
    """Whether each row's chain goes on after its ``drafts`` (their probabilities under the
    drafter and validity alike shaped)."""
    return valid & drafts.ne(eos) & (draft_probs >= stop_below)


def stopped_chain(tokens: Tensor, draft_probs: Tensor, valid: Tensor, stop_below: float,
                  eos: int) -> DraftTree:  # fmt: skip
    """The chain of ``tokens`` [B, k] (``valid`` drafts, each with ``draft_probs`` under the
    drafter) ended row by row under ``stop_below``, as long as its longest row."""
    going = goes_on(tokens, draft_probs, valid, stop_below, eos).long().cumprod(dim=1).bool()
    kept = valid & torch.cat([torch.ones_like(valid[:, :1]), going[:, :-1]], dim=1)
    length = int(kept.sum(dim=1).max()) if kept.numel() else 0
    return chain(tokens[:, :length], valid=kept[:, :length])


def pending_tokens(tokens: Tensor, lengths: Tensor) -> Tensor:
    """[B] each row's pending token: ``tokens[b, lengths[b]]``, after BOS and its verified
    prefix (the verifier's own token of the last iteration)."""
    return tokens.gather(1, lengths.unsqueeze(1)).squeeze(1)


def finished_rows(pending: Tensor, lengths: Tensor, eos: int) -> Tensor:
    """[B] whether each row's translation has ended (its ``pending_tokens`` is an EOS after
    BOS): such rows stay in a batch a while (loop._finish) and must not keep chains going."""
    return pending.eq(eos) & lengths.gt(0)


def grow_tree(
    plan: DraftPlan,
    pending: Tensor,  # [B] the root token of every row
    expand: Expand,
    eos: int,
    generator: Optional[torch.Generator],
    needs_visibility: bool = True,
    finished: Optional[Tensor] = None,  # [B] rows whose drafts count for nothing
) -> DraftTree:
    """Grow a draft tree level by level. Children of an EOS node (and of an empty slot) are
    empty slots; the drafter distribution of every entry is kept when sampling. A chain ends
    row by row under ``plan.stop_below`` (see ``goes_on``), ``finished`` rows drafting nothing.
    ``needs_visibility=False`` passes ``None`` to ``expand`` (drafters that see no tree)."""
    batch = pending.size(0)
    device = pending.device
    root = pending.unsqueeze(1)
    entry_logprobs = [expand(root, torch.ones(batch, 1, 1, dtype=torch.bool, device=device), 0,
                             plan.depth == 0)]  # fmt: skip
    empty = pending.new_zeros(batch, 0)
    tokens, parents, valid = [empty], [empty], [empty.bool()]
    depths = [pending.new_zeros(0)]
    frontier_valid = torch.ones(batch, 1, dtype=torch.bool, device=device)
    if plan.stop_below and finished is not None:
        frontier_valid = ~finished.unsqueeze(1)
    frontier_tokens = root
    beam_logprobs = torch.zeros(batch, 1, device=device)
    beam_scores = torch.zeros(batch, 1, device=device)
    for depth in range(1, plan.depth + 1):
        parent_logprobs = entry_logprobs[-1]  # [B, n_parents, V]
        # the root always extends: it is BOS (EOS's index in fairseq) or an unfinished prefix
        can_extend = frontier_valid & (frontier_tokens.ne(eos) if depth > 1 else True)
        first_parent = sum(t.size(1) for t in tokens) - frontier_tokens.size(1)  # node index
        beam, level_tokens, level_valid, beam_logprobs, beam_scores = _next_level(
            plan, depth, parent_logprobs, can_extend, beam_logprobs, beam_scores, generator)
        level_parents = beam + first_parent if depth > 1 else torch.full_like(beam, -1)
        tokens.append(level_tokens)
        parents.append(level_parents)
        valid.append(level_valid & frontier_valid.gather(1, beam))
        depths.append(torch.full((level_tokens.size(1),), depth, device=device))
        leaf = depth == plan.depth
        going = valid[-1]
        if plan.stop_below:  # a chain: one token per row
            chosen = parent_logprobs.gather(2, level_tokens.unsqueeze(2)).squeeze(2)
            if not plan.sample:  # (greedy drafters give logits)
                chosen = chosen - parent_logprobs.logsumexp(dim=-1)
            going = goes_on(level_tokens, chosen.exp(), valid[-1], plan.stop_below, eos)
            leaf = leaf or not bool(going.any())
        # the children's distributions (for the deepest level only an AR drafter computes them:
        # feeding the leaves keeps its cache complete for the next iteration)
        level_visible = None
        if needs_visibility and plan.is_chain:  # a chain node sees every earlier entry
            level_visible = torch.ones(batch, 1, depth + 1, dtype=torch.bool, device=device)
        elif needs_visibility:
            level_visible = block_visibility(torch.cat(parents, dim=1))[:, -level_tokens.size(1) :]
        entry_logprobs.append(expand(level_tokens, level_visible, depth, leaf))
        if leaf:
            break
        frontier_tokens, frontier_valid = level_tokens, going
    draft_probs = torch.cat(entry_logprobs, dim=1).exp() if plan.sample else None
    return DraftTree(
        torch.cat(tokens, dim=1),
        torch.cat(parents, dim=1),
        torch.cat(depths),
        torch.cat(valid, dim=1),
        draft_probs,
    )


def _next_level(plan: DraftPlan, depth: int, parent_logprobs: Tensor, can_extend: Tensor,
                beam_logprobs: Tensor, beam_scores: Tensor,
                generator: Optional[torch.Generator]):  # fmt: skip
    """One level of ``grow_tree`` from its parents' log-probs [B, n_parents, V]: (each node's
    parent among them [B, n], the nodes' tokens [B, n], whether each is a real draft [B, n],
    and beam search's running log-probs and scores)."""
    if plan.beam_width:
        masked = parent_logprobs.masked_fill(~can_extend.unsqueeze(2), float("-inf"))
        if plan.sample:
            beam, level_tokens, beam_logprobs, beam_scores = stochastic_beam_step(
                beam_logprobs, beam_scores, masked, plan.beam_width, generator
            )
        else:
            beam, level_tokens, beam_logprobs = beam_step(beam_logprobs, masked,
                                                          plan.beam_width)  # fmt: skip
            beam_scores = beam_logprobs
        return beam, level_tokens, beam_scores.isfinite(), beam_logprobs, beam_scores
    width = plan.branching[depth - 1]
    if plan.sample:
        level_tokens, drawn = gumbel_top_k(parent_logprobs, width, generator)
    else:
        level_tokens = parent_logprobs.topk(width, dim=-1).indices
        drawn = torch.ones_like(level_tokens, dtype=torch.bool)
    batch, parents = parent_logprobs.shape[:2]
    beam = torch.arange(parents, device=parent_logprobs.device).repeat_interleave(width)
    beam = beam.expand(batch, -1)
    level_valid = drawn.flatten(1) & can_extend.gather(1, beam)
    return beam, level_tokens.flatten(1), level_valid, beam_logprobs, beam_scores


class NoDrafter:
    """Drafts nothing: with k = 0 the loop decodes with the verifier alone, one entry per verifier
    call (greedy, or sampling from the verifier), on the same block scorer and packed products as
    speculative decoding; the drafter that was loaded is not run."""

    def __init__(self, max_positions: int, symbols: int):
        self._max_positions, self.symbols = max_positions, symbols

    def max_positions(self) -> int:
        return self._max_positions

    def max_source_positions(self) -> int:
        return sys.maxsize  # it reads no source: any the verifier takes

    def start(self, net_input: Dict[str, Tensor], verifier_encoder_out: Dict,
              verifier_state: Optional[ScorerState] = None) -> None:  # fmt: skip
        return None

    def propose(self, state, tokens, lengths, plan: DraftPlan, generator) -> DraftTree:
        return no_drafts(tokens, self.symbols, plan.sample)

    def commit(self, state, keep: Optional[Tensor], n_keep: Tensor) -> None:
        """Nothing to keep."""

    def select_rows(self, state, rows: Tensor) -> None:
        """Nothing per row."""

    def check_depth(self, depth: int) -> None:
        """It drafts nothing at any depth."""


def no_drafts(tokens: Tensor, symbols: int, sample: bool) -> DraftTree:
    """A tree without nodes for each row of ``tokens``; a sampling rule also gets the root's
    drafter distribution over ``symbols`` (zeros, never read: the root has no children)."""
    batch = tokens.size(0)
    probs = tokens.new_zeros(batch, 1, symbols, dtype=torch.float) if sample else None
    return chain(tokens.new_zeros(batch, 0), probs)
