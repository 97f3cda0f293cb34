"""The decoder layers of block scoring as one TorchScript function over plain tensors.

``block_forward`` runs a block through the stock decoder's modules: per layer a few dozen module
calls, each with Python around a small product. When the block is one entry of one sentence, that
Python costs more than the arithmetic. For the common layer (pre- or post-norm, ReLU or GELU,
encoder attention in every layer, none of NormFormer's extras) ``ScriptedLayers`` takes the layers'
tensors once and runs the same products, norms and attention in one call of
``decoder_layers_scripted`` (``decoder_layers`` compiled by TorchScript: without the Python
between its operations). Other layers, and training (dropout, gradients), keep
``block_forward``; the tests hold the two to the same logits.
"""

import warnings
from typing import List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from fairseq import utils
from fairseq.modules.transformer_layer import TransformerDecoderLayer, TransformerDecoderLayerBase
from torch import Tensor, nn

from spec_nmt.decoding.linears import PackedLinears

# From this many queries per head (batch x queries) attention on the CPU runs as two batched
# products around a softmax: scaled_dot_product_attention's CPU kernel pays per row and head,
# 1.8-2.9x the products' time for a block of 4-11 entries at batch 32 (AMD EPYC, 2 threads),
# while one sentence's few queries are faster through it (BENCHMARKS.md, "Attention through
# batched products").
MATMUL_ATTENTION_ROWS = 12

# the activations decoder_layers computes: ReLU, and fairseq's GELU (in fp32)
ACTIVATIONS = (utils.get_activation_fn("relu"), utils.get_activation_fn("gelu"))

# each layer's tensors, in this order (the attention's query, key and value as one product)
LAYER_TENSORS = ("self_norm_weight", "self_norm_bias", "qkv_weight", "qkv_bias", "self_out_weight",
                 "self_out_bias", "source_norm_weight", "source_norm_bias", "source_query_weight",
                 "source_query_bias", "source_out_weight", "source_out_bias", "ffn_norm_weight",
                 "ffn_norm_bias", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")  # fmt: skip


def _script(function):
    """``torch.jit.script`` without its deprecation warning (torch is pinned; torch.compile,
    its successor, recompiled for every block width here: BENCHMARKS.md)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(function)


def attention(query: Tensor, keys: Tensor, values: Tensor, bias: Optional[Tensor], scaling: float,
              matmul_rows: int = MATMUL_ATTENTION_ROWS) -> Tensor:  # fmt: skip
    """Scaled dot-product attention of split heads [B, heads, T, head_dim] without dropout;
    ``bias`` is an additive mask (0 or -inf) under which every query sees at least one key."""
    if (query.device.type == "cpu" and query.dtype == torch.float32
            and query.size(0) * query.size(2) >= matmul_rows):  # fmt: skip
        weights = torch.matmul(query * scaling, keys.transpose(-1, -2))
        if bias is not None:
            weights.add_(bias)
        return torch.matmul(weights.softmax(dim=-1), values)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=bias, scale=scaling)


def _linear(x: Tensor, weight: Tensor, bias: Tensor, packed: Optional[Tensor]) -> Tensor:
    if packed is not None:
        no_scalars: List[Optional[Union[int, float, complex]]] = []
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", no_scalars, "")
    return F.linear(x, weight, bias)


def _split_heads(x: Tensor, heads: int) -> Tensor:
    """[B, T, C] → [B, heads, T, head_dim]."""
    return x.view(x.size(0), x.size(1), heads, -1).transpose(1, 2)


def decoder_layers(x: Tensor, layers: List[List[Tensor]], packed: List[List[Optional[Tensor]]],
                   keys: List[Tensor], values: List[Tensor], first_slot: int,
                   slots: Optional[Tensor], span: int, bias: Tensor, encoder_keys: List[Tensor],
                   encoder_values: List[Tensor], encoder_bias: Optional[Tensor], heads: int,
                   scaling: float, eps: float, normalize_before: bool, gelu: bool) -> Tensor:  # fmt: skip
    """The layers over an embedded block x [B, W, C]. Each layer writes the block's keys and
    values into its cache [B, heads, capacity, head_dim] at ``first_slot`` (every row alike) or
    at ``slots`` [B, W], and its queries see the first ``span`` slots under ``bias``."""
    batch, width, channels = x.shape
    for i in range(len(layers)):
        p = layers[i]
        k = packed[i]

        residual = x
        h = F.layer_norm(x, [channels], p[0], p[1], eps) if normalize_before else x
        query, key, value = _linear(h, p[2], p[3], k[0]).split(channels, dim=-1)
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
        x = residual + _linear(h.transpose(1, 2).reshape(batch, width, channels), p[4], p[5], k[1])
        if not normalize_before:
            x = F.layer_norm(x, [channels], p[0], p[1], eps)

        residual = x
        h = F.layer_norm(x, [channels], p[6], p[7], eps) if normalize_before else x
        query = _split_heads(_linear(h, p[8], p[9], k[2]), heads)
        h = attention(query, encoder_keys[i], encoder_values[i], encoder_bias, scaling)
        x = residual + _linear(h.transpose(1, 2).reshape(batch, width, channels), p[10], p[11],
                               k[3])  # fmt: skip
        if not normalize_before:
            x = F.layer_norm(x, [channels], p[6], p[7], eps)

        residual = x
        h = F.layer_norm(x, [channels], p[12], p[13], eps) if normalize_before else x
        h = _linear(h, p[14], p[15], k[4])
        h = F.gelu(h.float()).type_as(h) if gelu else F.relu(h)
        x = residual + _linear(h, p[16], p[17], k[5])
        if not normalize_before:
            x = F.layer_norm(x, [channels], p[12], p[13], eps)
    return x


# what block scoring runs: the function above compiled with everything it calls
decoder_layers_scripted = _script(decoder_layers)


def _norms(layer) -> Tuple[nn.Module, ...]:
    return (layer.self_attn_layer_norm, layer.encoder_attn_layer_norm, layer.final_layer_norm)


def supported(decoder) -> bool:
    """Whether ``ScriptedLayers`` reproduces this decoder's layers (see the module docstring;
    their products plain ``nn.Linear`` layers: not int8 ones)."""
    layers = list(decoder.layers)
    if not layers or decoder.project_out_dim is not None:
        return False
    norms = [norm for layer in layers for norm in _norms(layer)]
    if decoder.layer_norm is not None:
        norms.append(decoder.layer_norm)
    if not all(type(norm) is nn.LayerNorm and norm.elementwise_affine and norm.bias is not None
               for norm in norms) or len({norm.eps for norm in norms}) > 1:  # fmt: skip
        return False
    first = layers[0].self_attn
    for layer in layers:
        self_attn, encoder_attn = layer.self_attn, layer.encoder_attn
        if (type(layer) not in (TransformerDecoderLayerBase, TransformerDecoderLayer)
                or encoder_attn is None or layer.cross_self_attention
                or layer.c_attn is not None or layer.attn_ln is not None
                or layer.w_resid is not None or getattr(layer, "ffn_layernorm", None) is not None
                or layer.activation_fn not in ACTIVATIONS
                or any(type(linear) is not nn.Linear for group in _products(layer)
                       for linear in group)
                or layer.normalize_before != layers[0].normalize_before
                or not self_attn.qkv_same_dim or self_attn.kdim != self_attn.embed_dim
                or (self_attn.num_heads, self_attn.scaling) != (first.num_heads, first.scaling)
                or (encoder_attn.num_heads, encoder_attn.scaling)
                != (first.num_heads, first.scaling)):  # fmt: skip
            return False
    return True


class ScriptedLayers:
    """A supported decoder's layers (``supported``) as ``decoder_layers`` arguments, taken when it
    is made; ``current()`` says whether the model's weights are still those."""

    def __init__(self, decoder, project: PackedLinears):
        self.decoder = decoder
        self.project = project
        first = decoder.layers[0]
        self.heads = first.self_attn.num_heads
        self.scaling = float(first.self_attn.scaling)
        self.eps = float(first.self_attn_layer_norm.eps)
        self.normalize_before = bool(first.normalize_before)
        self.gelu = first.activation_fn is ACTIVATIONS[1]
        self.sources = [param for param in decoder.layers.parameters()]
        self.fingerprint = self._fingerprint()
        with torch.no_grad():
            self.layers = [self._layer_tensors(layer) for layer in decoder.layers]
        self._packed_by_choice = {}

    def _fingerprint(self) -> List[Tuple[int, int]]:
        return [(param.data_ptr(), param._version) for param in self.sources]

    def current(self) -> bool:
        """Whether no layer weight was replaced or changed in place since these were taken."""
        return self._fingerprint() == self.fingerprint

    def _layer_tensors(self, layer) -> List[Tensor]:
        attn, source = layer.self_attn, layer.encoder_attn
        qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
        tensors = {
            "qkv_weight": torch.cat([linear.weight for linear in qkv]),
            "qkv_bias": torch.cat([_bias(linear) for linear in qkv]),
        }
        named = {"self_norm": layer.self_attn_layer_norm, "self_out": attn.out_proj,
                 "source_norm": layer.encoder_attn_layer_norm, "source_query": source.q_proj,
                 "source_out": source.out_proj, "ffn_norm": layer.final_layer_norm,
                 "fc1": layer.fc1, "fc2": layer.fc2}  # fmt: skip
        for name, module in named.items():
            tensors[f"{name}_weight"] = module.weight.detach()
            tensors[f"{name}_bias"] = _bias(module)
        return [tensors[name] for name in LAYER_TENSORS]

    def packed(self, rows: int) -> List[List[Optional[Tensor]]]:
        """Per layer, the packed copy of each product that ``project`` runs packed for ``rows``
        rows, else None (the layer's own product)."""
        choice = self.project.choice(rows)
        packed = self._packed_by_choice.get(choice)
        if packed is None:
            packed = [[self.project.packed_weight(group, rows) for group in _products(layer)]
                      for layer in self.decoder.layers]  # fmt: skip
            self._packed_by_choice[choice] = packed
        return packed


def _products(layer) -> Tuple[Tuple[nn.Linear, ...], ...]:
    """A layer's products in the order ``decoder_layers`` reads their packed copies."""
    attn, source = layer.self_attn, layer.encoder_attn
    return ((attn.q_proj, attn.k_proj, attn.v_proj), (attn.out_proj,), (source.q_proj,),
            (source.out_proj,), (layer.fc1,), (layer.fc2,))  # fmt: skip


def _bias(linear: nn.Module) -> Tensor:
    """The layer's bias, zeros where it has none (adding zero changes nothing)."""
    if linear.bias is not None:
        return linear.bias.detach()
    return linear.weight.new_zeros(linear.weight.size(0))
