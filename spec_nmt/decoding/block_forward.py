"""A stock fairseq ``TransformerDecoderBase`` run over a block of entries with explicit positions
and any per-row visibility between them, through the decoder's own modules (with ``project``,
decoding's packed linear products); and the stock encoder's forward with its layers run by
``scripted_layers``.

fairseq's decoder knows two attention patterns, causal (training, incremental decoding) and full
(``full_context_alignment``), each the same for every row. Block scoring on a cache (the verifier
and the autoregressive drafter), tree attention and the cached drafter's prefix-plus-masks pattern
need a per-row mask, so these functions redo the decoder's forward with their own attention
(``scripted_layers.attention``) and leave every weight, norm and activation to the stock
modules. Training (the cached drafter) and decoding share them; decoding runs the common decoder
layers through ``scripted_layers`` instead.
"""

from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spec_nmt.decoding import scripted_layers
from spec_nmt.decoding.scripted_layers import ScriptedLayers
from spec_nmt.errors import SpecNmtError

# (layer's self-attention module, block queries' input [W, B, C]) -> attention output [W, B, C]
SelfAttention = Callable[[object, Tensor], Tensor]


class Project(Protocol):
    """How the forwards apply the model's linear layers (decoding passes
    spec_nmt.decoding.linears.PackedLinears)."""

    def __call__(self, linear: nn.Module, x: Tensor) -> Tensor:
        """The layer's output for x."""

    def many(self, linears: Tuple[nn.Module, ...], x: Tensor) -> List[Tensor]:
        """Several layers' outputs for the same x (an attention's query, key and value)."""


class OwnLinears:
    """Linear layers called as they are (training)."""

    def __call__(self, linear: nn.Module, x: Tensor) -> Tensor:
        return linear(x)

    def many(self, linears: Tuple[nn.Module, ...], x: Tensor) -> List[Tensor]:
        return [linear(x) for linear in linears]


plain = OwnLinears()


class RealTokens:
    """The non-padding tokens of a [S, B] layout: the encoder output's keys and values are
    projected for their rows only, [N, C], and unpacked to the padded layout (in a batch of
    mixed lengths that skips the padding's share of the work)."""

    def __init__(self, padding: Tensor):  # [B, S] bool, True at padding
        self.shape = padding.t().shape
        self.index = (~padding).t().flatten().nonzero().squeeze(1)

    def pack(self, x: Tensor) -> Tensor:
        """[S, B, C] → [N, C], the real tokens' rows."""
        return x.flatten(0, 1).index_select(0, self.index)

    def unpack(self, x: Tensor) -> Tensor:
        """[N, C] → [S, B, C], zeros at the padding."""
        full = x.new_zeros(self.shape[0] * self.shape[1], x.size(-1))
        return full.index_copy_(0, self.index, x).view(*self.shape, x.size(-1))


def encode(encoder, src_tokens: Tensor, scripted: ScriptedLayers,
           without_host: bool = False) -> Dict[str, List[Tensor]]:  # fmt: skip
    """The stock encoder's output for ``src_tokens`` (fairseq's ``encoder_out`` dict) with its
    layers run by ``encoder_layers`` (``scripted``: the encoder's layers taken for it, see
    ``scripted_layers.encoder_supported``): the embedding and the final norm as the encoder does
    them, the layers on the non-padding tokens only. The output is zero at the padding (which
    every reader masks; the stock encoder leaves values there that nothing may use).
    ``without_host``: never ask the device whether there is padding (a GPU's host would wait):
    the layers run over the padded layout under the padding's mask, as Python (the kernels a
    CUDA graph may capture), and the output at the padding is left as it comes."""
    padding = src_tokens.eq(encoder.padding_idx)
    x, embedding = encoder.forward_embedding(src_tokens)  # [B, S, C]
    batch, length, channels = x.shape
    bias, real = None, None
    layers = scripted_layers.encoder_layers_scripted
    if without_host:  # (Python: the kernels a CUDA graph may capture)
        layers = scripted_layers.encoder_layers
    if without_host or bool(padding.any()):
        bias = additive_mask(~padding.unsqueeze(1), x.dtype)
        if not without_host:  # the layers' rows: the real tokens only
            real = (~padding).flatten().nonzero().squeeze(1)
    x = layers(
        x, scripted.layers, scripted.packed(batch * length if real is None else real.numel()),
        bias, real, scripted.heads, scripted.scaling, scripted.eps, scripted.normalize_before,
        scripted.gelu)
    if encoder.layer_norm is not None:
        x = encoder.layer_norm(x)
    if real is not None:
        x = x.new_zeros(batch * length, channels).index_copy_(0, real, x)
    x = x.view(batch, length, channels).transpose(0, 1)  # [S, B, C]
    lengths = (~padding).sum(dim=1, dtype=torch.int32).reshape(-1, 1)
    return {"encoder_out": [x], "encoder_padding_mask": [padding],
            "encoder_embedding": [embedding], "encoder_states": [], "fc_results": [],
            "src_tokens": [], "src_lengths": [lengths]}  # fmt: skip


def check_supported(decoder, role: str) -> None:
    """Refuse a decoder whose forward these functions do not reproduce; ``role`` names the
    model in the error."""
    unsupported = decoder.cross_self_attention or decoder.adaptive_softmax is not None
    for attn in [m for layer in decoder.layers for m in (layer.self_attn, layer.encoder_attn)]:
        if attn is not None:
            unsupported |= scripted_layers.unusual_attention(attn)
    if unsupported:
        raise SpecNmtError(
            f"{role} uses --cross-self-attention, an adaptive softmax or extra attention "
            "keys, which block scoring does not support"
        )


def split_heads(x: Tensor, heads: int) -> Tensor:
    """[T, B, C] → [B, heads, T, head_dim]."""
    length, batch, channels = x.shape
    return x.view(length, batch, heads, channels // heads).permute(1, 2, 0, 3)


def merge_heads(x: Tensor) -> Tensor:
    """[B, heads, T, head_dim] → [T, B, C]."""
    batch, heads, length, head_dim = x.shape
    return x.permute(2, 0, 1, 3).reshape(length, batch, heads * head_dim)


def additive_mask(seen: Tensor, dtype: torch.dtype) -> Tensor:
    """Bool visibility [B, W, S] → additive attention mask [B, 1, W, S] (0 or -inf)."""
    bias = torch.zeros(seen.shape, dtype=dtype, device=seen.device)
    return bias.masked_fill(~seen, float("-inf")).unsqueeze(1)


def attend(attn, query: Tensor, keys: Tensor, values: Tensor, bias: Optional[Tensor],
           project: Project = plain) -> Tensor:  # fmt: skip
    """Scaled dot-product attention of fairseq ``MultiheadAttention`` ``attn`` on split heads,
    with its scaling and (in training) its attention dropout; returns [T, B, C] after out_proj."""
    return project(attn.out_proj, _attention(attn, query, keys, values, bias))


def _attention(attn, query: Tensor, keys: Tensor, values: Tensor,
               bias: Optional[Tensor]) -> Tensor:  # fmt: skip
    """``attend`` before out_proj: the heads merged, [T, B, C]. ``bias`` is an additive float
    mask (0 or -inf) under which every query sees at least one key."""
    dropout = attn.dropout_module.p if attn.training else 0.0
    if dropout == 0.0:
        out = scripted_layers.attention(query, keys, values, bias, attn.scaling)
    else:
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=bias,
                                             dropout_p=dropout, scale=attn.scaling)  # fmt: skip
    return merge_heads(out)


def encoder_keys_values(
    decoder, encoder_out, project: Project = plain, layers: Optional[Sequence] = None,
    without_host: bool = False,
) -> Tuple[List[Tensor], List[Tensor], Optional[Tensor]]:
    """Every layer's (or every one of ``layers``') encoder-attention keys and values
    [B, heads, S, head_dim] (layers without encoder attention have none) and the source padding
    as an additive mask [B, 1, 1, S]. ``without_host``: never ask the device whether there is
    padding: every source position is projected, and the mask is always made."""
    enc = encoder_out["encoder_out"][0]  # [S, B, C]
    padding = encoder_out["encoder_padding_mask"]
    bias, tokens = None, None
    if len(padding) > 0 and (without_host or padding[0].any()):
        bias = additive_mask(~padding[0].unsqueeze(1), enc.dtype)
        if not without_host:  # project the real tokens only (zeros elsewhere)
            tokens = RealTokens(padding[0])
            enc = tokens.pack(enc)
    keys, values = [], []
    for layer in decoder.layers if layers is None else layers:
        attn = layer.encoder_attn
        if attn is not None:
            for projection, out in ((attn.k_proj, keys), (attn.v_proj, values)):
                x = project(projection, enc)
                if tokens is not None:
                    x = tokens.unpack(x)
                out.append(split_heads(x, attn.num_heads).contiguous())
    return keys, values, bias


def position_table(decoder, length: int) -> Tensor:
    """The decoder's position embeddings [length, C] for 0-based positions 0 .. length-1, from
    its own positional module (learned or sinusoidal alike)."""
    non_pad = decoder.padding_idx + 1
    dummy = torch.full(
        (1, length), non_pad, dtype=torch.long, device=decoder.embed_tokens.weight.device
    )
    return decoder.embed_positions(dummy)[0]


def embed(decoder, tokens: Tensor, positions: Tensor, table: Optional[Tensor] = None,
          inputs: Optional[Tensor] = None) -> Tensor:  # fmt: skip
    """Decoder input [W, B, C] for tokens [B, W] at 0-based positions [B, W] (or [W]).
    ``table`` is a position table built earlier (decoding); without it one is built now, so
    learned positions get their gradient (training). ``inputs`` [B, W, C]: the entries' vectors
    in place of the tokens' scaled embeddings (the feature drafter's)."""
    x = decoder.embed_scale * decoder.embed_tokens(tokens) if inputs is None else inputs
    if decoder.quant_noise is not None:
        x = decoder.quant_noise(x)
    if decoder.project_in_dim is not None:
        x = decoder.project_in_dim(x)
    if decoder.embed_positions is not None:
        if table is None:
            table = position_table(decoder, min(int(positions.max()) + 1, decoder.max_positions()))
        # Positions past the limit are clamped: they only occur after a forced EOS.
        x = x + table[positions.clamp(max=table.size(0) - 1)]
    if decoder.layernorm_embedding is not None:
        x = decoder.layernorm_embedding(x)
    return decoder.dropout_module(x).transpose(0, 1)


def layers(decoder, x: Tensor, self_attention: Callable[[int], SelfAttention],
           encoder_keys: List[Tensor], encoder_values: List[Tensor],
           encoder_bias: Optional[Tensor], project: Project = plain) -> Tensor:  # fmt: skip
    """Every decoder layer over x [W, B, C], layer i's self-attention given by
    ``self_attention(i)``, then the decoder's final norm: features [B, W, C]."""
    encoder_layer = 0
    for i, layer in enumerate(decoder.layers):
        encoder_kv = None
        if layer.encoder_attn is not None and encoder_keys:
            encoder_kv = (encoder_keys[encoder_layer], encoder_values[encoder_layer])
            encoder_layer += 1
        x = _layer(layer, x, self_attention(i), encoder_kv, encoder_bias, project)
    if decoder.layer_norm is not None:
        x = decoder.layer_norm(x)
    x = x.transpose(0, 1)
    if decoder.project_out_dim is not None:
        x = project(decoder.project_out_dim, x)
    return x


def _sublayer(layer, norm, x: Tensor, block: Callable[[Tensor], Tensor],
              residual_scale: Optional[Tensor] = None) -> Tensor:  # fmt: skip
    """A stock layer's residual sub-block: ``norm`` before ``block`` (pre-norm) or after the
    residual sum (post-norm); ``residual_scale`` (--scale-resids) scales the residual."""
    residual = x
    if layer.normalize_before:
        x = norm(x)
    x = block(x)
    if residual_scale is not None:
        residual = torch.mul(residual_scale, residual)
    x = layer.residual_connection(x, residual)
    if not layer.normalize_before:
        x = norm(x)
    return x


def _feed_forward(layer, x: Tensor, project: Project) -> Tensor:
    """A stock layer's feed-forward block, dropout included (its optional norm: --scale-fc)."""
    x = layer.activation_dropout_module(layer.activation_fn(project(layer.fc1, x)))
    if getattr(layer, "ffn_layernorm", None) is not None:
        x = layer.ffn_layernorm(x)
    return layer.dropout_module(project(layer.fc2, x))


def _layer(layer, x: Tensor, self_attention: SelfAttention, encoder_kv, encoder_bias,
           project: Project) -> Tensor:  # fmt: skip
    """One stock ``TransformerDecoderLayerBase`` over x [W, B, C]."""

    def attend_self(x: Tensor) -> Tensor:
        x = self_attention(layer.self_attn, x)
        if layer.c_attn is not None:
            heads = layer.c_attn.numel()
            x = (x.view(*x.shape[:2], heads, -1) * layer.c_attn.view(heads, 1)).flatten(2)
        if layer.attn_ln is not None:
            x = layer.attn_ln(x)
        return layer.dropout_module(x)

    def attend_source(x: Tensor) -> Tensor:
        attn = layer.encoder_attn
        query = split_heads(project(attn.q_proj, x), attn.num_heads)
        return layer.dropout_module(attend(attn, query, *encoder_kv, encoder_bias, project))

    x = _sublayer(layer, layer.self_attn_layer_norm, x, attend_self)
    if encoder_kv is not None:
        x = _sublayer(layer, layer.encoder_attn_layer_norm, x, attend_source)
    return _sublayer(layer, layer.final_layer_norm, x,
                     lambda x: _feed_forward(layer, x, project), layer.w_resid)  # fmt: skip
