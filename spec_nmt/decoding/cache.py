"""The one cache of both loops: every decoder they run keeps per layer self-attention slots
[B, heads, capacity, head_dim], written in place at each row's positions (the next block
overwrites a rejected entry), and its encoder attention's keys and values [B, heads, S, head_dim]
with the source padding as an additive mask [B, 1, 1, S] (None: no padding). The dynamic loop
grows the slots (``scorer.ScorerState``), the static loop allocates them at their final size.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from spec_nmt.decoding import block_forward


@dataclass(eq=False)  # (compared and hashed by identity, as tensors are)
class DecoderCache:
    keys: List[Tensor]  # per layer [B, heads, capacity, head_dim]
    values: List[Tensor]
    encoder_keys: List[Tensor]  # per layer [B, heads, S, head_dim]
    encoder_values: List[Tensor]
    encoder_bias: Optional[Tensor]  # [B, 1, 1, S]: -inf at source padding

    @property
    def capacity(self) -> int:
        return self.keys[0].size(2) if self.keys else 0

    @classmethod
    def allocate(cls, decoder, batch: int, capacity: int, source_length: int, dtype: torch.dtype,
                 device: torch.device, masked_source: bool) -> "DecoderCache":  # fmt: skip
        """Zeros for every tensor, the encoder's included (the static loop copies each batch's
        into them: a captured graph reads the same buffers every time)."""
        bias = None
        if masked_source:
            bias = torch.zeros(batch, 1, 1, source_length, dtype=dtype, device=device)
        keys, values = layer_slots(decoder, batch, capacity, dtype, device)
        encoder_keys, encoder_values = layer_slots(decoder, batch, source_length, dtype, device)
        return cls(keys, values, encoder_keys, encoder_values, bias)

    def grow(self, decoder, rows: int, capacity: int, like: Tensor) -> None:
        """Hold ``capacity`` self-attention slots for each of the ``rows``, the written ones
        copied (of ``like``'s dtype and device)."""
        keys, values = layer_slots(decoder, rows, capacity, like.dtype, like.device)
        for old, new in zip(self.keys + self.values, keys + values):
            new[:, :, : old.size(2)] = old
        self.keys, self.values = keys, values

    def select_rows(self, rows: Tensor) -> None:
        """Keep only ``rows`` of the batch, in place."""
        for caches in (self.keys, self.values, self.encoder_keys, self.encoder_values):
            caches[:] = [cache.index_select(0, rows) for cache in caches]
        if self.encoder_bias is not None:
            self.encoder_bias = self.encoder_bias.index_select(0, rows)

    def take_encoder(self, scorer, encoder_out: Dict) -> None:
        """Project the batch's encoder output for the encoder attention of ``scorer``'s
        decoder (a ``scorer.BlockScorer``, with its packed products) into these buffers
        (longer ones: zeros past the source, masked), without asking the device whether
        there is padding."""
        keys, values, bias = block_forward.encoder_keys_values(scorer.decoder, encoder_out,
                                                               scorer.project,
                                                               without_host=True)  # fmt: skip
        for ours, theirs in ((self.encoder_keys, keys), (self.encoder_values, values)):
            for mine, given in zip(ours, theirs):
                mine.zero_()
                mine[:, :, : given.size(2)] = given
        if self.encoder_bias is not None:
            length = keys[0].size(2)
            self.encoder_bias.fill_(float("-inf"))
            self.encoder_bias[..., :length] = 0 if bias is None else bias


def layer_slots(decoder, batch: int, slots: int, dtype: torch.dtype,
                device: torch.device) -> Tuple[List[Tensor], List[Tensor]]:  # fmt: skip
    """Per layer of ``decoder``, keys and values [B, heads, slots, head_dim] of zeros: no
    unwritten slot holds a NaN for a masked attention weight to multiply."""

    def zeros() -> List[Tensor]:
        return [torch.zeros(batch, layer.self_attn.num_heads, slots, layer.self_attn.head_dim,
                            dtype=dtype, device=device) for layer in decoder.layers]  # fmt: skip

    return zeros(), zeros()
