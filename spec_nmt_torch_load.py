"""Let torch >= 2.6 load fairseq checkpoints, in every program of the environment.

torch.load defaults to ``weights_only=True`` since torch 2.6, and fairseq's checkpoint loader does
not opt out, so stock ``fairseq-generate``/``fairseq-interactive``/``fairseq-train`` fail on every
checkpoint that holds its training configuration (an ``argparse.Namespace``, older ones numpy
scalars). These types are plain data containers: allowing them keeps the safe loader on instead
of turning it off.

Installing spec-nmt puts ``spec_nmt_torch_load.pth`` into site-packages, which imports this module
at interpreter start (``pip install .`` does it through setup.py; an editable install cannot carry
the file, so ``make install`` runs ``python -m spec_nmt_torch_load``, which writes it). Importing
it costs nothing: it only waits for ``fairseq`` to be imported and then allows the types, so
programs that never import fairseq never import torch because of it.
"""

import importlib.abc
import importlib.util
import sys
import threading

PTH_NAME = "spec_nmt_torch_load.pth"
# Tolerant of a removed package or checkout: a failing .pth line prints a traceback at every start.
PTH_LINE = (
    "import importlib.util as u; "
    'u.find_spec("spec_nmt_torch_load") and __import__("spec_nmt_torch_load")\n'
)


def allow_fairseq_checkpoint_types() -> None:
    """Add the types fairseq checkpoints hold to torch.load's allowed globals."""
    import argparse

    import numpy
    import torch

    if not hasattr(torch.serialization, "add_safe_globals"):  # torch < 2.4 loads them anyway
        return
    core = getattr(numpy, "_core", None) or getattr(numpy, "core")
    types = [
        argparse.Namespace,
        numpy.dtype,
        numpy.ndarray,
        core.multiarray.scalar,
        core.multiarray._reconstruct,
    ]
    dtypes = getattr(numpy, "dtypes", None)
    if dtypes is not None:
        types.extend([dtypes.Float64DType, dtypes.Float32DType, dtypes.Int64DType])
    torch.serialization.add_safe_globals(types)


class _AfterFairseqImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it wraps the loader that the other finders give for ``fairseq`` so
    that allow_fairseq_checkpoint_types runs once the package is executed. It stays in place (a
    lookup that only probes for fairseq executes nothing) and costs one comparison per import."""

    def __init__(self):
        self._looking = threading.local()

    def find_spec(self, name, path=None, target=None):
        if name != "fairseq" or getattr(self._looking, "active", False):
            return None
        self._looking.active = True  # the lookup below asks us again: answer nothing then
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._looking.active = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            allow_fairseq_checkpoint_types()

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    if "fairseq" in sys.modules:
        allow_fairseq_checkpoint_types()
    elif not any(isinstance(finder, _AfterFairseqImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterFairseqImport())


if __name__ == "__main__":
    import pathlib
    import sysconfig

    target = pathlib.Path(sysconfig.get_path("purelib"), PTH_NAME)
    target.write_text(PTH_LINE)
    print(f"wrote {target}", file=sys.stderr)  # stdout may be a translation (make translate)
else:
    install()
