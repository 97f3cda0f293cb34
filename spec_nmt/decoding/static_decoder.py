"""The static loop's building blocks (static_loop.py): a decoder run over fixed-width blocks on
preallocated caches (``StaticDecoder`` on a ``Memory``), and every tensor an iteration reads or
writes (``Batch``), allocated once per shape.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from torch import Tensor

from spec_nmt.decoding import block_forward, scripted_layers
from spec_nmt.decoding.scorer import BlockScorer


@dataclass
class Memory:
    """A decoder's per-batch tensors: its self-attention cache [B, heads, capacity, head_dim]
    per layer, and its encoder attention's keys and values [B, heads, S, head_dim] per layer with
    the source padding's additive mask [B, 1, 1, S] (None: no padding)."""

    keys: List[Tensor]
    values: List[Tensor]
    encoder_keys: List[Tensor]
    encoder_values: List[Tensor]
    encoder_bias: Optional[Tensor]

    def take_encoder(self, decoder: "StaticDecoder", encoder_out: Dict) -> None:
        """Project the batch's encoder output for ``decoder``'s encoder attention into these
        buffers (longer ones: zeros past the source, masked), without asking the device
        whether there is padding."""
        scorer = decoder.scorer
        keys, values, bias = block_forward.encoder_keys_values(
            scorer.decoder, encoder_out, scorer.project, without_host=True)
        for ours, theirs in ((self.encoder_keys, keys), (self.encoder_values, values)):
            for mine, given in zip(ours, theirs):
                mine.zero_()
                mine[:, :, : given.size(2)] = given
        if self.encoder_bias is not None:
            length = keys[0].size(2)
            self.encoder_bias.fill_(float("-inf"))
            self.encoder_bias[..., :length] = 0 if bias is None else bias


class StaticDecoder:
    """A fairseq decoder (the verifier's, a cached drafter's or a feature drafter's layer) over
    fixed-width blocks on a ``Memory``, through the decoder layer function of ``scripted_layers``
    (TorchScript on the CPU; on CUDA the same function as Python, whose kernels the graph
    captures)."""

    def __init__(self, scorer: BlockScorer):
        self.scorer = scorer
        self.decoder = scorer.decoder
        self.layers = scripted_layers.ScriptedLayers(self.decoder.layers, scorer.project)
        self.table = scorer.position_table(self.decoder.max_positions())

    def memory(self, batch: int, capacity: int, source_length: int, dtype: torch.dtype,
               device: torch.device, masked_source: bool) -> Memory:  # fmt: skip
        def zeros(length: int) -> List[Tensor]:
            return [torch.zeros(batch, layer.self_attn.num_heads, length,
                                layer.self_attn.head_dim, dtype=dtype, device=device)
                    for layer in self.decoder.layers]  # fmt: skip

        bias = None
        if masked_source:
            bias = torch.zeros(batch, 1, 1, source_length, dtype=dtype, device=device)
        return Memory(zeros(capacity), zeros(capacity), zeros(source_length), zeros(source_length),
                      bias)  # fmt: skip

    def logits(self, memory: Memory, tokens: Tensor, positions: Tensor, slots: Tensor,
               bias: Tensor, outputs: Optional[int] = None) -> Tensor:  # fmt: skip
        """Float logits [B, W, V] (or of the last ``outputs`` entries) of block ``tokens``
        [B, W] at decoder ``positions`` [B, W], whose keys and values go to cache ``slots``
        [B, W]; ``bias`` [B, 1, W, capacity] says which cache slots each entry sees."""
        return self.scorer.output_logits(self.features(memory, tokens, positions, slots, bias),
                                         outputs)  # fmt: skip

    def features(self, memory: Memory, tokens: Tensor, positions: Tensor, slots: Tensor,
                 bias: Tensor, inputs: Optional[Tensor] = None) -> Tensor:  # fmt: skip
        """The decoder's final states [B, W, C] (what its output projection reads) of the block
        ``logits`` describes; ``inputs`` [B, W, C]: the entries' vectors in place of the tokens'
        embeddings (the feature drafter's)."""
        decoder, layers = self.decoder, self.layers
        x = block_forward.embed(decoder, tokens, positions, self.table, inputs).transpose(0, 1)
        function = scripted_layers.decoder_layers
        if (x.device.type == "cpu" and scripted_layers.decoder_layers_scripted is not None
                and not torch.compiler.is_compiling()):  # (torch.compile reads the Python)
            function = scripted_layers.decoder_layers_scripted
        x = function(x, layers.layers, layers.packed(x.size(0) * x.size(1)), memory.keys,
                     memory.values, 0, slots, memory.keys[0].size(2), bias, memory.encoder_keys,
                     memory.encoder_values, memory.encoder_bias, layers.heads, layers.scaling,
                     layers.eps, layers.normalize_before, layers.gelu)  # fmt: skip
        if decoder.layer_norm is not None:
            x = decoder.layer_norm(x)
        return x


@dataclass
class Batch:
    """Every tensor an iteration reads or writes, allocated once per shape (on CUDA, the
    captured graph's own). ``k`` drafts per iteration; ``capacity`` cache slots per row."""

    k: int
    capacity: int
    tokens: Tensor  # [B, T] BOS, then the verified output; room for one block past the limit
    scores: Tensor  # [B, T - 1] each output token's log-prob under the verifier
    lengths: Tensor  # [B] verified output tokens; tokens[b, lengths[b]] is the pending token
    max_lens: Tensor  # [B] each sentence's output limit
    live: Tensor  # [B] bool: not finished
    going: Tensor  # [1] bool: some row is live (what the host reads)
    iterations: Tensor  # [B] per row, while it was live
    accepted: Tensor  # [B]
    drafted: Tensor  # [B] drafts proposed while live: none at PAD (an empty place) or past an EOS
    offsets: Tensor  # [k + 1] 0 .. k
    slot_index: Tensor  # [capacity] 0 .. capacity - 1
    verifier: Memory
    drafter: object  # the drafter's own buffers (None without drafts)
