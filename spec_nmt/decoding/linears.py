"""Linear layers for decoding: fp32 matrix products with weights prepacked for oneDNN.

A block of a few entries per row is the worst shape for the CPU's default fp32 products (MKL's
``addmm``): slow for a few rows per call, so the verifier scored a block of 4 entries for
1.7x one, and the output projection over 8,008 symbols for 4 entries took 350 us against 65 us
with a weight packed once (AMD EPYC, 2 threads; BENCHMARKS.md, "Prepacked fp32 products"). The
products stay fp32: only their summation order changes, as it already does between one entry
and a block.

``PackedLinears(module)`` packs every fp32 ``nn.Linear`` of a module (when this torch has oneDNN
and the weights are on the CPU) and is then called as ``project(linear, x)`` wherever a decoding
forward would call ``linear(x)``. The packed copies are taken when it is made; a layer whose
weight was replaced or changed in place since, or an input that is not fp32 on the CPU, goes to
the layer itself (an optimizer writing through ``.data`` is not seen: training never goes
through it, and drafters under training get a new one per validation). Every size gains in
decoding, down to one entry's 256 x 256 attention projection (isolated timings favour MKL
there, but not with the weights of two models competing for the cache).
"""

from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn

# the row count oneDNN lays the weight out for; the layout serves 1 to 320 rows alike
PACKING_ROWS = 64


def packing_available() -> bool:
    """Whether this torch can run oneDNN products on prepacked weights."""
    ops = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and all(
        hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise")
    )


class Packed(NamedTuple):
    weight: Tensor  # the packed copy
    source: int  # the weight's storage when packed
    version: int  # and its version counter


class PackedGroup(NamedTuple):
    """Layers of one input packed as one product (an attention's query, key and value)."""

    weight: Tensor  # their weights, concatenated along the outputs, packed
    bias: Optional[Tensor]
    sizes: List[int]  # each layer's outputs


class PackedLinears:
    """The fp32 linear layers of a module with prepacked weights (see the module docstring)."""

    def __init__(self, module: nn.Module):
        self.weights: Dict[nn.Linear, Packed] = {}
        self.groups: Dict[Tuple[nn.Linear, ...], PackedGroup] = {}
        if not packing_available():
            return
        for layer in module.modules():
            weight = getattr(layer, "weight", None)
            if (type(layer) is nn.Linear and weight.dtype == torch.float32
                    and weight.device.type == "cpu"):  # fmt: skip
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKING_ROWS)
                self.weights[layer] = Packed(packed, weight.data_ptr(), weight._version)
        for attention in module.modules():  # self-attention: query, key, value of one input
            if getattr(attention, "self_attention", False):
                layers = (attention.q_proj, attention.k_proj, attention.v_proj)
                if all(layer in self.weights for layer in layers):
                    self._group(layers)

    def _group(self, layers: Tuple[nn.Linear, ...]) -> None:
        biases = [layer.bias for layer in layers]
        if len({bias is None for bias in biases}) > 1:
            return  # some with a bias, some without: one product cannot add them
        with torch.no_grad():
            weight = torch.cat([layer.weight.detach() for layer in layers])
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_ROWS)
            bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        self.groups[layers] = PackedGroup(packed, bias, [layer.out_features for layer in layers])

    def many(self, linears: Tuple[nn.Module, ...], x: Tensor) -> List[Tensor]:
        """Several layers of the same input: one product where they were packed together (an
        attention's query, key and value), else each layer's own."""
        group = self.groups.get(linears)
        if group is None or not all(self._current(linear, x) for linear in linears):
            return [self(linear, x) for linear in linears]
        product = torch.ops.mkldnn._linear_pointwise(x, group.weight, group.bias, "none", [], "")
        return list(product.split(group.sizes, dim=-1))

    def _current(self, linear: nn.Module, x: Tensor) -> bool:
        """Whether the packed copy of ``linear`` serves input ``x``: no gradient wanted, x fp32
        on the CPU, the weight unchanged since packing."""
        packed = self.weights.get(linear)
        return not (packed is None or torch.is_grad_enabled()  # (the copy has no gradient)
                    or x.dtype != torch.float32 or x.device.type != "cpu"
                    or linear.weight.data_ptr() != packed.source
                    or linear.weight._version != packed.version)  # fmt: skip

    def covers(self, module: nn.Module) -> bool:
        """Whether any linear layer of ``module`` was packed."""
        return any(layer in self.weights for layer in module.modules())

    def __call__(self, linear: nn.Module, x: Tensor) -> Tensor:
        if not self._current(linear, x):
            return linear(x)
        packed = self.weights[linear].weight
        return torch.ops.mkldnn._linear_pointwise(x, packed, linear.bias, "none", [], "")
