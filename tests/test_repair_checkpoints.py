"""scripts/repair_checkpoints.py: the copies fairseq makes of a save (checkpoint_last.pt,
checkpoint_best.pt), when a stop cut them short, left them behind or never wrote them, are
restored from the complete checkpoint of the most updates; the campaign repairs a stage before
it goes on with it."""

import os
import subprocess
import sys
import zipfile

import pytest
from fairseq import checkpoint_utils

from spec_nmt.checkpoint_loading import save_checkpoint
from spec_nmt.errors import SpecNmtError
from tests.conftest import REPO, script_module
from tests.test_campaign import campaign, finish, stand_in
from tests.test_errors import assert_one_line_error
from tests.test_learning_curve import epoch_end_line, validation_line

repair = script_module("repair_checkpoints").repair


def repaired(save_dir):
    """The names of the files the repair of save_dir replaced."""
    return sorted(copy.name for copy, _ in repair(save_dir))


@pytest.fixture
def saved(toy):
    """saved(save_dir, name, updates, best=False, age_s=0, truncate=False): a fairseq checkpoint
    (the toy verifier's) written as fairseq-train saves one at `updates`, whose validation was
    the best so far or not, age_s seconds old, perhaps cut in half as a stop during fairseq's
    copy leaves it."""
    state = checkpoint_utils.load_checkpoint_to_cpu(str(toy["verifier"]))

    def save(save_dir, name, updates, best=False, age_s=0, truncate=False):
        save_dir.mkdir(parents=True, exist_ok=True)
        path = save_dir / name
        state["optimizer_history"][-1]["num_updates"] = updates
        state["extra_state"].update(val_loss=5.0, best=5.0 if best else 4.0)
        save_checkpoint(state, path)
        if truncate:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        mtime = path.stat().st_mtime - age_s
        os.utime(path, (mtime, mtime))
        return path

    return save


def test_a_cut_last_is_restored_from_the_checkpoint_of_most_updates_not_the_newest(saved, tmp_path):
    best = saved(tmp_path, "checkpoint_best.pt", 100, best=True, age_s=50).read_bytes()
    source = saved(tmp_path, "checkpoint_2_200.pt", 200, age_s=10)
    saved(tmp_path, "checkpoint_1_150.pt", 150, age_s=5)  # newer, fewer updates
    cut = saved(tmp_path, "checkpoint_last.pt", 200, truncate=True).read_bytes()
    # more updates, but no points of this run to resume from
    saved(tmp_path, "checkpoint_final.pt", 300)
    saved(tmp_path, "checkpoint_last.pt.tmp", 300)
    assert repair(tmp_path) == [(tmp_path / "checkpoint_last.pt", source)]
    assert (tmp_path / "checkpoint_last.pt").read_bytes() == source.read_bytes()
    assert (tmp_path / "checkpoint_last.pt.broken").read_bytes() == cut
    assert (tmp_path / "checkpoint_best.pt").read_bytes() == best  # not that save's: left alone
    assert not list(tmp_path.glob("*.partial"))
    assert repaired(tmp_path) == []


def test_a_cut_best_and_the_last_it_left_behind_both_become_the_save_they_copy(saved, tmp_path):
    saved(tmp_path, "checkpoint_last.pt", 100, age_s=60)  # the save before
    source = saved(tmp_path, "checkpoint_2_200.pt", 200, best=True, age_s=10)
    saved(tmp_path, "checkpoint_best.pt", 200, best=True, age_s=5, truncate=True)
    assert repaired(tmp_path) == ["checkpoint_best.pt", "checkpoint_last.pt"]
    for name in ("checkpoint_last.pt", "checkpoint_best.pt"):
        assert (tmp_path / name).read_bytes() == source.read_bytes()
    assert [path.name for path in tmp_path.glob("*.broken")] == ["checkpoint_best.pt.broken"]


def test_copies_a_first_save_never_made_are_made_and_a_copy_put_by_hand_stays(saved, tmp_path):
    assert repaired(tmp_path) == [] and list(tmp_path.iterdir()) == []  # a new run
    first = saved(tmp_path, "checkpoint_1_50.pt", 50, best=True)
    assert repaired(tmp_path) == ["checkpoint_best.pt", "checkpoint_last.pt"]
    assert (tmp_path / "checkpoint_last.pt").read_bytes() == first.read_bytes()
    # a rollback: the last copy made by hand of an earlier save than the newest
    saved(tmp_path, "checkpoint_2_100.pt", 100, age_s=60)
    saved(tmp_path, "checkpoint_last.pt", 50)
    assert repaired(tmp_path) == []


def test_nothing_to_resume_from_or_a_whole_file_that_is_no_checkpoint_is_refused(saved, tmp_path):
    saved(tmp_path, "checkpoint_last.pt", 50, truncate=True)
    saved(tmp_path, "checkpoint_1_50.pt", 50, truncate=True)
    command = [sys.executable, "scripts/repair_checkpoints.py", str(tmp_path)]
    refused = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert_one_line_error(refused, "every checkpoint in", "is cut short",
                          "move its checkpoint*.pt files away")  # fmt: skip
    foreign = tmp_path / "checkpoint_2_100.pt"
    with zipfile.ZipFile(foreign, "w") as archive:
        archive.writestr("notes.txt", "not a checkpoint")
    with pytest.raises(SpecNmtError, match="checkpoint_2_100.pt is not a readable fairseq"):
        repair(tmp_path)
    with pytest.raises(SpecNmtError, match="nowhere is not a directory"):
        repair(tmp_path / "nowhere")


def test_the_campaign_repairs_a_stage_before_it_resumes_it(saved, tmp_path):
    stage = tmp_path / "work" / "verifier"
    source = saved(stage, "checkpoint_1_200.pt", 200, age_s=5)
    saved(stage, "checkpoint_last.pt", 200, truncate=True)
    # the stand-in fails unless it finds checkpoint_last.pt whole
    check = f"cmp -s {stage / 'checkpoint_last.pt'} {source} || exit 7"
    out, _ = finish(campaign(tmp_path, stand_in(tmp_path, [5.0, 4.0], then=check)), 120)
    assert "checkpoint_last.pt was behind checkpoint_1_200.pt" in out
    # the training went on from the repaired file to its end, then the finishing step ran (it
    # finds no real checkpoints in the stand-in's run, so the stage stays unfinished)
    assert "training failed" not in out
    assert "averaging the verifier's last 5 checkpoints" in out


def test_the_campaign_repairs_a_stage_it_finds_converged_before_the_next_step(saved, tmp_path):
    stage = tmp_path / "work" / "verifier"
    lines = [line for epoch, loss in enumerate([5.0, 4.0, 4.1, 4.2, 4.3], start=1)
             for line in (validation_line(epoch, 100 * epoch, loss), epoch_end_line(epoch))]
    stage.mkdir(parents=True)
    (stage / "train.log").write_text("\n".join(lines) + "\n")
    saved(stage, "checkpoint_5_500.pt", 500, age_s=5)
    saved(stage, "checkpoint_last.pt", 500, truncate=True)
    out, _ = finish(campaign(tmp_path, stand_in(tmp_path, [], then="exit 9")), 120)
    assert "checkpoint_last.pt was behind checkpoint_5_500.pt" in out
    # not trained again: the campaign goes on to the finishing step
    assert ": training" not in out and "averaging the verifier's last 5 checkpoints" in out
