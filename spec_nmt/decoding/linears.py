"""Linear layers for decoding: fp32 matrix products with weights prepacked for oneDNN.

A block of a few entries per row is the worst shape for the CPU's default fp32 products (MKL's
``addmm``): it repacks the weight on every call, so scoring 4 entries costs about 3x one, and the
output projection over 8,008 symbols for 4 entries 350 us against 65 us with a weight packed once
(AMD EPYC, 2 threads; BENCHMARKS.md, "Prepacked fp32 products"). The products stay fp32: only
their summation order changes, as it already does between one entry and a block.

``PackedLinears(module)`` packs every fp32 ``nn.Linear`` of a module (when this torch has oneDNN
and the weights are on the CPU) and is then called as ``project(linear, x)`` wherever a decoding
forward would call ``linear(x)``. The packed copies are taken when it is made: weights changed
afterwards (training) need a new one. Every size gains in decoding, down to one entry's
256 x 256 attention projection (isolated timings favour MKL there, but not with the weights of
two models competing for the cache). Training never goes through it.
"""

from typing import Dict

import torch
from torch import Tensor, nn

# the row count oneDNN lays the weight out for; the layout serves 1 to 320 rows alike
PACKING_ROWS = 64


def packing_available() -> bool:
    """Whether this torch can run oneDNN products on prepacked weights."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinears:
    """The fp32 linear layers of a module with prepacked weights (see the module docstring)."""

    def __init__(self, module: nn.Module):
        self.weights: Dict[nn.Linear, Tensor] = {}
        if not packing_available():
            return
        for layer in module.modules():
            weight = getattr(layer, "weight", None)
            if (type(layer) is nn.Linear and weight.dtype == torch.float32
                    and weight.device.type == "cpu"):  # fmt: skip
                self.weights[layer] = torch.ops.mkldnn._reorder_linear_weight(
                    weight.detach(), PACKING_ROWS
                )

    def __call__(self, linear: nn.Module, x: Tensor) -> Tensor:
        packed = self.weights.get(linear)
        if packed is None or torch.is_grad_enabled():
            return linear(x)  # (the packed copy has no gradient)
        return torch.ops.mkldnn._linear_pointwise(x, packed, linear.bias, "none", [], "")

