#!/usr/bin/env python3
"""Make a fairseq-train --save-dir safe to resume after a stop at any moment.

    python scripts/repair_checkpoints.py SAVE_DIR

fairseq writes each save's first checkpoint aside and renames it, but then *copies* it to
checkpoint_best.pt (when it is the best so far) and checkpoint_last.pt in place. A stop during
a copy leaves a cut file (the next run fails to load it), or a checkpoint_last.pt of the save
before (the next run repeats a save interval of updates), or none after a run's first save (the
next run starts over). The save whose copies were cut is the newest complete checkpoint of the
most updates: a cut copy is replaced by it (and kept as NAME.broken), and so is a
checkpoint_last.pt (or, when that save was the best, a checkpoint_best.pt) that is missing or
older, in updates and in time (a copy put there by hand is newer: it stays). A line per repair;
exits 0 when the directory can be resumed from, else with a one-line error.
"""

import argparse
import os
import re
import shutil
import zipfile
from pathlib import Path

# fairseq and spec_nmt (which imports fairseq) are imported where a checkpoint is read or an
# error raised, not here: the campaign runs this at the start of every stage, and a new stage
# has nothing to repair.

LAST, BEST = "checkpoint_last.pt", "checkpoint_best.pt"
# the files fairseq-train resumes from (not checkpoint_final.pt or checkpoint_avgN.pt: finished
# or averaged models of a run, not points in it)
SAVED_BY_FAIRSEQ = re.compile(r"checkpoint(\d+|_\d+_\d+|_best|_last)\.pt")


def cut_short(path: Path) -> bool:
    """Whether a checkpoint is an incomplete copy. torch.save writes a zip archive: a cut one
    lacks its directory at the end or fails its checksums. (A file in torch's legacy format is
    no zip archive, but loads.)"""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip() is not None
    except zipfile.BadZipFile:
        from spec_nmt.errors import SpecNmtError

        try:
            load(path)
        except SpecNmtError:
            return True
        return False


def load(path: Path) -> dict:
    """fairseq's checkpoint on the CPU (importing spec_nmt lets torch.load read fairseq
    checkpoints; an unreadable one raises SpecNmtError naming it)."""
    import spec_nmt.plugin  # noqa: F401
    from fairseq import checkpoint_utils

    return checkpoint_utils.load_checkpoint_to_cpu(str(path))


def saved_at(path: Path):
    """(updates, val_loss is the best so far) of a complete checkpoint; a file that is whole
    but does not load stops the repair with its own error."""
    state = load(path)
    extra = state.get("extra_state") or {}
    was_best = extra.get("val_loss") is not None and extra.get("val_loss") == extra.get("best")
    return state["optimizer_history"][-1]["num_updates"], was_best


def repair(save_dir: Path) -> list:
    """Repair save_dir's copies as the module says; the repairs made, as (copy, source) pairs."""
    if not save_dir.is_dir():
        from spec_nmt.errors import SpecNmtError

        raise SpecNmtError(f"{save_dir} is not a directory")
    saved = [path for path in save_dir.iterdir() if SAVED_BY_FAIRSEQ.fullmatch(path.name)]
    if not saved:
        return []  # a new run
    from spec_nmt.errors import SpecNmtError
    from spec_nmt.files import written_whole

    cut = {path for path in saved if cut_short(path)}
    if cut == set(saved):
        raise SpecNmtError(
            f"every checkpoint in {save_dir} is cut short ({', '.join(p.name for p in saved)}): "
            "nothing to resume from; move its checkpoint*.pt files away to train from scratch"
        )
    state = {path: saved_at(path) for path in saved if path not in cut}
    # of the most updates; a copy's time is that of its copying: the newest is the cut save's own
    source = max(state, key=lambda path: (state[path][0], path.stat().st_mtime))
    updates, was_best = state[source]

    def behind(copy: Path) -> bool:
        return copy in cut or not copy.exists() or (
            state[copy][0] < updates and copy.stat().st_mtime < source.stat().st_mtime
        )

    best = save_dir / BEST
    copies = [save_dir / LAST] + ([best] if was_best or best in cut else [])
    repairs = []
    for copy in filter(behind, copies):
        if copy in cut:
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
