"""scripts/repair_checkpoints.py: the copies fairseq makes of a save (checkpoint_last.pt,
checkpoint_best.pt), when a stop cut them short, left checkpoint_last.pt behind or never wrote
it, are restored from the readable checkpoint of the most updates; the campaign repairs a stage
before it goes on with it."""

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


def repaired(result):
    """The names of the files a successful repair replaced."""
    assert result.returncode == 0, result.stderr
    return [line.split(" was behind ")[0].rsplit("/", 1)[-1] for line in result.stdout.splitlines()]


def test_a_cut_last_is_restored_from_the_checkpoint_of_most_updates_not_the_newest(toy, tmp_path):
    # (the toy checkpoints: ar_drafter saved at update 200, untrained_drafter at 1, verifier 300)
    most = saved(tmp_path, "checkpoint_2_200.pt", toy["ar_drafter"], age_s=60)
    saved(tmp_path, "checkpoint_3_1.pt", toy["untrained_drafter"], age_s=5)  # newer, fewer updates
    best = saved(tmp_path, "checkpoint_best.pt", toy["untrained_drafter"], age_s=50)
    cut = saved(tmp_path, "checkpoint_last.pt", toy["ar_drafter"], truncate=True).read_bytes()
    # more updates, but not points of this run to resume from
    saved(tmp_path, "checkpoint_final.pt", toy["verifier"])
    saved(tmp_path, "checkpoint_last.pt.tmp", toy["verifier"])
    result = repair(tmp_path)
    assert repaired(result) == ["checkpoint_last.pt"]
    assert "checkpoint_last.pt was behind checkpoint_2_200.pt" in result.stdout
    assert (tmp_path / "checkpoint_last.pt").read_bytes() == most.read_bytes()
    assert (tmp_path / "checkpoint_last.pt.broken").read_bytes() == cut
    assert best.read_bytes() == toy["untrained_drafter"].read_bytes()  # readable: left alone
    assert not list(tmp_path.glob("*.partial"))
    again = repair(tmp_path)
    assert again.returncode == 0 and again.stdout == ""


def test_a_cut_best_and_the_last_it_left_behind_both_become_the_save_they_copy(toy, tmp_path):
    saved(tmp_path, "checkpoint_last.pt", toy["untrained_drafter"], age_s=60)  # the save before
    interval = saved(tmp_path, "checkpoint_2_200.pt", toy["ar_drafter"], age_s=5)
    saved(tmp_path, "checkpoint_best.pt", toy["ar_drafter"], truncate=True)
    assert sorted(repaired(repair(tmp_path))) == ["checkpoint_best.pt", "checkpoint_last.pt"]
    for name in ("checkpoint_last.pt", "checkpoint_best.pt"):
        assert (tmp_path / name).read_bytes() == interval.read_bytes()
    assert [path.name for path in tmp_path.glob("*.broken")] == ["checkpoint_best.pt.broken"]


def test_a_last_a_first_save_never_wrote_is_restored_and_a_new_run_is_left_alone(toy, tmp_path):
    new_run = repair(tmp_path)
    assert repaired(new_run) == [] and list(tmp_path.iterdir()) == []
    interval = saved(tmp_path, "checkpoint_1_1.pt", toy["untrained_drafter"])
    assert repaired(repair(tmp_path)) == ["checkpoint_last.pt"]
    assert (tmp_path / "checkpoint_last.pt").read_bytes() == interval.read_bytes()


def test_a_directory_without_a_readable_checkpoint_is_refused_in_one_line(toy, tmp_path):
    saved(tmp_path, "checkpoint_last.pt", toy["verifier"], truncate=True)
    saved(tmp_path, "checkpoint_1_50.pt", toy["verifier"], truncate=True)
    assert_one_line_error(
        repair(tmp_path), "no checkpoint in", "can be read", "move its checkpoint*.pt files away"
    )
    assert_one_line_error(repair(tmp_path / "nowhere"), "is not a directory")


def test_the_campaign_repairs_a_stage_before_it_resumes_it(toy, tmp_path):
    stage = tmp_path / "work" / "verifier"
    intact = saved(stage, "checkpoint_1_200.pt", toy["ar_drafter"], age_s=5)
    saved(stage, "checkpoint_last.pt", toy["ar_drafter"], truncate=True)
    # the stand-in fails unless it finds checkpoint_last.pt whole
    check = f"cmp -s {stage / 'checkpoint_last.pt'} {intact} || exit 7"
    out, _ = finish(campaign(tmp_path, stand_in(tmp_path, [5.0, 4.0], then=check)), 120)
    assert "checkpoint_last.pt was behind checkpoint_1_200.pt" in out
    assert "training failed" not in out and (stage / "FINISHED").exists()
