"""Let torch >= 2.6 load fairseq checkpoints.

torch.load defaults to ``weights_only=True`` since torch 2.6, and fairseq's checkpoint loader does
not opt out, so checkpoints holding their training configuration (an ``argparse.Namespace``, older
ones numpy scalars) fail to load. The types below are plain data containers; allowing them keeps
the safe loader on instead of turning it off.
"""

import argparse

import numpy
import torch


def _numpy_scalar_types():
    types = [numpy.dtype, numpy.ndarray]
    core = getattr(numpy, "_core", None) or getattr(numpy, "core")
    types.append(core.multiarray.scalar)
    types.append(core.multiarray._reconstruct)
    dtypes = getattr(numpy, "dtypes", None)
    if dtypes is not None:
        types.extend([dtypes.Float64DType, dtypes.Float32DType, dtypes.Int64DType])
    return types


if hasattr(torch.serialization, "add_safe_globals"):
    torch.serialization.add_safe_globals([argparse.Namespace, *_numpy_scalar_types()])
