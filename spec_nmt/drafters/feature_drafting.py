"""The feature drafter's decoding side (its model: feature_drafter.py). On the dynamic loop a
``FeatureDrafter`` feeds the verifier's states of the newly verified positions into its
one-layer decoder, then drafts a chain (in one scripted call, ``greedy_drafts``) or a tree one
step per level; its static form (``StaticFeatureDrafter``) drafts chains on the static loop's
preallocated batch.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from fairseq.models.transformer import TransformerDecoderBase
from torch import Tensor, nn

from spec_nmt.decoding import scripted_layers
from spec_nmt.decoding.block_forward import additive_mask
from spec_nmt.decoding.drafter import (
    finished_rows, goes_on, grow_tree, no_drafts, pending_tokens, stopped_chain,
)
from spec_nmt.decoding.linears import PackedLinears
from spec_nmt.decoding.scorer import BlockScorer, ScorerState, among_real_entries, value_range
from spec_nmt.decoding.scripted_layers import decoder_layers, linear, script
from spec_nmt.decoding.cache import DecoderCache
from spec_nmt.decoding.static_decoder import StaticDecoder
from spec_nmt.decoding.tree import DraftTree, before_any_eos, greedy_chain
from spec_nmt.drafters.spec_drafter import over_all_symbols, restrict_output
from spec_nmt.errors import SpecNmtError
from spec_nmt.settings import DraftPlan


class FeatureDraftState:
    """A batch's drafting state: the drafter's scorer state (its cache holds the true inputs
    of the verified prefix, up to the pending token) and the verifier's states of the entries
    the verifier kept at its last commit, with their count per row, to be fed next."""

    def __init__(self, verifier_state: ScorerState, drafter_state: ScorerState):
        self.verifier_state = verifier_state
        self.drafter_state = drafter_state
        self.new_states: Optional[Tensor] = None  # [B, n, C]
        self.new_counts: Optional[Tensor] = None  # [B]


class FeatureDrafter:
    """The decoding loop's adapter of a feature drafter: a chain of k drafts per iteration, one
    drafter step each, after feeding the verifier's states of the newly verified positions. The
    drafter's layer runs on the block scorer as a one-layer decoder whose inputs are given; a
    chain of greedy drafts runs its steps in one scripted call (``greedy_drafts``) where the
    scorer's layers are scripted."""

    def __init__(self, model, pad: int, eos: int,
                 vocabulary: Optional[Tensor] = None):  # fmt: skip
        self.model, self.pad, self.eos = model, pad, eos
        self.symbols = len(model.verifier.decoder.dictionary)
        self.decoder = model.decoding_decoder()
        self.vocabulary = vocabulary
        if vocabulary is not None:  # before packing: the smaller projection is what runs
            restrict_output(self.decoder, vocabulary)
        self.scorer = BlockScorer(DecodingModel(self.decoder, model.verifier.encoder),
                                  role="the feature drafter (--drafter-path)", drafter=True,
                                  project=PackedLinears(self.decoder))  # fmt: skip

    def max_positions(self) -> int:
        return self.scorer.max_positions()

    def max_source_positions(self) -> int:
        return self.model.verifier.encoder.max_positions()

    def check_depth(self, depth: int) -> None:
        """Any depth: each draft is one more step."""

    def start(self, net_input: Dict[str, Tensor], verifier_encoder_out: Dict,
              verifier_state: Optional[ScorerState] = None) -> FeatureDraftState:  # fmt: skip
        if verifier_state is None:
            raise SpecNmtError("the feature drafter reads the verifier's states: give it the "
                               "verifier's scorer state")
        verifier_state.keep_block_states = True
        drafter_state = self.scorer.start(net_input, encoder_out=verifier_encoder_out)
        drafter_state.keep_block_states = True
        return FeatureDraftState(verifier_state, drafter_state)

    def propose(self, state: FeatureDraftState, tokens: Tensor, lengths: Tensor,
                plan: DraftPlan, generator) -> DraftTree:  # fmt: skip
        if state.new_counts is None:  # the first iteration: no verifier state to draft from
            return no_drafts(tokens, self.symbols, plan.sample)
        cache = state.drafter_state
        scripted = self._scripted_steps(tokens.device) is not None
        if plan.is_chain and not plan.sample and plan.depth and scripted:
            tree = self._greedy_chain(state, tokens, lengths, plan)
        else:
            tree = self._tree_by_steps(state, tokens, lengths, plan, generator)
        self.scorer.commit(cache, None, torch.zeros_like(lengths))  # drop the drafted entries
        return tree

    def _tree_by_steps(self, state: FeatureDraftState, tokens: Tensor, lengths: Tensor,
                       plan: DraftPlan, generator) -> DraftTree:  # fmt: skip
        """Any chain or tree, one scorer call per level (grow_tree draws each level from its
        logits). A node's input is the state its parent predicted with its own token; it sees
        its ancestors among the drafted entries, the verified ones all."""
        cache = state.drafter_state
        predicted: Optional[Tensor] = None  # [B, nodes of the level before, C]
        drafted = 0  # the entries of the block: the drafted nodes

        def expand(level_tokens: Tensor, visible: Optional[Tensor], depth: int,
                   leaf: bool) -> Tensor:  # fmt: skip
            nonlocal predicted, drafted
            batch, width = level_tokens.shape
            if depth == 0:  # even when nothing is drafted: the cache takes the verified entries
                logits, predicted = self._feed_verified(state, tokens, lengths)
            if leaf:  # the leaves' children are never drafted
                return level_tokens.new_full((batch, width, self.symbols), float("-inf"),
                                             dtype=torch.float)  # fmt: skip
            if depth > 0:
                if visible is not None:  # block_visibility's: drop the root's column
                    visible = visible[:, :, 1:]
                if visible is not None and depth > 1:
                    before = drafted - predicted.size(1)  # the parents' level starts there
                    parent = visible[:, :, before:drafted].long().argmax(dim=2).expand(batch, -1)
                    parent = parent.unsqueeze(2).expand(-1, -1, predicted.size(2))
                    parent_states = predicted.gather(1, parent)
                else:  # a chain's parent, or the root
                    parent_states = predicted.expand(-1, width, -1)
                depths = torch.full((width,), depth - 1, device=level_tokens.device)
                inputs = self.model.step_inputs(parent_states, level_tokens)
                logits = self.scorer.score_logits(cache, level_tokens, depths, visible,
                                                  inputs=inputs)  # fmt: skip
                predicted = cache.block_states
                drafted += width
            logits = self._over_all_symbols(logits)
            return torch.log_softmax(logits, dim=-1) if plan.sample else logits

        pending = pending_tokens(tokens, lengths)
        return grow_tree(plan, pending, expand, self.eos, generator,
                         needs_visibility=not plan.is_chain,
                         finished=finished_rows(pending, lengths, self.eos))  # fmt: skip

    def _over_all_symbols(self, logits: Tensor) -> Tensor:
        """Logits [B, n, V] over the verifier's symbols from the projection's: -inf for PAD
        and for the symbols outside the draft vocabulary."""
        if self.vocabulary is not None:
            return over_all_symbols(logits, self.vocabulary, self.symbols)
        logits[:, :, self.pad] = float("-inf")
        return logits

    def _scripted_steps(self, device: torch.device):
        """The drafter's layer as ``greedy_drafts`` takes it, or None where the scorer runs
        the stock modules (no TorchScript, or not on the CPU: as in score_logits)."""
        if greedy_drafts_scripted is None or device.type != "cpu":
            return None
        return self.scorer.scripted_layers()

    def _greedy_chain(self, state: FeatureDraftState, tokens: Tensor, lengths: Tensor,
                      plan: DraftPlan) -> DraftTree:  # fmt: skip
        """The chain of ``depth`` greedy drafts in one scripted call (``greedy_drafts``): the
        drafts ``_tree_by_steps`` makes, without the Python between the steps."""
        cache, counts, depth = state.drafter_state, state.new_counts, plan.depth
        new_tokens = self._new_tokens(state, tokens, lengths)
        batch, width = new_tokens.shape
        # the loop's token buffer bounds every fed length: no need to read them
        self.scorer.reserve(cache, tokens.size(1) + width + depth, state.new_states)
        layers = self._scripted_steps(tokens.device)
        verifier, norm = self.model.verifier.decoder, self.decoder.layer_norm
        projection = self.decoder.output_projection
        finished = finished_rows(pending_tokens(tokens, lengths), lengths, self.eos)
        drafts, confidence = greedy_drafts_scripted(
            state.new_states, new_tokens, counts, finished, depth, cache.fed_lengths,
            self.scorer.position_table(tokens.size(1) + width + depth),
            verifier.embed_tokens.weight, float(verifier.embed_scale), self.model.combine.weight,
            self.model.combine.bias, layers.layers, layers.packed(batch * width),
            layers.packed(batch), cache.keys, cache.values, cache.encoder_keys,
            cache.encoder_values, cache.encoder_bias, norm.weight, norm.bias, projection.weight,
            self.scorer.project.packed_weight((projection,), batch), self.vocabulary, self.pad,
            self.eos, plan.stop_below, layers.heads, layers.scaling, layers.eps, layers.gelu)
        self.scorer.commit(cache, None, counts)
        if not plan.stop_below:
            return greedy_chain(drafts, self.eos)
        valid = before_any_eos(drafts, self.eos) & ~finished.unsqueeze(1)
        return stopped_chain(drafts, confidence, valid, plan.stop_below, self.eos)

    def _new_tokens(self, state: FeatureDraftState, tokens: Tensor, lengths: Tensor) -> Tensor:
        """[B, n] the tokens the verifier's kept states chose: each row's newly verified
        tokens, the pending one last (padded after a row's count)."""
        order = torch.arange(state.new_states.size(1), device=tokens.device)
        chosen = (lengths - state.new_counts + 1).unsqueeze(1) + order
        return tokens.gather(1, chosen.clamp(0, tokens.size(1) - 1))

    def _feed_verified(self, state: FeatureDraftState, tokens: Tensor, lengths: Tensor):
        """Feed each row the verifier's states kept at its last commit with the tokens they
        chose into the cache; returns the logits [B, 1, projection rows] and the predicted
        state [B, 1, C] after the pending token."""
        cache, counts = state.drafter_state, state.new_counts
        new_tokens = self._new_tokens(state, tokens, lengths)
        width = new_tokens.size(1)
        order = torch.arange(width, device=tokens.device)
        inputs = self.model.step_inputs(state.new_states, new_tokens)
        fewest, _ = value_range(counts)
        if fewest == width:  # every row feeds as many entries (always at batch 1)
            logits = self.scorer.score_logits(cache, new_tokens, outputs=1, inputs=inputs)
            predicted = cache.block_states[:, -1:]
        else:  # only each row's last state is projected, as greedy_drafts does
            causal = (order.unsqueeze(0) <= order.unsqueeze(1)).unsqueeze(0)
            visible = among_real_entries(causal, order < counts.unsqueeze(1))
            self.scorer.score_logits(cache, new_tokens, order, visible, outputs=0, inputs=inputs)
            last = (counts - 1).clamp(min=0)[:, None, None]
            predicted = cache.block_states.gather(
                1, last.expand(-1, 1, cache.block_states.size(2)))
            logits = self.scorer.project(self.decoder.output_projection, predicted).float()
        self.scorer.commit(cache, None, counts)
        return logits, predicted

    def commit(self, state: FeatureDraftState, keep: Optional[Tensor], n_keep: Tensor) -> None:
        """The verifier's states of the kept entries (``keep[b, :n_keep[b]]`` in scoring order,
        None: a chain's first ``n_keep``) are fed with the next proposal."""
        states = state.verifier_state.block_states
        width = max(int(n_keep.max()), 1)
        if keep is None:
            state.new_states = states[:, :width]
        else:
            kept = keep[:, :width, None].expand(-1, -1, states.size(2))
            state.new_states = states.gather(1, kept)
        state.new_counts = n_keep

    def select_rows(self, state: FeatureDraftState, rows: Tensor) -> None:
        self.scorer.select_rows(state.drafter_state, rows)
        if state.new_counts is not None:
            state.new_states = state.new_states.index_select(0, rows)
            state.new_counts = state.new_counts.index_select(0, rows)

    def static_form(self) -> Optional["StaticFeatureDrafter"]:
        """This drafter on the static loop, where its layer is the kind the scripted layers
        run."""
        if not scripted_layers.decoder_supported(self.scorer.decoder):
            return None
        return StaticFeatureDrafter(self)


def greedy_drafts(states: Tensor, tokens: Tensor, counts: Tensor, finished: Tensor, drafts: int,
                  fed_lengths: Tensor, positions: Tensor, embed: Tensor, embed_scale: float,
                  combine_weight: Tensor, combine_bias: Tensor, layers: List[List[Tensor]],
                  packed_fed: List[List[Optional[Tensor]]],
                  packed_drafted: List[List[Optional[Tensor]]], keys: List[Tensor],
                  values: List[Tensor], encoder_keys: List[Tensor], encoder_values: List[Tensor],
                  encoder_bias: Optional[Tensor], norm_weight: Tensor, norm_bias: Tensor,
                  projection: Tensor, projection_packed: Optional[Tensor],
                  vocabulary: Optional[Tensor], pad: int, eos: int, stop_below: float,
                  heads: int, scaling: float, eps: float,
                  gelu: bool) -> Tuple[Tensor, Tensor]:  # fmt: skip
    """``drafts`` greedy drafts [B, drafts] of the feature drafter's layer (``decoder_layers``:
    pre-norm, one layer), its final norm and ``projection``, as the block scorer runs them (the
    same products, so the same drafts): first the verifier's kept ``states`` [B, n, C] with the
    ``tokens`` [B, n] they chose (row b's first ``counts[b]``), written at the cache slots and
    positions ``fed_lengths[b] + i``, give the first draft; then each draft with the state
    predicted before it, after them, gives the next. Every entry sees every slot up to its own.
    ``projection``'s rows are the symbols of ``vocabulary`` (ascending ids), or without one all
    symbols, of which ``pad`` is never drafted. Returns the drafts and, with ``stop_below`` > 0,
    their probabilities under the drafter [B, n] (else zeros): the chain ends, perhaps before
    ``drafts``, where no row goes on (goes_on; ``finished`` rows [B] never do, nor a
    row after its EOS)."""
    channels = states.size(-1)
    made: List[Tensor] = []
    inputs, chosen, starts, packed = states, tokens, fed_lengths, packed_fed
    going = ~finished  # rows whose chain goes on
    confidences: List[Tensor] = []
    for draft in range(drafts):
        if draft > 0:
            starts = fed_lengths + counts + (draft - 1)
            packed = packed_drafted
        width = chosen.size(1)
        embedded = embed_scale * F.embedding(chosen, embed)
        x = F.linear(torch.cat([inputs, embedded.to(inputs.dtype)], dim=-1), combine_weight,
                     combine_bias)  # fmt: skip
        slots = starts.unsqueeze(1) + torch.arange(width, device=x.device)  # [B, W]
        x = x + positions[slots.clamp(max=positions.size(0) - 1)]
        lowest, highest = int(starts.min()), int(starts.max())
        span = highest + width
        unseen = torch.arange(span, device=x.device)[None, None, :] > slots.unsqueeze(2)
        bias = torch.zeros(unseen.shape, dtype=x.dtype, device=x.device)
        bias = bias.masked_fill_(unseen, float("-inf")).unsqueeze(1)  # [B, 1, W, span]
        x = decoder_layers(x, layers, packed, keys, values, lowest,
                           None if lowest == highest else slots, span, bias, encoder_keys,
                           encoder_values, encoder_bias, heads, scaling, eps, True,
                           gelu)  # fmt: skip
        x = F.layer_norm(x, [channels], norm_weight, norm_bias, eps)
        if draft == 0:  # the state after each row's last fed entry
            last = (counts - 1).clamp(min=0)[:, None, None].expand(-1, 1, channels)
            x = x.gather(1, last)
        inputs = x
        logits = linear(x, projection, None, projection_packed).float()
        if vocabulary is None:
            logits[:, :, pad] = float("-inf")
        best, chosen = logits.max(dim=-1)  # max's indices: argmax's, faster on the CPU
        if vocabulary is not None:
            chosen = vocabulary[chosen]
        made.append(chosen)
        confidence = torch.zeros_like(best)
        if stop_below > 0:
            confidence = (best - logits.logsumexp(dim=-1)).exp()
            going = goes_on(chosen.squeeze(1), confidence.squeeze(1), going, stop_below, eos)
        confidences.append(confidence)
        if stop_below > 0 and not bool(going.any()):
            break
    return torch.cat(made, dim=1), torch.cat(confidences, dim=1)


greedy_drafts_scripted = script(greedy_drafts)


class DecodingModel(nn.Module):
    """What the block scorer reads of a model: the drafter's one-layer decoder, and the
    verifier's encoder (never run: the drafter starts from the verifier's encoder output)."""

    def __init__(self, decoder: TransformerDecoderBase, encoder):
        super().__init__()
        self.decoder, self.encoder = decoder, encoder


@dataclass
class FeatureDrafterBuffers:
    cache: DecoderCache
    fed: Tensor  # [B] entries in the drafter's cache
    states: Tensor  # [B, k + 1, C] the verifier's final states of its last block
    chosen: Tensor  # [B, k + 1] the tokens those states chose
    counts: Tensor  # [B] how many of them the row kept (0: no verifier call yet, or finished)


class StaticFeatureDrafter:
    """The feature drafter on the static loop (``FeatureDrafter.static_form``): each call feeds the
    verifier's k + 1 states of its last block, with the tokens they chose, at slots ``fed`` on
    (the kept ones are real; the others are seen by no later entry and overwritten), then drafts
    k tokens one step each from the state predicted after the last kept entry, as the dynamic
    loop's adapter does. Before the verifier's first call there is no state: the drafts are PAD,
    which the verifier never accepts (the dynamic loop drafts nothing then)."""

    def __init__(self, feature):
        self.feature = feature
        self.decoder = StaticDecoder(feature.scorer)

    def buffers(self, batch, source_length: int, masked_source: bool):
        tokens = batch.tokens
        rows, device = tokens.size(0), tokens.device
        dtype = batch.verifier.keys[0].dtype
        cache = DecoderCache.allocate(self.decoder.decoder, rows, batch.capacity, source_length,
                                      dtype, device, masked_source)  # fmt: skip
        channels = self.decoder.decoder.output_projection.weight.size(1)  # the verifier's states
        return FeatureDrafterBuffers(
            cache, torch.zeros_like(batch.lengths),
            torch.zeros(rows, batch.k + 1, channels, dtype=dtype, device=device),
            torch.zeros(rows, batch.k + 1, dtype=torch.long, device=device),
            torch.zeros_like(batch.lengths))  # fmt: skip

    def current(self) -> bool:
        return self.decoder.layers.current()

    def fill(self, batch, net_input: Dict, encoder_out: Dict) -> None:
        state = batch.drafter
        state.cache.take_encoder(self.feature.scorer, encoder_out)
        state.fed.zero_()
        state.counts.zero_()

    def observe(self, batch, states: Tensor, emitted: Tensor, counts: Tensor) -> None:
        state = batch.drafter
        state.states.copy_(states)
        state.chosen.copy_(emitted)
        state.counts.copy_(counts)

    def draft(self, batch) -> Tensor:
        state, model = batch.drafter, self.feature.model
        dtype = state.cache.keys[0].dtype
        slots = state.fed.unsqueeze(1) + batch.offsets  # [B, k + 1] slots = positions
        seen = additive_mask(batch.slot_index <= slots.unsqueeze(2), dtype)  # causal
        fed = self.decoder.features(state.cache, state.chosen, slots, slots, seen,
                                    inputs=model.step_inputs(state.states, state.chosen))
        last = (state.counts - 1).clamp(min=0).view(-1, 1, 1).expand(-1, 1, fed.size(2))
        predicted = fed.gather(1, last)  # [B, 1, C] after each row's last kept entry
        start = state.fed + state.counts
        drafts = []
        for step in range(batch.k):
            drafts.append(self._best(predicted))
            if step + 1 < batch.k:
                slot = start.unsqueeze(1) + step
                seen = additive_mask(batch.slot_index <= slot.unsqueeze(2), dtype)
                predicted = self.decoder.features(
                    state.cache, drafts[-1], slot, slot, seen,
                    inputs=model.step_inputs(predicted, drafts[-1]))  # fmt: skip
        state.fed.copy_(start)  # (the drafted entries are overwritten next time)
        return torch.cat(drafts, dim=1).masked_fill(state.counts.eq(0).unsqueeze(1),
                                                    self.feature.pad)  # fmt: skip

    def _best(self, predicted: Tensor) -> Tensor:
        """[B, 1] the best symbol after each predicted state (never PAD)."""
        logits = self.decoder.scorer.output_logits(predicted)
        vocabulary = self.feature.vocabulary
        if vocabulary is None:
            logits[:, :, self.feature.pad] = float("-inf")
        best = logits.max(dim=-1).indices
        return best if vocabulary is None else vocabulary[best]
