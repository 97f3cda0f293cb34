"""The verifier adapter: a stock fairseq Transformer translation model that scores a block of new
decoder inputs in ONE forward pass on top of its incremental (KV) state. The same adapter runs an
autoregressive drafter (a small stock Transformer), whose drafts are blocks and trees too.

fairseq's own incremental decoder reads only the last input token and its attention takes one
mask for the whole batch, so block scoring has its own short forward through the stock decoder
layers' modules: token and position embeddings for the block, then per layer a self-attention
over the cache with a per-row mask (``_cached_self_attention``), the stock encoder attention and
feed-forward. A block may be a chain (causal inside the block) or a draft tree (each entry sees
the cached prefix and its ancestors only; positions by depth).

Rollback representation (one, used everywhere): per-row valid length. In every decoder layer's
self-attention cache, row b holds the keys/values of its first ``fed_lengths[b]`` committed
decoder inputs in slots ``[0, fed_lengths[b])``; slots after that, up to ``committed_width``, are
holes that no query sees. Entries of blocks scored since the last commit sit after
``committed_width`` and are seen only where the block's visibility says so. ``commit`` gathers the
kept block entries of each row right behind its valid slots, so holes never accumulate and a
rejected entry is never seen again. Encoder-attention entries (``static_kv``) are never touched.
"""

from typing import Dict, Optional

import torch
from fairseq.models.transformer import TransformerDecoderBase
from torch import Tensor

from spec_nmt.errors import SpecNmtError
from spec_nmt.models.spec_drafter import SpecDrafterModel


class VerifierState:
    """Per-batch decoding state: encoder output, KV cache, committed and uncommitted entries."""

    def __init__(self, encoder_out: Dict, fed_lengths: Tensor):
        self.encoder_out = encoder_out
        self.incremental_state: Dict[str, Dict[str, Optional[Tensor]]] = {}
        self.fed_lengths = fed_lengths  # [B] committed decoder inputs per row
        self.committed_width = 0  # cache slots holding committed entries (and holes)
        self.uncommitted = 0  # block entries scored since the last commit


class TransformerVerifier:
    """Wraps a fairseq ``TransformerModel`` (any checkpoint trained with ``--task translation``)."""

    def __init__(self, model, temperature: float = 1.0, role: str = "the verifier (--path)"):
        decoder = getattr(model, "decoder", None)
        if (
            not isinstance(decoder, TransformerDecoderBase)
            or getattr(model, "encoder", None) is None
        ):
            raise SpecNmtError(
                f"{role} must be a fairseq Transformer encoder-decoder translation "
                f"model, got {type(model).__name__}"
            )
        if isinstance(model, SpecDrafterModel):
            raise SpecNmtError(
                f"{role} is a Spec-Drafter, not a verifier: the verifier is the Transformer "
                "trained with --task translation (--path, verifier.pt), the drafter goes to "
                "--drafter-path (drafter.pt)"
            )
        unsupported = decoder.cross_self_attention or decoder.adaptive_softmax is not None
        for layer in decoder.layers:
            attn = layer.self_attn
            unsupported |= attn.bias_k is not None or attn.add_zero_attn
            unsupported |= getattr(attn, "rotary_pos_embed", None) is not None
        if unsupported:
            raise SpecNmtError(
                f"{role} uses --cross-self-attention, an adaptive softmax or extra attention "
                "keys, which block scoring does not support"
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

    def score_block(
        self,
        state: VerifierState,
        block_tokens: Tensor,  # [B, W]
        depths: Optional[Tensor] = None,  # [W] or [B, W]; default 0 .. W-1
        visible: Optional[Tensor] = None,  # [B, W, U+W] bool over uncommitted entries
    ) -> Tensor:
        """Log-probs [B, W, V] of the next token after each of the W block inputs.

        Block entry i of row b sits at decoder position ``fed_lengths[b] + depths[i]`` and sees
        the row's committed prefix plus the uncommitted entries (U from earlier blocks since the
        last commit, then this block's) that ``visible`` marks; by default a causal chain.
        The block's keys/values are appended to the cache; ``commit`` decides which stay.
        """
        dec = self.decoder
        batch, width = block_tokens.shape
        device = block_tokens.device
        if depths is None:
            depths = torch.arange(width, device=device)
        if visible is None:
            causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
            earlier = torch.ones(width, state.uncommitted, dtype=torch.bool, device=device)
            visible = torch.cat([earlier, causal], dim=1).expand(batch, -1, -1)

        x = dec.embed_scale * dec.embed_tokens(block_tokens)
        if dec.quant_noise is not None:
            x = dec.quant_noise(x)
        if dec.project_in_dim is not None:
            x = dec.project_in_dim(x)
        if dec.embed_positions is not None:
            x = x + self._position_embeddings(state.fed_lengths.unsqueeze(1) + depths)
        if dec.layernorm_embedding is not None:
            x = dec.layernorm_embedding(x)
        x = dec.dropout_module(x).transpose(0, 1)

        slots = torch.arange(state.committed_width, device=device)
        committed = (slots < state.fed_lengths.unsqueeze(1)).unsqueeze(1).expand(-1, width, -1)
        seen = torch.cat([committed, visible], dim=2)  # [B, W, all cache slots]
        bias = torch.zeros(seen.shape, dtype=x.dtype, device=device)
        bias = bias.masked_fill(~seen, float("-inf")).unsqueeze(1)  # [B, 1, W, slots]
        enc = state.encoder_out["encoder_out"][0]
        enc_padding = state.encoder_out["encoder_padding_mask"]
        enc_padding = enc_padding[0] if len(enc_padding) > 0 else None
        for layer in dec.layers:
            x = _decoder_layer(layer, x, enc, enc_padding, state.incremental_state, bias)
        if dec.layer_norm is not None:
            x = dec.layer_norm(x)
        x = x.transpose(0, 1)
        if dec.project_out_dim is not None:
            x = dec.project_out_dim(x)
        logits = dec.output_layer(x)
        if self.temperature != 1.0:
            logits = logits / self.temperature
        state.uncommitted += width
        return dec.get_normalized_probs((logits, None), log_probs=True)

    def commit(self, state: VerifierState, keep: Tensor, n_keep: Tensor) -> None:
        """Row b keeps its uncommitted entries ``keep[b, :n_keep[b]]`` (indices in scoring
        order, e.g. the root and the accepted path of a draft tree); all others are dropped."""
        old_fed = state.fed_lengths
        new_fed = old_fed + n_keep
        width = int(new_fed.max())
        slots = torch.arange(width, device=n_keep.device).unsqueeze(0)
        valid = slots < new_fed.unsqueeze(1)  # [B, width]
        offset = (slots - old_fed.unsqueeze(1)).clamp(min=0, max=max(keep.size(1) - 1, 0))
        kept_slot = state.committed_width + keep.gather(1, offset) if keep.numel() else offset
        # Row b's slot j < old_fed[b] is where it was; later slots come from the kept entries.
        source = torch.where(slots < old_fed.unsqueeze(1), slots, kept_slot)
        source = torch.where(valid, source, torch.zeros_like(source))
        crop = bool(source.eq(slots).all())  # batch of one, or every row kept the same prefix
        for layer in self.decoder.layers:
            attn = layer.self_attn
            buffer = attn._get_input_buffer(state.incremental_state)
            for name in ("prev_key", "prev_value"):
                cached = buffer[name]  # [B, heads, slots, head_dim]
                if crop:
                    buffer[name] = cached[:, :, :width]
                else:
                    index = source[:, None, :, None].expand(-1, cached.size(1), -1, cached.size(3))
                    buffer[name] = cached.gather(2, index)
            attn._set_input_buffer(state.incremental_state, buffer)
        state.fed_lengths = new_fed
        state.committed_width = width
        state.uncommitted = 0

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


def _decoder_layer(layer, x: Tensor, enc, enc_padding, incremental_state, bias: Tensor) -> Tensor:
    """A stock ``TransformerDecoderLayerBase`` step for a block [W, B, C] whose self-attention
    takes a per-row additive mask ``bias`` [B, 1, W, slots]; everything else is the layer's own."""
    residual = x
    if layer.normalize_before:
        x = layer.self_attn_layer_norm(x)
    x = _cached_self_attention(layer.self_attn, x, incremental_state, bias)
    if layer.c_attn is not None:
        heads = layer.c_attn.numel()
        x = (x.view(*x.shape[:2], heads, -1) * layer.c_attn.view(heads, 1)).flatten(2)
    if layer.attn_ln is not None:
        x = layer.attn_ln(x)
    x = layer.residual_connection(layer.dropout_module(x), residual)
    if not layer.normalize_before:
        x = layer.self_attn_layer_norm(x)

    if layer.encoder_attn is not None and enc is not None:
        residual = x
        if layer.normalize_before:
            x = layer.encoder_attn_layer_norm(x)
        x, _ = layer.encoder_attn(
            query=x, key=enc, value=enc, key_padding_mask=enc_padding,
            incremental_state=incremental_state, static_kv=True, need_weights=False,
        )  # fmt: skip
        x = layer.residual_connection(layer.dropout_module(x), residual)
        if not layer.normalize_before:
            x = layer.encoder_attn_layer_norm(x)

    residual = x
    if layer.normalize_before:
        x = layer.final_layer_norm(x)
    x = layer.activation_dropout_module(layer.activation_fn(layer.fc1(x)))
    if layer.ffn_layernorm is not None:
        x = layer.ffn_layernorm(x)
    x = layer.dropout_module(layer.fc2(x))
    if layer.w_resid is not None:
        residual = torch.mul(layer.w_resid, residual)
    x = layer.residual_connection(x, residual)
    if not layer.normalize_before:
        x = layer.final_layer_norm(x)
    return x


def _cached_self_attention(attn, x: Tensor, incremental_state, bias: Tensor) -> Tensor:
    """fairseq ``MultiheadAttention`` self-attention for block x [W, B, C] on its KV cache,
    with a per-row mask (the stock module takes one mask for all rows). Appends the block's
    keys/values to the cache, in the module's own buffer layout [B, heads, slots, head_dim]."""
    width, batch, channels = x.shape
    heads, head_dim = attn.num_heads, attn.head_dim

    def split_heads(t: Tensor) -> Tensor:
        return t.view(width, batch, heads, head_dim).permute(1, 2, 0, 3)

    query = split_heads(attn.q_proj(x) * attn.scaling)
    key, value = split_heads(attn.k_proj(x)), split_heads(attn.v_proj(x))
    buffer = attn._get_input_buffer(incremental_state)
    if buffer.get("prev_key") is not None:
        key = torch.cat([buffer["prev_key"], key], dim=2)
        value = torch.cat([buffer["prev_value"], value], dim=2)
    buffer["prev_key"], buffer["prev_value"] = key, value
    buffer["prev_key_padding_mask"] = None
    attn._set_input_buffer(incremental_state, buffer)

    weights = torch.matmul(query, key.transpose(2, 3)) + bias  # [B, heads, W, slots]
    probs = torch.softmax(weights.float(), dim=-1).type_as(weights)
    out = torch.matmul(attn.dropout_module(probs), value)  # [B, heads, W, head_dim]
    return attn.out_proj(out.permute(2, 0, 1, 3).reshape(width, batch, channels))
