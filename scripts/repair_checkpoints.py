#!/usr/bin/env python3
"""Make a fairseq-train --save-dir safe to resume after a stop at any moment.

    python scripts/repair_checkpoints.py SAVE_DIR

fairseq writes each save's first checkpoint aside and renames it, but then *copies* it to
checkpoint_best.pt and checkpoint_last.pt in place: a stop during a copy leaves a truncated
file, and the next run would fail to resume from it; a stop during the first save's copy to
checkpoint_best.pt leaves no checkpoint_last.pt, and the next run would start from scratch. Such
a file is an unfinished copy of the newest checkpoint that reads whole, so it is replaced by that
one (a line per repair). Exits 0 when the directory can be resumed from, else with a one-line
error (a broken file without an intact source).
"""

import argparse
import re
import shutil
from pathlib import Path

from fairseq import checkpoint_utils

# (importing it lets torch.load read fairseq checkpoints and makes an unreadable one a
# SpecNmtError)
import spec_nmt.checkpoint_loading  # noqa: F401
from spec_nmt.errors import SpecNmtError
from spec_nmt.files import written_whole

COPIES = ("checkpoint_last.pt", "checkpoint_best.pt")
# what fairseq-train saves (not checkpoint_final.pt and the like, which lack optimizer state)
SAVED_BY_FAIRSEQ = re.compile(r"checkpoint(\d+|_\d+_\d+|_best|_last)\.pt")


def readable(path: Path) -> bool:
    try:
        checkpoint_utils.load_checkpoint_to_cpu(str(path))
    except SpecNmtError:
        return False
    return True


def repair(save_dir: Path) -> list:
    """Replace each broken copy in save_dir by the newest readable checkpoint; the repairs made,
    as (broken, source) pairs."""
    if not save_dir.is_dir():
        raise SpecNmtError(f"{save_dir} is not a directory")
    saved = [path for path in save_dir.iterdir() if SAVED_BY_FAIRSEQ.fullmatch(path.name)]
    if not saved:
        return []  # a new run
    last = save_dir / COPIES[0]
    broken = [save_dir / name for name in COPIES if (save_dir / name).exists()]
    broken = [path for path in broken if not readable(path)]
    broken += [] if last.exists() else [last]
    if not broken:
        return []
    sources = sorted(
        (path for path in saved if path not in broken),
        key=lambda path: path.stat().st_mtime, reverse=True,
    )  # fmt: skip
    source = next((path for path in sources if readable(path)), None)
    if source is None:
        raise SpecNmtError(
            f"{', '.join(map(str, broken))} cannot be read and {save_dir} holds no readable "
            "checkpoint to restore it from: move it away to train from scratch"
        )
    for path in broken:
        with written_whole(path) as partial:
            shutil.copyfile(source, partial)
    return [(path, source) for path in broken]


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("save_dir", type=Path, help="fairseq-train --save-dir")
    args = parser.parse_args()
    for broken, source in repair(args.save_dir):
        print(f"repair_checkpoints: {broken} was missing or unreadable: replaced by {source.name}")


if __name__ == "__main__":
    main()
