"""scripts/campaign.sh's control of a training stage, with a stand-in fairseq-train that writes a
scripted log: it stops a stage that has converged and goes on, stops on a crash without marking
the stage finished, and takes its training down with it when it is stopped. (The whole campaign
with real training runs in test_pipeline.py.)"""

import os
import signal
import subprocess
import time

import pytest

from tests.conftest import BIN, REPO
from tests.test_learning_curve import epoch_end_line, validation_line


def stand_in(tmp_path, losses, then):
    """A fairseq-train that logs one validated epoch per loss, writes its pid, then runs
    ``then`` (a shell command; "sleep &" and "wait" leave a child of its own, as fairseq-train's
    data loader workers are, whose pid goes to tmp_path/worker)."""
    lines = []
    for epoch, loss in enumerate(losses, start=1):
        lines += [validation_line(epoch, 100 * epoch, loss), epoch_end_line(epoch)]
    bin_dir = tmp_path / "stand-in"
    bin_dir.mkdir()
    log = tmp_path / "scripted.log"
    log.write_text("\n".join(lines) + "\n")
    script = bin_dir / "fairseq-train"
    script.write_text(f"#!/bin/bash\ncat {log}\n{then}\n")
    script.chmod(0o755)
    return bin_dir


def waiting(tmp_path):
    """A stand-in's end that waits, with a child of its own; both pids go to tmp_path."""
    return f"echo $$ > {tmp_path}/pid; sleep 300 & echo $! > {tmp_path}/worker; wait"


def campaign(tmp_path, bin_dir, patience="3", comparison_epochs="10"):
    """The campaign on empty data paths (the stand-in reads nothing) under tmp_path/work, with
    SIGINT handled as a terminal would (a test runner started in the background ignores it)."""
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}",
               PATIENCE=patience, COMPARISON_EPOCHS=comparison_epochs)  # fmt: skip
    command = ["scripts/campaign.sh", tmp_path / "bin", tmp_path / "spm.model", tmp_path / "raw",
               tmp_path / "work"]  # fmt: skip
    return subprocess.Popen(
        [str(c) for c in command], cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def cleanup(tmp_path):
    """Whatever a failed test left running: the stand-in's process group and its worker."""
    yield
    for name in ("pid", "worker"):
        path = tmp_path / name
        if path.exists() and path.read_text().strip():
            pid = int(path.read_text())
            for kill in (os.killpg, os.kill):  # its group if it leads one, else the process
                try:
                    kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


def started(run, tmp_path) -> None:
    """Wait (60 s at most) until the stand-in of campaign ``run`` has written both its pids."""
    deadline = time.monotonic() + 60
    while not all((tmp_path / name).is_file() and (tmp_path / name).read_text().strip()
                  for name in ("pid", "worker")):  # fmt: skip
        if time.monotonic() > deadline or run.poll() is not None:
            run.kill()
            pytest.fail(f"the stand-in did not start: {run.communicate()}")
        time.sleep(0.1)


def stopped(tmp_path) -> bool:
    """Whether the stand-in and its worker are gone (allowing them 10 s)."""
    pids = [int((tmp_path / name).read_text()) for name in ("pid", "worker")]
    deadline = time.monotonic() + 10
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(map(alive, pids))


def finish(run, timeout):
    """The campaign's (stdout, stderr), killed if it runs past timeout seconds."""
    try:
        return run.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        run.kill()
        out, err = run.communicate()
        pytest.fail(f"the campaign ran past {timeout} s:\n{out}\n{err}")


def test_a_converged_stage_is_stopped_and_the_campaign_goes_on(tmp_path, cleanup):
    # best at epoch 2, then 3 epochs without a lower loss (one equal): converged at epoch 5
    bin_dir = stand_in(tmp_path, [5.0, 4.0, 4.1, 4.0, 4.3], then=waiting(tmp_path))
    out, err = finish(campaign(tmp_path, bin_dir), 120)
    assert stopped(tmp_path)  # the stand-in and its worker
    # the next step ran: finish_verifier.py, which finds no checkpoints in the stand-in's run
    assert "averaging the verifier's last 5 checkpoints" in out
    assert "checkpoint_best.pt is missing" in err
    # ... so the stage is not FINISHED: a rerun runs that step again instead of skipping it
    assert not (tmp_path / "work" / "verifier" / "FINISHED").exists()


def test_a_verifier_stage_finished_without_its_finishing_step_gets_it(tmp_path):
    """A WORK_DIR whose verifier stage an older campaign marked FINISHED before
    finish_verifier.py ran: the step runs (and here fails: no checkpoints), training does not."""
    stage = tmp_path / "work" / "verifier"
    stage.mkdir(parents=True)
    (stage / "FINISHED").write_text("learning curve\n")
    run = campaign(tmp_path, stand_in(tmp_path, [5.0], then="exit 3"))
    out, err = finish(run, 120)
    assert "finished before" in out and "training" not in out.split("finished before")[1]
    assert "averaging the verifier's last 5 checkpoints" in out
    assert run.returncode != 0 and "checkpoint_best.pt is missing" in err


def test_a_crash_before_convergence_stops_the_campaign_and_the_stage_stays_unfinished(tmp_path):
    bin_dir = stand_in(tmp_path, [5.0, 4.0], then="exit 3")
    run = campaign(tmp_path, bin_dir)
    out, _ = finish(run, 120)
    assert run.returncode == 3
    assert "training failed (exit status 3)" in out and "averaging" not in out
    assert not (tmp_path / "work" / "verifier" / "FINISHED").exists()
    refused = campaign(tmp_path, bin_dir, patience="three")
    _, err = finish(refused, 60)
    assert refused.returncode == 2 and "PATIENCE must be a number, got three" in err
    refused = campaign(tmp_path, bin_dir, comparison_epochs="0")
    _, err = finish(refused, 60)
    assert refused.returncode == 2 and "COMPARISON_EPOCHS must be a positive number, got 0" in err


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_stopping_the_campaign_stops_its_training(tmp_path, cleanup, stop):
    bin_dir = stand_in(tmp_path, [5.0, 4.0], then=waiting(tmp_path))
    run = campaign(tmp_path, bin_dir)
    started(run, tmp_path)
    run.send_signal(stop)
    finish(run, 30)
    assert run.returncode != 0
    assert stopped(tmp_path)
    assert not (tmp_path / "work" / "verifier" / "FINISHED").exists()


def test_a_second_campaign_is_refused_while_a_step_of_a_killed_one_still_runs(tmp_path, cleanup):
    """SIGKILL leaves the campaign no trap to stop its step: the orphaned training holds the
    campaign's lock, so a restarted campaign refuses to train beside it until it is gone."""
    bin_dir = stand_in(tmp_path, [5.0, 4.0], then=waiting(tmp_path))
    run = campaign(tmp_path, bin_dir)
    started(run, tmp_path)
    run.kill()
    finish(run, 30)
    orphan = int((tmp_path / "pid").read_text())
    assert alive(orphan)
    second = campaign(tmp_path, bin_dir)
    _, err = finish(second, 60)
    assert second.returncode == 1
    assert "in use by another campaign" in err and err.strip().endswith("stop it first"), err
    assert alive(orphan)
    os.killpg(orphan, signal.SIGKILL)  # the stand-in leads its group (setsid): its worker too
    assert stopped(tmp_path)
    for name in ("pid", "worker"):
        (tmp_path / name).write_text("")
    third = campaign(tmp_path, bin_dir)  # the lock is free again: the stage trains
    started(third, tmp_path)
    third.send_signal(signal.SIGTERM)
    finish(third, 30)
    assert stopped(tmp_path)


def test_help_prints_a_clean_usage_line_and_missing_arguments_exit_2(tmp_path):
    def run(*args):
        return subprocess.run(["scripts/campaign.sh", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=60)  # fmt: skip

    usage = "usage: scripts/campaign.sh DATA_BIN SPM_MODEL RAW_DIR WORK_DIR [fairseq-train flags]"
    for flag in ("--help", "-h"):
        helped = run(flag)
        assert (helped.returncode, helped.stdout, helped.stderr) == (0, usage + "\n", "")
    short = run(str(tmp_path), str(tmp_path))
    assert (short.returncode, short.stdout, short.stderr) == (2, "", usage + "\n")
