"""Files that are whole or absent: the scripts' outputs that a resumed run trusts; and where this
machine keeps what spec_nmt makes once and reuses (kernel choices, the verifiers' twins)."""

import contextlib
import os
from pathlib import Path

# $XDG_CACHE_HOME/spec-nmt, else ~/.cache/spec-nmt: delete it to make everything again
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spec-nmt"


@contextlib.contextmanager
def written_whole(path):
    """Yield a path beside ``path`` to write to; when the block ends without an error, it
    replaces ``path`` in one step, so a stop at any moment leaves the old file or none, never
    part of one."""
    partial = Path(f"{path}.partial")
    yield partial
    os.replace(partial, path)
