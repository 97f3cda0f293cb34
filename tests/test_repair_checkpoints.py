"""scripts/repair_checkpoints.py: a checkpoint_last.pt or checkpoint_best.pt that a stop cut short
(or a checkpoint_last.pt never written) is restored from the newest readable checkpoint, and the
campaign repairs a stage before it resumes it."""

import os
import subprocess
import sys

from tests.conftest import REPO
from tests.test_campaign import campaign, finish, stand_in
from tests.test_errors import assert_one_line_error


def repair(save_dir):
    return subprocess.run(
        [sys.executable, "scripts/repair_checkpoints.py", str(save_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def saved(save_dir, name, source, age_s=0, truncate=False):
    """Copy a real fairseq checkpoint into save_dir as name, age_s seconds old, perhaps cut in
    half as a stop during fairseq's copy leaves it."""
    save_dir.mkdir(parents=True, exist_ok=True)
    path = save_dir / name
    data = source.read_bytes()
    path.write_bytes(data[: len(data) // 2] if truncate else data)
    mtime = path.stat().st_mtime - age_s
    os.utime(path, (mtime, mtime))
    return path


def test_cut_copies_are_restored_from_the_newest_readable_checkpoint(toy, tmp_path):
    # best is from an earlier save; the newest save (update 200) was being copied to last
    older = saved(tmp_path, "checkpoint_1_100.pt", toy["verifier"], age_s=60)
    newest = saved(tmp_path, "checkpoint_2_200.pt", toy["ar_drafter"], age_s=10)
    best = saved(tmp_path, "checkpoint_best.pt", toy["verifier"], age_s=50)
    saved(tmp_path, "checkpoint_last.pt", toy["ar_drafter"], truncate=True)
    saved(tmp_path, "checkpoint_final.pt", toy["drafter"])  # newer, but not fairseq's: no source
    result = repair(tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"repair_checkpoints: {tmp_path / 'checkpoint_last.pt'} was missing or unreadable: "
        "replaced by checkpoint_2_200.pt"
    ]
    assert (tmp_path / "checkpoint_last.pt").read_bytes() == newest.read_bytes()
    assert best.read_bytes() == older.read_bytes()  # readable: left alone
    assert not list(tmp_path.glob("*.partial"))
    again = repair(tmp_path)
    assert again.returncode == 0 and again.stdout == ""


def test_a_missing_last_after_a_first_save_is_restored_and_a_new_run_is_left_alone(toy, tmp_path):
    assert repair(tmp_path).stdout == ""  # nothing saved yet: a new run
    interval = saved(tmp_path, "checkpoint_1_50.pt", toy["verifier"], age_s=5)
    saved(tmp_path, "checkpoint_best.pt", toy["verifier"], truncate=True)
    result = repair(tmp_path)
    assert result.returncode == 0, result.stderr
    for name in ("checkpoint_last.pt", "checkpoint_best.pt"):
        assert (tmp_path / name).read_bytes() == interval.read_bytes()


def test_a_cut_copy_without_a_readable_source_is_refused_in_one_line(toy, tmp_path):
    saved(tmp_path, "checkpoint_last.pt", toy["verifier"], truncate=True)
    saved(tmp_path, "checkpoint_1_50.pt", toy["verifier"], truncate=True)
    assert_one_line_error(repair(tmp_path), "holds no readable checkpoint to restore it from")
    assert_one_line_error(repair(tmp_path / "nowhere"), "is not a directory")


def test_the_campaign_repairs_a_stage_before_it_resumes_it(toy, tmp_path):
    stage = tmp_path / "work" / "verifier"
    intact = saved(stage, "checkpoint_1_100.pt", toy["verifier"], age_s=5)
    saved(stage, "checkpoint_last.pt", toy["verifier"], truncate=True)
    # the stand-in fails unless it finds checkpoint_last.pt whole
    check = f"cmp -s {stage / 'checkpoint_last.pt'} {intact} || exit 7"
    out, _ = finish(campaign(tmp_path, stand_in(tmp_path, [5.0, 4.0], then=check)), 120)
    assert "checkpoint_last.pt was missing or unreadable: replaced by checkpoint_1_100.pt" in out
    assert "training failed" not in out and (stage / "FINISHED").exists()
