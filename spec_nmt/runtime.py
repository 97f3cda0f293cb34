"""The process's CPU threads: how many threads torch gives one operation, set once for the whole
process by ``spec-nmt-translate --threads``, ``SpecTranslator.from_pretrained(threads=...)`` and
``make translate THREADS=...``, and by the plugin's task when fairseq-generate or
fairseq-interactive decode speculatively (``--threads``, or OMP_NUM_THREADS where the user set
it). The default lives here and nowhere else. Here too: telling a person at a terminal that the
first decoding on a machine pauses to time the product kernels, which depend on the threads.

Why 1 by default (benchmarks/results/busy-machine-threads.json, 2 cores, batch 1): torch's own
default, one thread per core, makes every operation wait for the thread whose core another
process holds. Beside a 2-thread torch job, 2 threads decoded at 101 ms per token and 1 thread at
4.1 (3.1 idle); beside a one-core busy loop, 15 against 2.8. Idle, 2 threads gain about 10% at
batch 1 and 1.7x in batches of 32: ``--threads`` is for cores nothing else needs. OpenMP's
passive wait policy (OMP_WAIT_POLICY=PASSIVE, read when torch loads) avoids the collapse but
left 2 threads no faster than 1 anywhere, so nothing sets it.
"""

import logging
import os
import sys

from spec_nmt.errors import SpecNmtError

logger = logging.getLogger(__name__)

DEFAULT_THREADS = 1
THREADS_HELP = (
    "CPU threads torch may use for one operation, in the whole process. The default, 1, stays "
    "fast beside other busy processes; 2 threads decoded batches of 32 1.7x faster on an idle "
    "2-core machine but about 30x slower at batch 1 beside another 2-thread torch process"
)


def check_threads(threads, name: str = "threads") -> int:
    """``threads`` if it is a whole number >= 1, else a one-line error naming ``name`` (the
    keyword or flag the caller used)."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise SpecNmtError(f"{name} must be an integer >= 1 (CPU threads), got {threads!r}")
    return threads


def use_threads(threads: int, name: str = "threads") -> None:
    """Let torch use ``threads`` threads per operation, in the whole process, from now on."""
    import torch  # here, not above: the command line checks --threads before torch loads

    torch.set_num_threads(check_threads(threads, name))


def use_threads_unless_set(threads, name: str = "--threads") -> None:
    """For the stock fairseq commands: ``threads`` when given, else torch's own choice where the
    user set OMP_NUM_THREADS (torch read it when it loaded), else the default."""
    if threads is not None:
        use_threads(threads, name)
    elif "OMP_NUM_THREADS" not in os.environ:
        use_threads(DEFAULT_THREADS)


def announce_kernel_timing(device) -> None:
    """Say, before the models load, that the first decoding on this machine (CPU model, torch
    version, thread count) times its product kernels, which pauses it for seconds: after it the
    record exists (spec_nmt/decoding/linears.py) and this says nothing. Only to a person at a
    terminal, who would wonder at the pause: logs and piped output stay as they were."""
    import torch

    from spec_nmt.decoding import linears

    if not sys.stderr.isatty() or torch.device(device).type != "cpu":
        return
    if not linears.packing_available():
        return
    if linears._machine() not in linears._recorded_choices():
        logger.warning(
            "first decoding on this machine: timing the CPU's matrix-product kernels for each "
            "weight shape (about 8 s for the bundled pair), once; the choice is kept in %s",
            linears.CHOICES_FILE,
        )
