"""The one door from the device to the host in the static loop (static_loop.py).

A read of a GPU tensor into Python makes the host wait until every kernel queued before it has
run; the loop is only as fast as its fewest such waits. The static loop reads through
``host_read`` alone, so a count of its calls is a count of the waits (tests/test_static_loop.py
asserts one per iteration, benchmark.py syncs counts them with CUDA's own sync check).
"""

from typing import List

from torch import Tensor


class ReadCounter:
    """How many times ``host_read`` has been called in this process."""

    reads = 0


def host_read(*tensors: Tensor) -> List[Tensor]:
    """The tensors on the CPU, in one wait for the device: the first copy waits, the others
    find their data computed already."""
    ReadCounter.reads += 1
    return [tensor.to("cpu") for tensor in tensors]


def any_true(flag: Tensor) -> bool:
    """A one-element bool tensor read into Python (through ``host_read``)."""
    (value,) = host_read(flag)
    return bool(value.reshape(-1)[0])


def count_reads() -> int:
    return ReadCounter.reads

