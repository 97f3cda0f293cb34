"""Drafters: turn a drafter model into draft trees for the decoding loop (a chain of k drafts is
a tree too, see tree.py). Every drafter keeps the ``Drafter`` contract below.

* ``NarDrafter``: the non-autoregressive Spec-Drafter. One decoder pass over
  ``BOS + prefix + k [MASK]`` gives a distribution per block position; the node at depth d draws
  its children from position d+1's distribution, whatever its ancestors are.
  The NAR drafters (this one and the cached drafter) may draft over a *draft
  vocabulary* (``restrict_output``): the target symbols their training data uses most, so that
  the output projection, the largest matrix a drafter reads per iteration, has only those rows.
* ``CachedDrafter``: the cached drafter, NAR on the verifier's encoder output with a cached
  causal prefix.
* ``NoDrafter``: drafts nothing (k = 0: the verifier alone on the same loop).
* ``ArDrafter``: an ordinary fairseq Transformer. Drafting feeds one tree level per step on its
  own KV cache (tree attention, like the verifier's), so every node's children are drawn from the
  distribution after its own path.
"""

import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Protocol, Tuple

import torch
from torch import Tensor

from spec_nmt.decoding.linears import PackedLinears
from spec_nmt.decoding.tree import (
    DraftTree,
    beam_step,
    beam_tree,
    block_visibility,
    chain,
    greedy_chain,
    greedy_tree,
    gumbel_top_k,
    stochastic_beam_step,
)
from spec_nmt.decoding.verifier import TransformerVerifier, VerifierState, value_range
from spec_nmt.models.spec_drafter import MASK_SYMBOL, masked_input


@dataclass(frozen=True)
class DraftPlan:
    """The shape of the drafts. ``branching`` gives the children per node at each depth
    (``(1,) * k`` is a chain); ``beam_width`` > 0 instead grows ``depth`` levels of beam search
    (stochastic when sampling). ``sample`` draws tokens from p (without replacement among
    siblings); otherwise nodes hold the drafter's best tokens (or most probable sequences)."""

    branching: Tuple[int, ...] = ()
    beam_width: int = 0
    beam_depth: int = 0
    sample: bool = False

    @property
    def depth(self) -> int:
        return self.beam_depth if self.beam_width else len(self.branching)

    @property
    def is_chain(self) -> bool:
        return not self.beam_width and all(b == 1 for b in self.branching)

    @classmethod
    def chain(cls, k: int, sample: bool) -> "DraftPlan":
        return cls(branching=(1,) * k, sample=sample)

    def shrink(self, depth: int) -> "DraftPlan":
        """The same plan at most ``depth`` levels deep (near the position limit)."""
        if self.beam_width:
            return DraftPlan(beam_width=self.beam_width, beam_depth=min(depth, self.beam_depth),
                             sample=self.sample)  # fmt: skip
        return DraftPlan(branching=self.branching[:depth], sample=self.sample)


class Drafter(Protocol):
    """What the decoding loop asks of a drafter. A state is the drafter's own per-batch object;
    every method that changes it changes it in place (as the verifier's ``select_rows`` and
    ``commit`` do)."""

    def max_positions(self) -> int:
        """Decoder positions the drafter can draft at."""

    def max_source_positions(self) -> int:
        """Source tokens it accepts."""

    def start(self, net_input: Dict[str, Tensor], verifier_encoder_out: Dict) -> Any:
        """The state for a batch (``verifier_encoder_out``: the verifier's encoder output)."""

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


# expand(level tokens [B, n], their visibility over uncommitted entries [B, n, U+n], their depth)
#   -> log-probs [B, n, V] of each node's children
Expand = Callable[[Tensor, Tensor, int], Tensor]


def grow_tree(
    plan: DraftPlan,
    pending: Tensor,  # [B] the root token of every row
    expand: Expand,
    eos: int,
    generator: Optional[torch.Generator],
    needs_visibility: bool = True,
) -> DraftTree:
    """Grow a draft tree level by level. Children of an EOS node (and of an empty slot) are
    empty slots; the drafter distribution of every entry is kept when sampling.
    ``needs_visibility=False`` passes ``None`` to ``expand`` (drafters that see no tree)."""
    batch = pending.size(0)
    device = pending.device
    root = pending.unsqueeze(1)
    entry_logprobs = [expand(root, torch.ones(batch, 1, 1, dtype=torch.bool, device=device), 0)]
    empty = pending.new_zeros(batch, 0)
    tokens, parents, valid = [empty], [empty], [empty.bool()]
    depths = [pending.new_zeros(0)]
    frontier_valid = torch.ones(batch, 1, dtype=torch.bool, device=device)
    frontier_tokens = root
    beam_logprobs = torch.zeros(batch, 1, device=device)
    beam_scores = torch.zeros(batch, 1, device=device)
    for depth in range(1, plan.depth + 1):
        parent_logprobs = entry_logprobs[-1]  # [B, n_parents, V]
        # the root always extends: it is BOS (EOS's index in fairseq) or an unfinished prefix
        can_extend = frontier_valid & (frontier_tokens.ne(eos) if depth > 1 else True)
        first_parent = sum(t.size(1) for t in tokens) - frontier_tokens.size(1)  # node index
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
            level_valid = beam_scores.isfinite()
        else:
            width = plan.branching[depth - 1]
            if plan.sample:
                level_tokens, drawn = gumbel_top_k(parent_logprobs, width, generator)
            else:
                level_tokens = parent_logprobs.topk(width, dim=-1).indices
                drawn = torch.ones_like(level_tokens, dtype=torch.bool)
            beam = torch.arange(frontier_tokens.size(1), device=device).repeat_interleave(width)
            beam = beam.expand(batch, -1)
            level_tokens = level_tokens.flatten(1)
            level_valid = drawn.flatten(1) & can_extend.gather(1, beam)
        level_parents = beam + first_parent if depth > 1 else torch.full_like(beam, -1)
        tokens.append(level_tokens)
        parents.append(level_parents)
        valid.append(level_valid & frontier_valid.gather(1, beam))
        depths.append(torch.full((level_tokens.size(1),), depth, device=device))
        # the children's distributions (for the deepest level only an AR drafter computes them:
        # feeding the leaves keeps its cache complete for the next iteration)
        level_visible = None
        if needs_visibility and plan.is_chain:  # a chain node sees every earlier entry
            level_visible = torch.ones(batch, 1, depth + 1, dtype=torch.bool, device=device)
        elif needs_visibility:
            level_visible = block_visibility(torch.cat(parents, dim=1))[:, -level_tokens.size(1) :]
        entry_logprobs.append(expand(level_tokens, level_visible, depth))
        frontier_tokens, frontier_valid = level_tokens, valid[-1]
    draft_probs = torch.cat(entry_logprobs, dim=1).exp() if plan.sample else None
    return DraftTree(
        torch.cat(tokens, dim=1),
        torch.cat(parents, dim=1),
        torch.cat(depths),
        torch.cat(valid, dim=1),
        draft_probs,
    )


def output_size(decoder) -> int:
    """Columns of a decoder's output projection (fp32 or dynamically quantized)."""
    return decoder.output_projection.out_features


def restrict_output(decoder, vocabulary: Tensor) -> None:
    """Keep only the rows of ``vocabulary`` (ascending symbol ids) in a NAR drafter decoder's
    output projection, in place. Ascending ids break ties between equal logits as the whole
    projection would, so a best token inside the vocabulary stays the one drafted."""
    if decoder.output_projection.bias is not None:
        raise ValueError("a drafter's output projection has no bias in fairseq")
    weight = decoder.output_projection.weight
    projection = torch.nn.Linear(weight.size(1), vocabulary.numel(), bias=False,
                                 device=weight.device, dtype=weight.dtype)  # fmt: skip
    with torch.no_grad():
        projection.weight.copy_(weight.index_select(0, vocabulary.to(weight.device)))
    decoder.output_projection = projection


class NarDrafter:
    """The non-autoregressive Spec-Drafter: one decoder pass fills k ``[MASK]`` positions.

    Its decoder attends bidirectionally over the whole input, so nothing of the prefix can be
    cached between iterations; the (deep) encoder runs once per sentence.
    """

    def __init__(self, model, pad: int, eos: int, vocabulary: Optional[Tensor] = None):
        """``vocabulary``: the ascending symbol ids that ``restrict_output`` left the model's
        output projection (None: every symbol of the verifier's dictionary)."""
        self.model = model
        self.mask = model.decoder.dictionary.index(MASK_SYMBOL)
        if self.mask != len(model.decoder.dictionary) - 1:
            raise ValueError("the Spec-Drafter's [MASK] must be its dictionary's last symbol")
        if vocabulary is not None and output_size(model.decoder) != vocabulary.numel():
            raise ValueError("the drafter's output projection was not restricted to its vocabulary")
        self.pad, self.eos = pad, eos
        self.vocabulary = vocabulary

    def max_positions(self) -> int:
        return self.model.decoder.max_positions()

    def max_source_positions(self) -> int:
        return self.model.encoder.max_positions()

    def start(self, net_input: Dict[str, Tensor], verifier_encoder_out: Dict) -> Dict:
        return self.model.encoder.forward_torchscript(net_input)

    def position_logits(self, encoder_out: Dict, tokens: Tensor, lengths: Tensor, k: int):
        """Float logits [B, k, D] over the draft columns (``_draft_columns``) at the k masks
        after each row's ``tokens[b, :lengths[b] + 1]`` (BOS + verified prefix). ``tokens``
        must be at least ``lengths.max() + 1 + k`` wide."""
        decoder_input = masked_input(tokens, lengths + 1, k, self.mask, self.pad)
        logits, _ = self.model.decoder(decoder_input, encoder_out)  # at the masks only
        return self._draft_columns(logits)

    def check_depth(self, depth: int) -> None:
        """Any depth: one pass fills as many masks."""

    def _draft_columns(self, logits: Tensor) -> Tensor:
        """The columns a draft may take: the vocabulary's, or without a vocabulary the
        verifier's symbols except PAD ([MASK] is the drafter's last symbol, appended to the
        verifier's dictionary: dropping its column leaves exactly the verifier's)."""
        if self.vocabulary is not None:  # neither PAD nor [MASK] is in it
            return logits.float()
        logits = logits[:, :, : self.mask].float()
        logits[:, :, self.pad] = float("-inf")
        return logits

    def _over_verifier_vocabulary(self, logprobs: Tensor) -> Tensor:
        """[B, k, D] over the draft columns -> [B, k, V] over the verifier's symbols (-inf for
        the symbols outside the vocabulary)."""
        if self.vocabulary is None:
            return logprobs
        full = logprobs.new_full((*logprobs.shape[:2], self.mask), float("-inf"))
        full[:, :, self.vocabulary] = logprobs
        return full

    def propose(self, state, tokens, lengths, plan: DraftPlan, generator) -> DraftTree:
        depth = plan.depth
        logits = self.position_logits(state, tokens, lengths, depth)
        if not plan.sample and plan.beam_width:  # the drafter's most probable sequences
            best_logits, best = logits.topk(plan.beam_width, dim=-1)
            best_logprobs = best_logits - logits.logsumexp(dim=-1, keepdim=True)
            if self.vocabulary is not None:
                best = self.vocabulary[best]
            return beam_tree(best_logprobs, best, plan.beam_width, self.eos)
        if not plan.sample:  # each position's best tokens: no tree to grow
            if plan.is_chain:
                # max's indices, not argmax: the same token, 2.5x faster over 8k columns on CPU
                best = logits.max(dim=-1).indices
            else:
                best = logits.topk(max(plan.branching), dim=-1).indices
            if self.vocabulary is not None:
                best = self.vocabulary[best]
            if plan.is_chain:
                return greedy_chain(best, self.eos)
            return greedy_tree(best, plan.branching, self.eos)
        logprobs = self._over_verifier_vocabulary(torch.log_softmax(logits, dim=-1))

        def expand(level_tokens: Tensor, _visible, level_depth: int) -> Tensor:
            if depth == 0:  # no drafts at all (position limit): no distribution is needed
                return logprobs.new_zeros(*level_tokens.shape, logprobs.size(2))
            position = logprobs[:, min(level_depth, depth - 1)]
            return position.unsqueeze(1).expand(-1, level_tokens.size(1), -1)

        pending = tokens.gather(1, lengths.unsqueeze(1)).squeeze(1)
        return grow_tree(plan, pending, expand, self.eos, generator, needs_visibility=False)

    def commit(self, encoder_out, keep: Optional[Tensor], n_keep: Tensor) -> None:
        """Nothing to keep: the next pass reads the whole verified prefix again."""

    def select_rows(self, encoder_out: Dict, rows: Tensor) -> None:
        encoder_out.update(self.model.encoder.reorder_encoder_out(encoder_out, rows))


class CachedDrafter(NarDrafter):
    """The cached drafter (models/cached_drafter.py): a NAR drafter on the verifier's encoder
    output whose causal prefix lives in a KV cache. Each iteration feeds the tokens committed
    since the last one (causally, kept in the cache) and the k masks (seeing the prefix and each
    other, dropped again), on the verifier's block scorer."""

    def __init__(self, model, pad: int, eos: int, vocabulary: Optional[Tensor] = None):
        super().__init__(model, pad, eos, vocabulary)
        # only the decoder runs: its encoder copy is for training
        self.scorer = TransformerVerifier(model, role="the cached drafter (--drafter-path)",
                                          drafter=True, project=PackedLinears(model.decoder))
        self._visibility: Dict[Tuple[int, int, torch.device], Tensor] = {}

    def start(self, net_input: Dict[str, Tensor], verifier_encoder_out: Dict) -> VerifierState:
        return self.scorer.start(net_input, encoder_out=verifier_encoder_out)

    def position_logits(self, cache: VerifierState, tokens: Tensor, lengths: Tensor, k: int):
        """Float logits [B, k, D] over the draft columns at the k masks after each row's
        ``tokens[b, :lengths[b] + 1]``; the prefix entries not yet in the cache join it."""
        fed = cache.fed_lengths
        n_new = lengths + 1 - fed  # BOS + prefix entries still to feed, per row
        fewest, width = value_range(n_new)
        order = torch.arange(width, device=tokens.device)
        slots = fed.unsqueeze(1) + order
        new_tokens = tokens.gather(1, slots.clamp(max=tokens.size(1) - 1))
        if fewest == width:  # every row feeds as many entries (always at batch 1)
            depths = torch.arange(width + k, device=tokens.device)
            visible = self._visibility_pattern(width, k, tokens.device)
        else:
            new = order < n_new.unsqueeze(1)
            new_tokens = torch.where(new, new_tokens, self.pad)
            masks = n_new.unsqueeze(1) + torch.arange(k, device=tokens.device)
            depths = torch.cat([order.expand_as(new), masks], dim=1)
            # new prefix entries: causal among the real ones (so never a mask); masks: every
            # real new entry and each other; padding entries: only themselves (no empty
            # attention row)
            real = torch.cat([new, new.new_ones(tokens.size(0), k)], dim=1)  # [B, entries]
            visible = self._visibility_pattern(width, k, tokens.device)
            visible = visible & real.unsqueeze(1) & real.unsqueeze(2)
            visible |= torch.eye(width + k, dtype=torch.bool, device=tokens.device)
        block = torch.cat([new_tokens, tokens.new_full((tokens.size(0), k), self.mask)], dim=1)
        logits = self.scorer.score_logits(cache, block, depths, visible, outputs=k)
        self.scorer.commit(cache, None, n_new)
        return self._draft_columns(logits)

    def _visibility_pattern(self, width: int, k: int, device: torch.device) -> Tensor:
        """[1, width + k, width + k]: ``width`` new prefix entries, causal, then k masks that
        see every entry (built once per shape)."""
        key = (width, k, device)
        if key not in self._visibility:
            column = torch.arange(width + k, device=device)
            causal = column.unsqueeze(0) <= column.unsqueeze(1)
            self._visibility[key] = (causal | (column >= width).unsqueeze(1)).unsqueeze(0)
        return self._visibility[key]

    def commit(self, cache: VerifierState, keep: Optional[Tensor], n_keep: Tensor) -> None:
        """The accepted tokens join the cache as prefix entries next time."""

    def select_rows(self, cache: VerifierState, rows: Tensor) -> None:
        self.scorer.select_rows(cache, rows)


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

    def start(self, net_input: Dict[str, Tensor], verifier_encoder_out: Dict) -> None:
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


class ArDrafter:
    """An autoregressive drafter: a small stock fairseq Transformer translation model, run on the
    verifier's block scorer (KV cache with tree attention). Each iteration feeds the pending
    token and then every tree level, leaves included, so that after ``commit`` its cache holds
    the whole verified prefix except the new pending token."""

    def __init__(self, model, pad: int, eos: int):
        self.scorer = TransformerVerifier(model, role="the autoregressive drafter (--drafter-path)",
                                          drafter=True)
        self.pad, self.eos = pad, eos

    def max_positions(self) -> int:
        return self.scorer.max_positions()

    def max_source_positions(self) -> int:
        return self.scorer.model.encoder.max_positions()

    def start(self, net_input: Dict[str, Tensor], verifier_encoder_out: Dict):
        return self.scorer.start(net_input)

    def propose(self, state, tokens, lengths, plan: DraftPlan, generator) -> DraftTree:
        def expand(level_tokens: Tensor, visible: Tensor, level_depth: int) -> Tensor:
            depths = torch.full((level_tokens.size(1),), level_depth, device=level_tokens.device)
            logits = self.scorer.score_logits(state, level_tokens, depths, visible)
            logits[:, :, self.pad] = float("-inf")
            return logits.log_softmax(dim=-1)

        pending = tokens.gather(1, lengths.unsqueeze(1)).squeeze(1)
        return grow_tree(plan, pending, expand, self.eos, generator)

    def commit(self, state, keep: Optional[Tensor], n_keep: Tensor) -> None:
        self.scorer.commit(state, keep, n_keep)

    def select_rows(self, state, rows: Tensor) -> None:
        self.scorer.select_rows(state, rows)

    def check_depth(self, depth: int) -> None:
        """Any depth: it feeds one level per step."""
