"""Files that are whole or absent: the scripts' outputs that a resumed run trusts."""

import contextlib
import os
from pathlib import Path


@contextlib.contextmanager
def written_whole(path):
    """Yield a path beside ``path`` to write to; when the block ends without an error, it
    replaces ``path`` in one step, so a stop at any moment leaves the old file or none, never
    part of one."""
    partial = Path(f"{path}.partial")
    yield partial
    os.replace(partial, path)
