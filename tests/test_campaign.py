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
    ``then`` (a shell command)."""
    lines = []
    for epoch, loss in enumerate(losses, start=1):
        lines += [validation_line(epoch, 100 * epoch, loss), epoch_end_line(epoch)]
    bin_dir = tmp_path / "stand-in"
    bin_dir.mkdir()
    log = tmp_path / "scripted.log"
    log.write_text("\n".join(lines) + "\n")
    script = bin_dir / "fairseq-train"
    script.write_text(f"#!/bin/bash\necho $$ > {tmp_path}/pid\ncat {log}\n{then}\n")
    script.chmod(0o755)
    return bin_dir


def campaign(tmp_path, bin_dir, patience="3"):
    """The campaign on empty data paths (the stand-in reads nothing) under tmp_path/work."""
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}",
               PATIENCE=patience)  # fmt: skip
    command = ["scripts/campaign.sh", tmp_path / "bin", tmp_path / "spm.model", tmp_path / "raw",
               tmp_path / "work"]  # fmt: skip
    return subprocess.Popen([str(c) for c in command], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_converged_stage_is_stopped_and_the_campaign_goes_on(tmp_path):
    # best at epoch 2, then 3 epochs without a lower loss (one equal): converged at epoch 5
    bin_dir = stand_in(tmp_path, [5.0, 4.0, 4.1, 4.0, 4.3], then="sleep 300")
    run = campaign(tmp_path, bin_dir)
    out, err = run.communicate(timeout=120)
    stage = tmp_path / "work" / "verifier"
    assert "best loss 4.0 at update 200 (epoch 2), 3 validation(s) after it" in (
        stage / "FINISHED"
    ).read_text()
    assert not alive(int((tmp_path / "pid").read_text()))
    # the next step ran: finish_verifier.py, which finds no checkpoints in the stand-in's run
    assert "averaging the verifier's last 5 checkpoints" in out
    assert run.returncode != 0 and "checkpoint_best.pt is missing" in err


def test_a_crash_before_convergence_stops_the_campaign_and_the_stage_stays_unfinished(tmp_path):
    bin_dir = stand_in(tmp_path, [5.0, 4.0], then="exit 3")
    run = campaign(tmp_path, bin_dir)
    out, _ = run.communicate(timeout=120)
    assert run.returncode == 3
    assert "training failed (exit status 3)" in out and "averaging" not in out
    assert not (tmp_path / "work" / "verifier" / "FINISHED").exists()
    refused = campaign(tmp_path, bin_dir, patience="three")
    _, err = refused.communicate(timeout=60)
    assert refused.returncode == 2 and "PATIENCE must be a number, got three" in err


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_stopping_the_campaign_stops_its_training(tmp_path, stop):
    bin_dir = stand_in(tmp_path, [5.0, 4.0], then="sleep 300")
    run = campaign(tmp_path, bin_dir)
    pid_file = tmp_path / "pid"
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline and run.poll() is None, run.communicate()
        time.sleep(0.1)
    training = int(pid_file.read_text())
    run.send_signal(stop)
    run.communicate(timeout=30)
    assert run.returncode != 0
    deadline = time.monotonic() + 10
    while alive(training) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(training)
    assert not (tmp_path / "work" / "verifier" / "FINISHED").exists()
