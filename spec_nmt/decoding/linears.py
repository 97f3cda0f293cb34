"""Linear layers for decoding: fp32 (and bf16) matrix products with weights prepacked for oneDNN.

A block of a few entries per row is the worst shape for the CPU's default fp32 products (MKL's
``addmm``) on AMD, where a weight packed once for oneDNN is several times faster. On Intel MKL
is the faster one for a single row, and oneDNN from a few rows on (docs/lab-notes.md,
"Prepacked fp32 products" and "The decoder and encoder layers as one TorchScript function").
So each weight shape is timed both ways the first time a machine packs it, with the weight
read from memory as decoding reads it (timed in cache, MKL won one-row shapes on the AMD EPYC
whose choice made decoding without drafts at batch 1 1-6 % slower: docs/lab-notes.md,
"Product kernels timed as decoding reads them"), and runs packed from the row count where that
was faster. The choice is recorded (CHOICES_FILE) and kept, so that every run on a machine
rounds alike. The products keep their precision: only their summation order changes, as it
already does between one entry and a block. A bf16 drafter's weights (--drafter-precision) are
packed and timed the same way, in bf16.

``PackedLinears(module)`` packs every fp32 or bf16 ``nn.Linear`` of a module (when this torch has
oneDNN and the weights are on the CPU) and is then called as ``project(linear, x)`` wherever a
decoding forward would call ``linear(x)``. The packed copies are taken when it is made; a layer
whose weight was replaced or changed in place since, or an input not on the CPU in the weight's
dtype, goes to the layer itself (an optimizer writing through ``.data`` is not seen: training
never goes through it, and drafters under training get a new one per validation).
"""

import json
import logging
import platform
import time
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from spec_nmt.files import CACHE_DIR, written_whole

logger = logging.getLogger(__name__)

# the row count oneDNN lays the weight out for; the layout serves 1 to 320 rows alike
PACKING_ROWS = 64
# the row counts a weight shape is timed at, both ways; past the last one its choice holds. 2 and
# 3 are blocks of k = 1 and 2: timed from 4 only, they ran MKL's product on the AMD EPYC, 1.4-1.9
# times slower there than the packed one (a k = 2 iteration cost more than a k = 3 one)
TIMED_ROWS = (1, 2, 3, 4, 16, 64)
# the weight copies a shape is timed on fill twice the last-level cache (taken as
# LAST_LEVEL_CACHE_BYTES where Linux does not say), but are at most MAX_TIMED_COPIES: the tests'
# toy shapes would take thousands (theirs then stay in cache, as a model that small does)
MAX_TIMED_COPIES = 256
LAST_LEVEL_CACHE_BYTES = 32 << 20
PACKED_DTYPES = (torch.float32, torch.bfloat16)
NEVER = 1 << 62  # the packed-from row count of a shape whose packed product never won
# where each machine's choices are kept (per CPU model, torch version and thread count)
CHOICES_FILE = CACHE_DIR / "product-kernels.json"


def packed_dtypes() -> Tuple[torch.dtype, ...]:
    """The weight dtypes oneDNN packs here: bf16 only where the CPU has the instructions its
    bf16 path needs (AVX-512 BW/VL/DQ or AVX-NE-CONVERT); elsewhere bf16 layers run as they
    are."""
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return PACKED_DTYPES
    return tuple(dtype for dtype in PACKED_DTYPES if dtype != torch.bfloat16)


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
        # per weight shape (outputs, inputs, dtype): the fewest rows from which it runs packed
        self.packed_from: Dict[Tuple[int, int, torch.dtype], int] = {}
        if not packing_available():
            return
        for layer in module.modules():
            weight = getattr(layer, "weight", None)
            if (type(layer) is nn.Linear and weight.dtype in packed_dtypes()
                    and weight.device.type == "cpu"):  # fmt: skip
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKING_ROWS)
                self.weights[layer] = Packed(packed, weight.data_ptr(), weight._version)
        for attention in module.modules():  # self-attention: query, key, value of one input
            if getattr(attention, "self_attention", False):
                layers = (attention.q_proj, attention.k_proj, attention.v_proj)
                if all(layer in self.weights for layer in layers):
                    self._group(layers)
        shapes = {_shape(layer) for layer in self.weights}
        shapes |= {_group_shape(layers, group) for layers, group in self.groups.items()}
        with torch.no_grad():
            self.packed_from = {shape: _packed_from(*shape)
                                for shape in sorted(shapes, key=str)}  # fmt: skip

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
        if group is None or not all(self._serves(linear, x) for linear in linears) or (
            _rows(x) < self.packed_from[_group_shape(linears, group)]
        ):
            return [self(linear, x) for linear in linears]
        product = torch.ops.mkldnn._linear_pointwise(x, group.weight, group.bias, "none", [], "")
        return list(product.split(group.sizes, dim=-1))

    def _serves(self, linear: nn.Module, x: Tensor) -> bool:
        """Whether the packed copy of ``linear`` serves input ``x``: no gradient wanted, x on
        the CPU in the weight's dtype with as many rows as its shape runs packed from, the
        weight unchanged since packing."""
        packed = self.weights.get(linear)
        return not (packed is None or torch.is_grad_enabled()  # (the copy has no gradient)
                    or x.dtype != linear.weight.dtype or x.device.type != "cpu"
                    or linear.weight.data_ptr() != packed.source
                    or linear.weight._version != packed.version
                    or _rows(x) < self.packed_from[_shape(linear)])  # fmt: skip

    def packed_weight(self, linears: Tuple[nn.Linear, ...], rows: int) -> Optional[Tensor]:
        """The packed copy of a layer (one) or group (several) for a CPU input of ``rows`` rows
        in the weight's dtype, without gradient: None where the layer's own product runs."""
        if len(linears) == 1:
            packed = self.weights.get(linears[0])
            shape = _shape(linears[0])
        else:
            packed = self.groups.get(linears)
            shape = _group_shape(linears, packed) if packed else None
        if packed is None or not all(
            linear.weight.data_ptr() == self.weights[linear].source
            and linear.weight._version == self.weights[linear].version
            for linear in linears
        ) or rows < self.packed_from[shape]:
            return None
        return packed.weight

    def choice(self, rows: int) -> Tuple[bool, ...]:
        """For ``rows`` rows, whether each weight shape runs packed (a key for what depends on
        that)."""
        return tuple(rows >= packed_from for packed_from in self.packed_from.values())

    def __call__(self, linear: nn.Module, x: Tensor) -> Tensor:
        if not self._serves(linear, x):
            return linear(x)
        packed = self.weights[linear].weight
        return torch.ops.mkldnn._linear_pointwise(x, packed, linear.bias, "none", [], "")


def _shape(linear: nn.Linear) -> Tuple[int, int, torch.dtype]:
    return (*linear.weight.shape, linear.weight.dtype)


def _group_shape(linears: Tuple[nn.Linear, ...],
                 group: PackedGroup) -> Tuple[int, int, torch.dtype]:  # fmt: skip
    return sum(group.sizes), linears[0].in_features, linears[0].weight.dtype


def _rows(x: Tensor) -> int:
    return x.numel() // x.size(-1) if x.dim() else 0


def _packed_from(outputs: int, inputs: int, dtype: torch.dtype) -> int:
    """The fewest rows from which a packed product of this shape runs: as recorded for this
    machine in CHOICES_FILE, else timed now (``first_of_last_run`` over TIMED_ROWS) and
    recorded, so that every later run here rounds the same way."""
    machine, shape = _machine(), f"{outputs}x{inputs}"
    if dtype != torch.float32:  # (fp32's records keep the name they had before bf16)
        shape += f" {str(dtype).removeprefix('torch.')}"
    choices = _recorded_choices()
    if shape in choices.get(machine, {}):
        return choices[machine][shape]
    packed_from = _timed_packed_from(outputs, inputs, dtype)
    choices = _recorded_choices()  # as another process may have left it meanwhile
    choices.setdefault(machine, {})[shape] = packed_from
    try:
        CHOICES_FILE.parent.mkdir(parents=True, exist_ok=True)
        with written_whole(CHOICES_FILE) as partial:
            partial.write_text(json.dumps(choices, indent=1, sort_keys=True))
    except OSError as error:  # a read-only home: the choice holds for this process only
        logger.warning("cannot record the product kernels in %s: %s", CHOICES_FILE, error)
    return packed_from


def _machine() -> str:
    """What the choice depends on: the CPU model, torch's version and its thread count (and
    how it was timed: a record timed at other row counts, or in cache, is timed again)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            names = [line.split(":", 1)[1].strip() for line in cpuinfo
                     if line.startswith("model name")]  # fmt: skip
        model = names[0] if names else model
    except OSError:
        pass
    rows = ",".join(map(str, TIMED_ROWS))
    # "streamed": timed with the weights read from memory (records timed in cache are not read)
    return (f"{model} | torch {torch.__version__} | {torch.get_num_threads()} threads | rows "
            f"{rows} | streamed")


def _recorded_choices() -> Dict[str, Dict[str, int]]:
    try:
        return json.loads(CHOICES_FILE.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: timed again
        return {}


def _timed_packed_from(outputs: int, inputs: int, dtype: torch.dtype) -> int:
    """Time both products of this shape as decoding runs them: each reads its weight from
    memory, since a model's weights, read one after another, outgrow the CPU's caches. So each
    kernel runs on copies of the weight in turn, as many as fill twice the last-level cache."""
    weight_bytes = outputs * inputs * dtype.itemsize
    copies = min(-(-2 * _last_level_cache_bytes() // weight_bytes), MAX_TIMED_COPIES)
    return timed_on_copies(outputs, inputs, dtype, copies)


def timed_on_copies(outputs: int, inputs: int, dtype: torch.dtype, copies: int) -> int:
    """The fewest rows from which the packed product of this shape was the faster, each kernel
    timed over ``copies`` copies of the weight read in turn (one: the weight stays in cache).
    On constant values: they do not change the time, and the global random state stays as it
    was."""
    weights = [torch.full((outputs, inputs), 0.5, dtype=dtype) for _ in range(copies)]
    bias = torch.full((outputs,), 0.5, dtype=dtype)
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACKING_ROWS) for w in weights]
    faster = []
    for rows in TIMED_ROWS:
        x = torch.full((rows, inputs), 0.5, dtype=dtype)

        def own():
            for w in weights:
                torch.nn.functional.linear(x, w, bias)

        def onednn():
            for w in packed:
                torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")

        faster.append(_seconds(onednn) < _seconds(own))
    return first_of_last_run(TIMED_ROWS, faster)


def _last_level_cache_bytes(caches: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The size of the CPU's largest cache as Linux reports it, else LAST_LEVEL_CACHE_BYTES."""
    sizes = []
    for index in caches.glob("index*/size"):
        try:
            text = index.read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=LAST_LEVEL_CACHE_BYTES)


def first_of_last_run(rows: Sequence[int], packed_faster: Sequence[bool]) -> int:
    """The fewest of ``rows`` from which the packed product was the faster at every larger
    timed count too; NEVER where it lost at the largest."""
    packed_from = NEVER
    for count, faster in reversed(list(zip(rows, packed_faster))):
        if not faster:
            break
        packed_from = count
    return packed_from


def _seconds(product, repeats: int = 3) -> float:
    """The fastest of ``repeats`` calls of a product, after one to warm up: the call least
    disturbed by other work on the machine, since the choice is kept."""
    product()
    fastest = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        product()
        fastest = min(fastest, time.perf_counter() - start)
    return fastest
