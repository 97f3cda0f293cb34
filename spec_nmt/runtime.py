"""The process's CPU threads: how many threads torch gives one operation, set once for the whole
process by ``spec-nmt-translate --threads``, ``SpecTranslator.from_pretrained(threads=...)`` and
``make translate THREADS=...``. The default lives here and nowhere else.

Why 1 by default (benchmarks/results/busy-machine-threads.json, 2-core AMD EPYC): beside another
process that keeps a core busy (a training run, a second translator), torch's own default of one
thread per core makes every operation wait for the thread whose core is taken, and decoding at
batch 1 runs tens of times slower; one thread runs at about its idle speed there. On an idle
machine one thread is as fast at batch 1 and gives up about a third of the throughput of large
batches, which ``--threads`` wins back where the cores are free.
"""

import torch

from spec_nmt.errors import SpecNmtError

DEFAULT_THREADS = 1
THREADS_HELP = (
    "CPU threads torch may use for one operation. The default, 1, stays fast beside other "
    "busy processes; more threads decode large batches faster on cores that are otherwise "
    "idle, but can be tens of times slower where another process holds a core"
)


def check_threads(threads, name: str = "threads") -> int:
    """``threads`` if it is a whole number >= 1, else a one-line error naming ``name`` (the
    keyword or flag the caller used)."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise SpecNmtError(f"{name} must be an integer >= 1 (CPU threads), got {threads!r}")
    return threads


def use_threads(threads: int, name: str = "threads") -> None:
    """Let torch use ``threads`` threads per operation, in the whole process, from now on."""
    torch.set_num_threads(check_threads(threads, name))
