#!/usr/bin/env python3
"""Make a fairseq-train --save-dir safe to resume after a stop at any moment.

    python scripts/repair_checkpoints.py SAVE_DIR

fairseq writes each save's first checkpoint aside and renames it, but then *copies* it to
checkpoint_best.pt and checkpoint_last.pt in place. A stop during a copy leaves a truncated
file (the next run fails to resume from it), or a checkpoint_last.pt older than the save that
was completed (the next run repeats up to 500 updates), or none after a run's first save (the
next run starts from scratch). The checkpoint of the most updates that reads whole is what the
cut copies should have been: an unreadable checkpoint_best.pt, and a checkpoint_last.pt that is
unreadable, missing or of fewer updates, are replaced by it (the unreadable one kept as
NAME.broken; a line per repair). Exits 0 when the directory can be resumed from, else with a
one-line error.
"""

import argparse
import os
import re
import shutil
from pathlib import Path
from typing import Optional

from spec_nmt.errors import SpecNmtError
from spec_nmt.files import written_whole

LAST, BEST = "checkpoint_last.pt", "checkpoint_best.pt"
# the files fairseq-train resumes from (not checkpoint_final.pt or checkpoint_avgN.pt: finished
# or averaged models of a run, not points in it)
SAVED_BY_FAIRSEQ = re.compile(r"checkpoint(\d+|_\d+_\d+|_best|_last)\.pt")


def updates_saved(path: Path) -> Optional[int]:
    """The update count a checkpoint was saved at; None when it cannot be read."""
    # imported here: a new stage's empty directory is checked without loading torch and fairseq
    from fairseq import checkpoint_utils

    import spec_nmt.checkpoint_loading  # noqa: F401  (unreadable files raise SpecNmtError)

    try:
        state = checkpoint_utils.load_checkpoint_to_cpu(str(path))
    except SpecNmtError:
        return None
    return state["optimizer_history"][-1]["num_updates"]


def repair(save_dir: Path) -> list:
    """Repair save_dir's copies as the module says; the repairs made, as (copy, source) pairs."""
    if not save_dir.is_dir():
        raise SpecNmtError(f"{save_dir} is not a directory")
    saved = [path for path in save_dir.iterdir() if SAVED_BY_FAIRSEQ.fullmatch(path.name)]
    if not saved:
        return []  # a new run
    updates = {path: updates_saved(path) for path in saved}
    readable = [path for path in saved if updates[path] is not None]
    if not readable:
        raise SpecNmtError(
            f"no checkpoint in {save_dir} can be read ({', '.join(p.name for p in saved)}): "
            "move its checkpoint*.pt files away to train from scratch"
        )
    # of the most updates; a copy's time is its copying: the newest is the cut save's own
    source = max(readable, key=lambda path: (updates[path], path.stat().st_mtime))
    last, best = save_dir / LAST, save_dir / BEST
    stale = [best] if best in saved and updates[best] is None else []
    if last not in readable or updates[last] < updates[source]:
        stale.append(last)
    repairs = []
    for copy in stale:
        if copy == source:
            continue
        if copy.exists() and updates[copy] is None:
            os.replace(copy, f"{copy}.broken")
        with written_whole(copy) as partial:
            shutil.copyfile(source, partial)
        repairs.append((copy, source))
    return repairs


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("save_dir", type=Path, help="fairseq-train --save-dir")
    args = parser.parse_args()
    for copy, source in repair(args.save_dir):
        print(f"repair_checkpoints: {copy} was behind {source.name} (cut short, missing or "
              f"older): replaced by a copy of it")


if __name__ == "__main__":
    main()
