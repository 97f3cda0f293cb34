"""The verifier adapter: a stock fairseq Transformer translation model that scores a block of new
decoder inputs in ONE forward pass on top of its incremental (KV) state.

fairseq's own incremental decoder reads only the last input token, so block scoring has its own
short forward through the stock decoder layers: token and position embeddings for the block,
a self-attention mask that shows every row its cached prefix and, inside the block, only earlier
block positions (causal).

Rollback representation (one, used everywhere): per-row valid length plus key padding. In every
decoder layer's self-attention cache, row b holds the keys/values of its first ``fed_lengths[b]``
decoder inputs in slots ``[0, fed_lengths[b])``; slots after that, up to the longest row, are
holes marked in ``prev_key_padding_mask``. ``commit`` keeps the first n block entries of each row
and gathers them right behind the row's valid slots, so holes never accumulate and a rejected
entry is never seen again. Encoder-attention entries (``static_kv``) are never touched.
"""

from typing import Dict, Optional

import torch
from fairseq.models.transformer import TransformerDecoderBase
from torch import Tensor

from spec_nmt.errors import SpecNmtError


class VerifierState:
    """Per-batch decoding state of the verifier: encoder output, KV cache, fed lengths."""

    def __init__(self, encoder_out: Dict, fed_lengths: Tensor):
        self.encoder_out = encoder_out
        self.incremental_state: Dict[str, Dict[str, Optional[Tensor]]] = {}
        self.fed_lengths = fed_lengths  # [B] decoder inputs whose keys/values are cached
        self.cached_slots = 0  # cache width before the block being scored


class TransformerVerifier:
    """Wraps a fairseq ``TransformerModel`` (any checkpoint trained with ``--task translation``)."""

    def __init__(self, model, temperature: float = 1.0):
        decoder = getattr(model, "decoder", None)
        if (
            not isinstance(decoder, TransformerDecoderBase)
            or getattr(model, "encoder", None) is None
        ):
            raise SpecNmtError(
                "the verifier (--path) must be a fairseq Transformer encoder-decoder translation "
                f"model, got {type(model).__name__}"
            )
        if decoder.cross_self_attention or decoder.adaptive_softmax is not None:
            raise SpecNmtError(
                "the verifier uses --cross-self-attention or an adaptive softmax, "
                "which block scoring does not support"
            )
        self.model = model
        self.decoder = decoder
        self.temperature = temperature
        self._position_table: Optional[Tensor] = None

    def max_positions(self) -> int:
        return self.decoder.max_positions()

    def start(self, net_input: Dict[str, Tensor]) -> VerifierState:
        """Run the encoder once for the batch; nothing is cached for the decoder yet."""
        encoder_out = self.model.encoder.forward_torchscript(net_input)
        batch = net_input["src_tokens"].size(0)
        fed = torch.zeros(batch, dtype=torch.long, device=net_input["src_tokens"].device)
        return VerifierState(encoder_out, fed)

    def score_block(self, state: VerifierState, block_tokens: Tensor) -> Tensor:
        """Log-probs [B, W, V] of the next token after each of the W block inputs [B, W].

        Block position i of row b sits at decoder position ``fed_lengths[b] + i``. The block's
        keys/values are appended to the cache; ``commit`` decides which of them stay.
        """
        dec = self.decoder
        width = block_tokens.size(1)
        state.cached_slots = _cache_width(dec, state.incremental_state)

        x = dec.embed_scale * dec.embed_tokens(block_tokens)
        if dec.quant_noise is not None:
            x = dec.quant_noise(x)
        if dec.project_in_dim is not None:
            x = dec.project_in_dim(x)
        if dec.embed_positions is not None:
            offsets = torch.arange(width, device=block_tokens.device)
            x = x + self._position_embeddings(state.fed_lengths.unsqueeze(1) + offsets)
        if dec.layernorm_embedding is not None:
            x = dec.layernorm_embedding(x)
        x = dec.dropout_module(x).transpose(0, 1)

        attn_mask = x.new_zeros(width, state.cached_slots + width)
        attn_mask[:, state.cached_slots :] = torch.triu(
            torch.full((width, width), float("-inf"), dtype=x.dtype, device=x.device), 1
        )
        enc = state.encoder_out["encoder_out"][0]
        enc_padding = state.encoder_out["encoder_padding_mask"]
        enc_padding = enc_padding[0] if len(enc_padding) > 0 else None
        for layer in dec.layers:
            x, _, _ = layer(x, enc, enc_padding, state.incremental_state, self_attn_mask=attn_mask)
        if dec.layer_norm is not None:
            x = dec.layer_norm(x)
        x = x.transpose(0, 1)
        if dec.project_out_dim is not None:
            x = dec.project_out_dim(x)
        logits = dec.output_layer(x)
        if self.temperature != 1.0:
            logits = logits / self.temperature
        return dec.get_normalized_probs((logits, None), log_probs=True)

    def commit(self, state: VerifierState, n_keep: Tensor) -> None:
        """Keep the first ``n_keep[b]`` entries of the block just scored for row b; drop the rest."""
        old_fed = state.fed_lengths
        new_fed = old_fed + n_keep
        width = int(new_fed.max())
        slots = torch.arange(width, device=n_keep.device).unsqueeze(0)
        valid = slots < new_fed.unsqueeze(1)  # [B, width]
        # Row b's slot j < old_fed[b] is where it was; later slots come from the block.
        source = torch.where(
            slots < old_fed.unsqueeze(1), slots, state.cached_slots + slots - old_fed.unsqueeze(1)
        )
        source = torch.where(valid, source, torch.zeros_like(source))
        contiguous = bool(valid.all()) and bool(old_fed.eq(state.cached_slots).all())
        for layer in self.decoder.layers:
            attn = layer.self_attn
            buffer = attn._get_input_buffer(state.incremental_state)
            for name in ("prev_key", "prev_value"):
                cached = buffer[name]  # [B, heads, slots, head_dim]
                if contiguous:  # batch of one, or every row kept the same: a plain crop
                    buffer[name] = cached[:, :, :width]
                else:
                    index = source[:, None, :, None].expand(-1, cached.size(1), -1, cached.size(3))
                    buffer[name] = cached.gather(2, index)
            buffer["prev_key_padding_mask"] = None if contiguous else ~valid
            attn._set_input_buffer(state.incremental_state, buffer)
        state.fed_lengths = new_fed

    def select_rows(self, state: VerifierState, rows: Tensor) -> None:
        """Keep only ``rows`` of the batch (finished sentences leave), in cache and encoder output."""
        self.decoder.reorder_incremental_state_scripting(state.incremental_state, rows)
        state.encoder_out = self.model.encoder.reorder_encoder_out(state.encoder_out, rows)
        state.fed_lengths = state.fed_lengths.index_select(0, rows)

    def _position_embeddings(self, positions: Tensor) -> Tensor:
        """Position embeddings [B, W, C] for 0-based decoder positions [B, W].

        Built from the decoder's own positional module (learned or sinusoidal alike). Positions
        past the model's limit are clamped: they only occur after a forced EOS, and causal
        attention keeps them from touching earlier positions.
        """
        needed = int(positions.max()) + 1
        limit = self.decoder.max_positions()
        if self._position_table is None or self._position_table.size(0) < min(needed, limit):
            length = min(max(needed, 256), limit)
            non_pad = self.decoder.padding_idx + 1
            dummy = positions.new_full((1, length), non_pad)
            self._position_table = self.decoder.embed_positions(dummy)[0]
        return self._position_table[positions.clamp(max=self._position_table.size(0) - 1)]


def _cache_width(decoder: TransformerDecoderBase, incremental_state) -> int:
    buffer = decoder.layers[0].self_attn._get_input_buffer(incremental_state)
    prev_key = buffer.get("prev_key")
    return 0 if prev_key is None else prev_key.size(2)
