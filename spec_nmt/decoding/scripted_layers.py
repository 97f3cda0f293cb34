"""The decoder layers of block scoring, and the encoder's layers, each as one TorchScript
function over plain tensors.

``block_forward`` runs a block through the stock decoder's modules: per layer a few dozen module
calls, each with Python around a small product. When the block is one entry of one sentence, that
Python costs more than the arithmetic. For the common layers (pre- or post-norm, ReLU or GELU,
encoder attention in every decoder layer, none of NormFormer's extras) ``ScriptedLayers`` takes
the layers' tensors once and runs the same products, norms and attention in one call of
``decoder_layers_scripted`` or ``encoder_layers_scripted`` (the functions below compiled by
TorchScript: without the Python between their operations). Other layers, and training (dropout,
gradients), keep the stock modules; the tests hold the two to the same outputs.
"""

import logging
import warnings
from typing import List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from fairseq import utils
from fairseq.models.transformer import TransformerEncoderBase
from fairseq.modules.transformer_layer import (
    TransformerDecoderLayer,
    TransformerDecoderLayerBase,
    TransformerEncoderLayer,
    TransformerEncoderLayerBase,
)
from torch import Tensor, nn

from spec_nmt.decoding.linears import PackedLinears

logger = logging.getLogger(__name__)

# From this many queries per head (batch x queries) attention on the CPU runs as two batched
# products around a softmax: scaled_dot_product_attention's CPU kernel pays per row and head,
# while one sentence's few queries are faster through it (docs/lab-notes.md, "Attention through
# batched products").
MATMUL_ATTENTION_ROWS = 12

# the activations decoder_layers computes: ReLU, and fairseq's GELU (in fp32)
ACTIVATIONS = (utils.get_activation_fn("relu"), utils.get_activation_fn("gelu"))


def script(function):
    """``torch.jit.script`` without its deprecation warning (torch is pinned; torch.compile,
    its successor, lost to it here: docs/lab-notes.md, "What a block costs the verifier"); None
    where this torch cannot compile it (no oneDNN products): decoding then keeps the modules."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            return torch.jit.script(function)
        except RuntimeError as error:
            logger.warning("the layers run through the stock modules: %s",
                           str(error).strip().splitlines()[0])  # fmt: skip
            return None


def attention(query: Tensor, keys: Tensor, values: Tensor, bias: Optional[Tensor], scaling: float,
              matmul_rows: int = MATMUL_ATTENTION_ROWS) -> Tensor:  # fmt: skip
    """Scaled dot-product attention of split heads [B, heads, T, head_dim] without dropout;
    ``bias`` is an additive mask (0 or -inf) under which every query sees at least one key.
    (``matmul_rows`` is a default argument because TorchScript reads no module constants.)"""
    if (query.device.type == "cpu" and query.dtype == torch.float32
            and query.size(0) * query.size(2) >= matmul_rows):  # fmt: skip
        weights = torch.matmul(query * scaling, keys.transpose(-1, -2))
        if bias is not None:
            weights.add_(bias)
        return torch.matmul(weights.softmax(dim=-1), values)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=bias, scale=scaling)


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], packed: Optional[Tensor]) -> Tensor:
    """``F.linear``, or the oneDNN product of ``packed``, the weight's packed copy."""
    if packed is not None:
        no_scalars: List[Optional[Union[int, float, complex]]] = []
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", no_scalars, "")
    return F.linear(x, weight, bias)


def _split_heads(x: Tensor, heads: int) -> Tensor:
    """[B, T, C] → [B, heads, T, head_dim]."""
    return x.view(x.size(0), x.size(1), heads, -1).transpose(1, 2)


def _feed_forward(x: Tensor, p: List[Tensor], k: List[Optional[Tensor]], block: int, eps: float,
                  normalize_before: bool, gelu: bool) -> Tensor:  # fmt: skip
    """A layer's feed-forward sub-block with its residual and norm: sub-block ``block`` of the
    layer's tensors (its norm, fc1 and fc2: ``p[6 * block:]``, packed ``k[2 * block:]``)."""
    n, channels = 6 * block, x.size(-1)
    h = F.layer_norm(x, [channels], p[n], p[n + 1], eps) if normalize_before else x
    h = linear(h, p[n + 2], p[n + 3], k[2 * block])
    h = F.gelu(h.float()).type_as(h) if gelu else F.relu(h)
    x = x + linear(h, p[n + 4], p[n + 5], k[2 * block + 1])
    return x if normalize_before else F.layer_norm(x, [channels], p[n], p[n + 1], eps)


def decoder_layers(x: Tensor, layers: List[List[Tensor]], packed: List[List[Optional[Tensor]]],
                   keys: List[Tensor], values: List[Tensor], first_slot: int,
                   slots: Optional[Tensor], span: int, bias: Tensor, encoder_keys: List[Tensor],
                   encoder_values: List[Tensor], encoder_bias: Optional[Tensor], heads: int,
                   scaling: float, eps: float, normalize_before: bool,
                   gelu: bool) -> Tensor:  # fmt: skip
    """The layers over an embedded block x [B, W, C]. Each layer writes the block's keys and
    values into its cache [B, heads, capacity, head_dim] at ``first_slot`` (every row alike) or
    at ``slots`` [B, W], and its queries see the first ``span`` slots under ``bias``."""
    batch, width, channels = x.shape
    for i in range(len(layers)):
        p = layers[i]
        k = packed[i]

        residual = x
        h = F.layer_norm(x, [channels], p[0], p[1], eps) if normalize_before else x
        query, key, value = linear(h, p[2], p[3], k[0]).split(channels, dim=-1)
        key, value = _split_heads(key, heads), _split_heads(value, heads)
        if slots is None:
            keys[i][:, :, first_slot : first_slot + width] = key
            values[i][:, :, first_slot : first_slot + width] = value
        else:
            index = slots[:, None, :, None].expand(-1, heads, -1, key.size(3))
            keys[i].scatter_(2, index, key)
            values[i].scatter_(2, index, value)
        h = attention(_split_heads(query, heads), keys[i][:, :, :span], values[i][:, :, :span],
                      bias, scaling)  # fmt: skip
        x = residual + linear(h.transpose(1, 2).reshape(batch, width, channels), p[4], p[5], k[1])
        if not normalize_before:
            x = F.layer_norm(x, [channels], p[0], p[1], eps)

        residual = x
        h = F.layer_norm(x, [channels], p[6], p[7], eps) if normalize_before else x
        query = _split_heads(linear(h, p[8], p[9], k[2]), heads)
        h = attention(query, encoder_keys[i], encoder_values[i], encoder_bias, scaling)
        x = residual + linear(h.transpose(1, 2).reshape(batch, width, channels), p[10], p[11],
                               k[3])  # fmt: skip
        if not normalize_before:
            x = F.layer_norm(x, [channels], p[6], p[7], eps)

        x = _feed_forward(x, p, k, 2, eps, normalize_before, gelu)
    return x


def encoder_layers(x: Tensor, layers: List[List[Tensor]], packed: List[List[Optional[Tensor]]],
                   bias: Optional[Tensor], real: Optional[Tensor], heads: int, scaling: float,
                   eps: float, normalize_before: bool, gelu: bool) -> Tensor:  # fmt: skip
    """The encoder layers over the embedded source x [B, S, C]; ``bias`` masks the padding
    [B, 1, 1, S]. With ``real``, the flat indices of the non-padding tokens in B x S, the
    products, norms and residuals run on those rows only [N, C] (attention on the padded
    layout) and so does the output; else it is [B, S, C]."""
    batch, length, channels = x.shape
    if real is not None:
        x = x.reshape(batch * length, channels).index_select(0, real)
    for i in range(len(layers)):
        p = layers[i]
        k = packed[i]

        residual = x
        h = F.layer_norm(x, [channels], p[0], p[1], eps) if normalize_before else x
        projected = linear(h, p[2], p[3], k[0])
        if real is not None:
            rows = projected.new_zeros(batch * length, 3 * channels)
            projected = rows.index_copy_(0, real, projected)
        query, key, value = projected.view(batch, length, 3 * channels).split(channels, dim=-1)
        h = attention(_split_heads(query, heads), _split_heads(key, heads),
                      _split_heads(value, heads), bias, scaling).transpose(1, 2)  # fmt: skip
        if real is not None:
            h = h.reshape(batch * length, channels).index_select(0, real)
        else:
            h = h.reshape(batch, length, channels)
        x = residual + linear(h, p[4], p[5], k[1])
        if not normalize_before:
            x = F.layer_norm(x, [channels], p[0], p[1], eps)

        x = _feed_forward(x, p, k, 1, eps, normalize_before, gelu)
    return x


# what decoding runs: the functions above compiled with everything they call
decoder_layers_scripted = script(decoder_layers)
encoder_layers_scripted = script(encoder_layers)


def unusual_attention(attn) -> bool:
    """Whether an attention module has what ``attention`` does not compute: extra keys (bias_k,
    add_zero_attn) or rotary positions."""
    return (attn.bias_k is not None or attn.add_zero_attn
            or getattr(attn, "rotary_pos_embed", None) is not None)  # fmt: skip


def _parts(layer) -> List[Tuple[nn.Module, ...]]:
    """A layer's norms and products in the order the layer functions read their weights and
    biases: per sub-block its norm, then its two products (several layers: one product of their
    weights concatenated)."""
    attn = layer.self_attn
    parts = [(layer.self_attn_layer_norm,), (attn.q_proj, attn.k_proj, attn.v_proj),
             (attn.out_proj,)]  # fmt: skip
    source = getattr(layer, "encoder_attn", None)
    if source is not None:
        parts += [(layer.encoder_attn_layer_norm,), (source.q_proj,), (source.out_proj,)]
    return parts + [(layer.final_layer_norm,), (layer.fc1,), (layer.fc2,)]


def _products(layer) -> List[Tuple[nn.Module, ...]]:
    return [part for i, part in enumerate(_parts(layer)) if i % 3]


def _layers_supported(layers: List[nn.Module], final_norm: Optional[nn.Module]) -> bool:
    """What the encoder and the decoder layer functions both need: LayerNorms of one eps,
    plain linear layers (not int8 ones), ReLU or GELU, one norm placement and one attention
    shape throughout, attention without extra keys."""
    if not layers:
        return False
    norms = [part[0] for layer in layers for part in _parts(layer)[::3]]
    norms += [final_norm] * (final_norm is not None)
    if not all(type(norm) is nn.LayerNorm and norm.elementwise_affine and norm.bias is not None
               for norm in norms) or len({norm.eps for norm in norms}) > 1:  # fmt: skip
        return False
    first = layers[0]
    shape = (first.self_attn.num_heads, first.self_attn.scaling)
    for layer in layers:
        attentions = [layer.self_attn]
        if hasattr(layer, "encoder_attn"):  # a decoder layer's: None without encoder attention
            attentions.append(layer.encoder_attn)
        if (layer.activation_fn not in ACTIVATIONS
                or layer.normalize_before != first.normalize_before
                or any(type(linear) is not nn.Linear for part in _products(layer)
                       for linear in part)
                or not layer.self_attn.qkv_same_dim
                or any(attn is None or unusual_attention(attn)
                       or (attn.num_heads, attn.scaling) != shape
                       for attn in attentions)):  # fmt: skip
            return False
    return True


def decoder_supported(decoder) -> bool:
    """Whether ``decoder_layers`` reproduces this decoder's layers: stock ones with encoder
    attention, none of NormFormer's extras, no projection after them."""
    layers = list(decoder.layers)
    return (decoder.project_out_dim is None and not decoder.cross_self_attention
            and all(type(layer) in (TransformerDecoderLayerBase, TransformerDecoderLayer)
                    and layer.c_attn is None and layer.attn_ln is None and layer.w_resid is None
                    and getattr(layer, "ffn_layernorm", None) is None for layer in layers)
            and _layers_supported(layers, decoder.layer_norm))  # fmt: skip


def encoder_supported(encoder) -> bool:
    """Whether ``block_forward.encode`` (``encoder_layers``) reproduces this encoder's forward:
    a fairseq Transformer encoder with the stock forward and stock layers."""
    if not isinstance(encoder, TransformerEncoderBase) or any(
        getattr(type(encoder), name) is not getattr(TransformerEncoderBase, name)
        for name in ("forward", "forward_scriptable", "forward_embedding")
    ):
        return False
    layers = list(encoder.layers)
    return all(type(layer) in (TransformerEncoderLayerBase, TransformerEncoderLayer)
               and not layer.return_fc for layer in layers) and _layers_supported(
        layers, encoder.layer_norm)  # fmt: skip


class ScriptedLayers:
    """A supported stack of layers (``decoder_supported``, ``encoder_supported``) as the layer
    functions' arguments, taken when it is made: the modules' own tensors, and a copy of each
    attention's query, key and value weights concatenated. ``current()`` says whether no weight
    was replaced or changed in place since (an optimizer writing through ``.data`` is not seen:
    training never goes through these)."""

    def __init__(self, layers: nn.ModuleList, project: PackedLinears):
        self.modules = layers
        self.project = project
        first = layers[0]
        self.heads = first.self_attn.num_heads
        self.scaling = float(first.self_attn.scaling)
        self.eps = float(first.self_attn_layer_norm.eps)
        self.normalize_before = bool(first.normalize_before)
        self.gelu = first.activation_fn is ACTIVATIONS[1]
        self.sources = list(layers.parameters())
        self.fingerprint = self._fingerprint()
        with torch.no_grad():
            self.layers = [
                [tensor for part in _parts(layer) for tensor in _weight_and_bias(part)]
                for layer in layers
            ]
        self._packed_by_choice = {}

    def _fingerprint(self) -> List[Tuple[int, int]]:
        return [(param.data_ptr(), param._version) for param in self.sources]

    def current(self) -> bool:
        """Whether no layer weight was replaced or changed in place since these were taken."""
        return self._fingerprint() == self.fingerprint

    def packed(self, rows: int) -> List[List[Optional[Tensor]]]:
        """Per layer, the packed copy of each product that ``project`` runs packed for ``rows``
        rows, else None (the layer's own product)."""
        choice = self.project.choice(rows)
        packed = self._packed_by_choice.get(choice)
        if packed is None:
            packed = [[self.project.packed_weight(part, rows) for part in _products(layer)]
                      for layer in self.modules]  # fmt: skip
            self._packed_by_choice[choice] = packed
        return packed

    def run(self, function, x: Tensor, cache, first_slot: int, slots: Optional[Tensor],
            span: int, bias: Tensor) -> Tensor:  # fmt: skip
        """``function`` (``decoder_layers`` or an engine of it) over these layers for the
        embedded block ``x`` [B, W, C] on ``cache`` (a ``cache.DecoderCache``): its keys and
        values go to the slots from ``first_slot`` on (every row alike) or to ``slots``
        [B, W], and it attends to the first ``span`` under the additive ``bias``."""
        return function(x, self.layers, self.packed(x.size(0) * x.size(1)), cache.keys,
                        cache.values, first_slot, slots, span, bias, cache.encoder_keys,
                        cache.encoder_values, cache.encoder_bias, self.heads, self.scaling,
                        self.eps, self.normalize_before, self.gelu)  # fmt: skip


def _weight_and_bias(part: Tuple[nn.Module, ...]) -> List[Tensor]:
    """A norm's or product's weight and bias: the module's own tensors (zeros for a product
    without a bias: adding zero changes nothing); several modules' concatenated, a copy."""
    biases = [module.weight.new_zeros(module.weight.size(0)) if module.bias is None
              else module.bias.detach() for module in part]  # fmt: skip
    if len(part) == 1:
        return [part[0].weight.detach(), biases[0]]
    return [torch.cat([module.weight.detach() for module in part]), torch.cat(biases)]
