"""Linear layers for decoding: fp32 matrix products with weights prepacked for oneDNN.

A block of a few entries per row is the worst shape for the CPU's default fp32 products (MKL's
``addmm``): it repacks the weight on every call, so the verifier scored a block of 4 entries for
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

from typing import Dict, NamedTuple

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


class PackedLinears:
    """The fp32 linear layers of a module with prepacked weights (see the module docstring)."""

    def __init__(self, module: nn.Module):
        self.weights: Dict[nn.Linear, Packed] = {}
        if not packing_available():
            return
        for layer in module.modules():
            weight = getattr(layer, "weight", None)
            if (type(layer) is nn.Linear and weight.dtype == torch.float32
                    and weight.device.type == "cpu"):  # fmt: skip
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKING_ROWS)
                self.weights[layer] = Packed(packed, weight.data_ptr(), weight._version)

    def covers(self, module: nn.Module) -> bool:
        """Whether any linear layer of ``module`` was packed."""
        return any(layer in self.weights for layer in module.modules())

    def __call__(self, linear: nn.Module, x: Tensor) -> Tensor:
        packed = self.weights.get(linear)
        if (packed is None or torch.is_grad_enabled()  # (the packed copy has no gradient)
                or x.dtype != torch.float32 or x.device.type != "cpu"
                or linear.weight.data_ptr() != packed.source
                or linear.weight._version != packed.version):  # fmt: skip
            return linear(x)
        return torch.ops.mkldnn._linear_pointwise(x, packed.weight, linear.bias, "none", [], "")

