"""spec_nmt: speculative decoding for fairseq translation models, as a ``--user-dir`` plugin."""

import sys

from spec_nmt.errors import install_error_hook

install_error_hook()
if "fairseq" in sys.modules:  # fairseq's commands with --user-dir spec_nmt, or its Python API
    from spec_nmt import plugin  # noqa: F401
