"""The static loop's building blocks (static_loop.py): a decoder run over fixed-width blocks on
preallocated caches (``StaticDecoder`` on a ``DecoderCache``), and every tensor an iteration
reads or writes (``Batch``), allocated once per shape.
"""

from dataclasses import dataclass
from typing import Optional

from torch import Tensor

from spec_nmt.decoding import block_forward, scripted_layers
from spec_nmt.decoding.batch_rows import Rows
from spec_nmt.decoding.cache import DecoderCache
from spec_nmt.decoding.scorer import BlockScorer


class StaticDecoder:
    """A fairseq decoder (the verifier's, a cached drafter's or a feature drafter's layer) over
    fixed-width blocks on a ``DecoderCache``, through the decoder layer function of
    ``scripted_layers`` (TorchScript on the CPU; on CUDA the same function as Python, whose
    kernels the graph captures)."""

    def __init__(self, scorer: BlockScorer):
        self.scorer = scorer
        self.decoder = scorer.decoder
        self.layers = scripted_layers.ScriptedLayers(self.decoder.layers, scorer.project)
        self.table = scorer.position_table(self.decoder.max_positions())

    def logits(self, cache: DecoderCache, tokens: Tensor, positions: Tensor, slots: Tensor,
               bias: Tensor, outputs: Optional[int] = None) -> Tensor:  # fmt: skip
        """Float logits [B, W, V] (or of the last ``outputs`` entries) of block ``tokens``
        [B, W] at decoder ``positions`` [B, W], whose keys and values go to cache ``slots``
        [B, W]; ``bias`` [B, 1, W, capacity] says which cache slots each entry sees."""
        return self.scorer.output_logits(self.features(cache, tokens, positions, slots, bias),
                                         outputs)  # fmt: skip

    def features(self, cache: DecoderCache, tokens: Tensor, positions: Tensor, slots: Tensor,
                 bias: Tensor, inputs: Optional[Tensor] = None) -> Tensor:  # fmt: skip
        """The decoder's final states [B, W, C] (what its output projection reads) of the block
        ``logits`` describes; ``inputs`` [B, W, C]: the entries' vectors in place of the tokens'
        embeddings (the feature drafter's)."""
        decoder, layers = self.decoder, self.layers
        x = block_forward.embed(decoder, tokens, positions, self.table, inputs).transpose(0, 1)
        function = scripted_layers.decoder_layers
        if x.device.type == "cpu" and scripted_layers.decoder_layers_scripted is not None:
            function = scripted_layers.decoder_layers_scripted
        x = layers.run(function, x, cache, 0, slots, cache.capacity, bias)
        if decoder.layer_norm is not None:
            x = decoder.layer_norm(x)
        return x


@dataclass
class Batch(Rows):
    """Every tensor an iteration reads or writes, allocated once per shape (on CUDA, the
    captured graph's own): the rows' output and counts, and beside them ``k`` drafts per
    iteration, ``capacity`` cache slots per row and the caches."""

    k: int
    capacity: int
    going: Tensor  # [1] bool: some row is live (what the host reads)
    offsets: Tensor  # [k + 1] 0 .. k
    slot_index: Tensor  # [capacity] 0 .. capacity - 1
    verifier: DecoderCache
    drafter: object  # the drafter's own buffers (None without drafts)
