"""Drafter adapters: turn a drafter model into block proposals for the decoding loop.

A drafter adapter has three verbs: ``start`` (encode the batch once), ``propose`` (draft the next
k tokens of every row after its verified prefix) and ``select_rows`` (finished sentences leave).
"""

from typing import Dict

import torch
from torch import Tensor


class NarDrafter:
    """The non-autoregressive Spec-Drafter: one decoder pass fills k ``[MASK]`` positions.

    Its decoder attends bidirectionally over the whole input, so nothing of the prefix can be
    cached between iterations; the (deep) encoder runs once per sentence.
    """

    def __init__(self, model, pad: int):
        self.model = model
        self.mask = model.decoder.mask_idx
        self.pad = pad

    def max_positions(self) -> int:
        return self.model.decoder.max_positions()

    def start(self, net_input: Dict[str, Tensor]) -> Dict:
        return self.model.encoder.forward_torchscript(net_input)

    def propose(self, encoder_out: Dict, tokens: Tensor, lengths: Tensor, k: int) -> Tensor:
        """Drafted tokens [B, k] for rows whose input is ``tokens[b, :lengths[b] + 1]``
        (BOS + verified prefix) followed by k masks. ``tokens`` must be at least
        ``lengths.max() + 1 + k`` wide (the generator's buffer has that slack)."""
        width = int(lengths.max()) + 1 + k
        slots = torch.arange(width, device=tokens.device).unsqueeze(0)
        prefix_end = lengths.unsqueeze(1) + 1
        decoder_input = torch.where(
            slots < prefix_end,
            tokens[:, :width],
            torch.where(slots < prefix_end + k, self.mask, self.pad),
        )
        logits, _ = self.model.decoder(decoder_input, encoder_out)
        logits[:, :, self.pad] = float("-inf")
        logits[:, :, self.mask] = float("-inf")
        return logits.argmax(dim=-1)

    def select_rows(self, encoder_out: Dict, rows: Tensor) -> Dict:
        return self.model.encoder.reorder_encoder_out(encoder_out, rows)
