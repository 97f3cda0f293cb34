"""The static loop's drafters (static_loop.py): what a drafter provides there (``StaticDrafter``),
and the cached drafter in that form. The benchmark's oracle drafter is one too.
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

    def current(self) -> bool:
        """Whether what it was made from is unchanged (its model's weights)."""


@dataclass
class CachedDrafterBuffers:
    memory: Memory
    fed: Tensor  # [B] prefix entries in the drafter's cache (BOS included)


class StaticCachedDrafter:
    """The cached drafter (drafters/cached_drafter.py) in the static loop: each call feeds k + 1
    prefix slots at ``fed`` (the real ones: the tokens committed since the last call; the others
    are seen by no mask and overwritten next time) and k masks after them, which see the real
    prefix and each other."""

    def __init__(self, cached):
        self.cached = cached
        self.decoder = StaticDecoder(cached.scorer)

    def buffers(self, batch: Batch, source_length: int, masked_source: bool):
        tokens = batch.tokens
        memory = self.decoder.memory(tokens.size(0), batch.capacity, source_length,
                                     batch.verifier.keys[0].dtype, tokens.device, masked_source)
        return CachedDrafterBuffers(memory, torch.zeros_like(batch.lengths))

    def current(self) -> bool:
        return self.decoder.layers.current()

    def fill(self, batch: Batch, net_input: Dict, encoder_out: Dict) -> None:
        batch.drafter.memory.take_encoder(self.decoder, encoder_out)
        batch.drafter.fed.zero_()

    def draft(self, batch: Batch) -> Tensor:
        k, state = batch.k, batch.drafter
        prefix = state.fed.unsqueeze(1) + batch.offsets  # [B, k + 1] slots = positions
        mask_slots = prefix[:, -1:] + 1 + batch.offsets[:k]
        mask_positions = batch.lengths.unsqueeze(1) + 1 + batch.offsets[:k]
        last = batch.tokens.size(1) - 1
        tokens = torch.cat([batch.tokens.gather(1, prefix.clamp(max=last)),
                            torch.full_like(mask_slots, self.cached.mask)], dim=1)  # fmt: skip
        slot = batch.slot_index
        prefix_seen = slot <= prefix.unsqueeze(2)  # causal
        mask_seen = ((slot <= batch.lengths.view(-1, 1, 1))
                     | ((slot >= mask_slots[:, :1, None]) & (slot <= mask_slots[:, -1:, None])))
        seen = torch.cat([prefix_seen, mask_seen.expand(-1, k, -1)], dim=1)
        logits = self.decoder.logits(state.memory, tokens, torch.cat([prefix, mask_positions], 1),
                                     torch.cat([prefix, mask_slots], 1),
                                     additive_mask(seen, state.memory.keys[0].dtype), outputs=k)
        state.fed.copy_(batch.lengths + 1)
        best = self.cached._draft_columns(logits).max(dim=-1).indices
        vocabulary = self.cached.vocabulary
        return best if vocabulary is None else vocabulary[best]


def has_static_form(drafter) -> bool:
    """Whether a loaded drafter adapter drafts on the static loop: the cached drafter (not its
    CTC form, an experiment), or a ``StaticDrafter`` already (the benchmark's oracle)."""
    from spec_nmt.drafters.cached_drafter import CachedDrafter  # (it imports the decoding modules)

    return type(drafter) is CachedDrafter or all(
        hasattr(drafter, name) for name in ("buffers", "fill", "draft", "current"))


def static_drafter(drafter) -> StaticDrafter:
    """The static form of a drafter adapter that ``has_static_form``."""
    from spec_nmt.drafters.cached_drafter import CachedDrafter

    return StaticCachedDrafter(drafter) if isinstance(drafter, CachedDrafter) else drafter
