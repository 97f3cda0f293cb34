"""The static loop's drafters (static_loop.py): what a drafter provides there (``StaticDrafter``),
and the cached drafter and the feature drafter in that form. The benchmark's oracle drafter is
one too.
"""

from dataclasses import dataclass
from typing import Dict, Protocol

import torch
from torch import Tensor

from spec_nmt.decoding.block_forward import additive_mask
from spec_nmt.decoding.static_decoder import Batch, Memory, StaticDecoder


class StaticDrafter(Protocol):
    """A drafter of the static loop: its buffers are made once per batch shape, filled per batch,
    and ``draft`` computes a chain of ``batch.k`` drafts [B, k] on the device without host
    reads (and without allocating what a captured graph cannot replay)."""

    def buffers(self, batch: Batch, source_length: int, masked_source: bool) -> object:
        """The drafter's tensors for batches of this shape."""

    def fill(self, batch: Batch, net_input: Dict, encoder_out: Dict) -> None:
        """Start ``batch.drafter`` for a new batch of sentences."""

    def draft(self, batch: Batch) -> Tensor:
        """[B, k] drafts after each row's pending token."""

    def observe(self, batch: Batch, states: Tensor, emitted: Tensor, counts: Tensor) -> None:
        """What the verifier's call left: its final states [B, k + 1, C] of the block, the
        tokens [B, k + 1] they chose, and how many [B] the rows keep (0: a finished row)."""

    def current(self) -> bool:
        """Whether what it was made from is unchanged (its model's weights)."""


@dataclass
class CachedDrafterBuffers:
    memory: Memory
    fed: Tensor  # [B] prefix entries in the drafter's cache (BOS included)
    masks: Tensor  # [masks] 0 .. masks - 1
    slot_index: Tensor  # [capacity] 0 .. capacity - 1 of its cache


class StaticCachedDrafter:
    """The cached drafter (drafters/cached_drafter.py) in the static loop: each call feeds k + 1
    prefix slots at ``fed`` (the real ones: the tokens committed since the last call; the others
    are seen by no mask and overwritten next time) and k masks after them, which see the real
    prefix and each other. Its CTC form (drafters/ctc.py) has N x k masks, collapsed on the
    device; the places they leave empty draft PAD, which the verifier never accepts."""

    def __init__(self, cached):
        self.cached = cached
        self.decoder = StaticDecoder(cached.scorer)
        self.upsample = getattr(cached, "upsample", 1)  # masks per draft

    def buffers(self, batch: Batch, source_length: int, masked_source: bool):
        tokens = batch.tokens
        masks = batch.k * self.upsample
        capacity = batch.capacity + masks - batch.k  # (the verifier's has room for k masks)
        memory = self.decoder.memory(tokens.size(0), capacity, source_length,
                                     self.cached.dtype, tokens.device, masked_source)
        return CachedDrafterBuffers(memory, torch.zeros_like(batch.lengths),
                                    torch.arange(masks, device=tokens.device),
                                    torch.arange(capacity, device=tokens.device))  # fmt: skip

    def current(self) -> bool:
        return self.decoder.layers.current()

    def fill(self, batch: Batch, net_input: Dict, encoder_out: Dict) -> None:
        batch.drafter.memory.take_encoder(self.decoder, self.cached.in_own_dtype(encoder_out))
        batch.drafter.fed.zero_()

    def observe(self, batch: Batch, states: Tensor, emitted: Tensor, counts: Tensor) -> None:
        """Nothing: the committed tokens are in ``batch.tokens``."""

    def draft(self, batch: Batch) -> Tensor:
        state = batch.drafter
        masks = state.masks.numel()
        prefix = state.fed.unsqueeze(1) + batch.offsets  # [B, k + 1] slots = positions
        mask_slots = prefix[:, -1:] + 1 + state.masks
        mask_positions = batch.lengths.unsqueeze(1) + 1 + state.masks
        last = batch.tokens.size(1) - 1
        tokens = torch.cat([batch.tokens.gather(1, prefix.clamp(max=last)),
                            torch.full_like(mask_slots, self.cached.mask)], dim=1)  # fmt: skip
        slot = state.slot_index
        prefix_seen = slot <= prefix.unsqueeze(2)  # causal
        mask_seen = ((slot <= batch.lengths.view(-1, 1, 1))
                     | ((slot >= mask_slots[:, :1, None]) & (slot <= mask_slots[:, -1:, None])))
        seen = torch.cat([prefix_seen, mask_seen.expand(-1, masks, -1)], dim=1)
        logits = self.decoder.logits(state.memory, tokens, torch.cat([prefix, mask_positions], 1),
                                     torch.cat([prefix, mask_slots], 1),
                                     additive_mask(seen, state.memory.keys[0].dtype),
                                     outputs=masks)  # fmt: skip
        state.fed.copy_(batch.lengths + 1)
        if self.upsample > 1:
            return self.cached.collapsed_drafts(logits, batch.k)[0]
        best = self.cached._draft_columns(logits).max(dim=-1).indices
        vocabulary = self.cached.vocabulary
        return best if vocabulary is None else vocabulary[best]


@dataclass
class FeatureDrafterBuffers:
    memory: Memory
    fed: Tensor  # [B] entries in the drafter's cache
    states: Tensor  # [B, k + 1, C] the verifier's final states of its last block
    chosen: Tensor  # [B, k + 1] the tokens those states chose
    counts: Tensor  # [B] how many of them the row kept (0: no verifier call yet, or finished)


class StaticFeatureDrafter:
    """The feature drafter (drafters/feature_drafter.py) in the static loop: each call feeds the
    verifier's k + 1 states of its last block, with the tokens they chose, at slots ``fed`` on
    (the kept ones are real; the others are seen by no later entry and overwritten), then drafts
    k tokens one step each from the state predicted after the last kept entry, as the dynamic
    loop's adapter does. Before the verifier's first call there is no state: the drafts are PAD,
    which the verifier never accepts (the dynamic loop drafts nothing then)."""

    def __init__(self, feature):
        self.feature = feature
        self.decoder = StaticDecoder(feature.scorer)

    def buffers(self, batch: Batch, source_length: int, masked_source: bool):
        tokens = batch.tokens
        rows, device = tokens.size(0), tokens.device
        dtype = batch.verifier.keys[0].dtype
        memory = self.decoder.memory(rows, batch.capacity, source_length, dtype, device,
                                     masked_source)  # fmt: skip
        channels = self.decoder.decoder.output_projection.weight.size(1)  # the verifier's states
        return FeatureDrafterBuffers(
            memory, torch.zeros_like(batch.lengths),
            torch.zeros(rows, batch.k + 1, channels, dtype=dtype, device=device),
            torch.zeros(rows, batch.k + 1, dtype=torch.long, device=device),
            torch.zeros_like(batch.lengths))  # fmt: skip

    def current(self) -> bool:
        return self.decoder.layers.current()

    def fill(self, batch: Batch, net_input: Dict, encoder_out: Dict) -> None:
        state = batch.drafter
        state.memory.take_encoder(self.decoder, encoder_out)
        state.fed.zero_()
        state.counts.zero_()

    def observe(self, batch: Batch, states: Tensor, emitted: Tensor, counts: Tensor) -> None:
        state = batch.drafter
        state.states.copy_(states)
        state.chosen.copy_(emitted)
        state.counts.copy_(counts)

    def draft(self, batch: Batch) -> Tensor:
        state, model = batch.drafter, self.feature.model
        dtype = state.memory.keys[0].dtype
        slots = state.fed.unsqueeze(1) + batch.offsets  # [B, k + 1] slots = positions
        seen = additive_mask(batch.slot_index <= slots.unsqueeze(2), dtype)  # causal
        fed = self.decoder.features(state.memory, state.chosen, slots, slots, seen,
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
                    state.memory, drafts[-1], slot, slot, seen,
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


def has_static_form(drafter) -> bool:
    """Whether a loaded drafter adapter drafts on the static loop: the cached drafter (its CTC
    form too), the feature drafter, or a ``StaticDrafter`` already (the benchmark's oracle)."""
    from spec_nmt.drafters.cached_drafter import CachedDrafter  # (they import the decoding
    from spec_nmt.drafters.feature_drafter import FeatureDrafter  # modules)

    return isinstance(drafter, (CachedDrafter, FeatureDrafter)) or all(
        hasattr(drafter, name) for name in ("buffers", "fill", "draft", "observe", "current"))


def static_drafter(drafter) -> StaticDrafter:
    """The static form of a drafter adapter that ``has_static_form``."""
    from spec_nmt.drafters.cached_drafter import CachedDrafter
    from spec_nmt.drafters.feature_drafter import FeatureDrafter

    if isinstance(drafter, CachedDrafter):
        return StaticCachedDrafter(drafter)
    return StaticFeatureDrafter(drafter) if isinstance(drafter, FeatureDrafter) else drafter
