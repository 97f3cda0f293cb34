"""scripts/learning_curve.py --converged: the stopping rule of the model campaign, counted over a
resumed run's logs and over finished epochs only."""

import subprocess
import sys

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "learning_curve.py"


def validation_line(epoch, update, loss):
    return (f"2026-11-23 13:24:56 | INFO | valid | epoch {epoch:03d} | valid on 'valid' subset | "
            f"loss {loss} | nll_loss 5.293 | ppl 39.21 | bleu 6.87 | num_updates {update}")


def epoch_end_line(epoch):
    return (f"2026-11-23 13:24:57 | INFO | fairseq_cli.train | end of epoch {epoch} "
            "(average epoch stats below)")


def run(logs, *flags):
    return subprocess.run([sys.executable, SCRIPT, *logs, *flags], capture_output=True, text=True)


def test_converged_counts_finished_epochs_after_the_best_across_resumed_logs(tmp_path):
    # epoch-end losses 5.0, 4.0 (best), 4.2, 4.0 (equal: no improvement), then a mid-epoch save's
    # validation in epoch 5 and a resumed log that repeats epoch 4's validation and ends epoch 5
    first, resumed = tmp_path / "train.log", tmp_path / "train2.log"
    lines = []
    for epoch, loss in enumerate([5.0, 4.0, 4.2, 4.0], start=1):
        lines += [validation_line(epoch, 100 * epoch, loss), epoch_end_line(epoch)]
    lines.append(validation_line(5, 450, 3.9))
    first.write_text("\n".join(lines) + "\n")
    resumed.write_text("\n".join([validation_line(4, 400, 4.0), validation_line(5, 500, 4.1),
                                  epoch_end_line(5)]) + "\n")  # fmt: skip

    # epoch 5 has not ended in the first log: its mid-epoch 3.9 is no epoch's last validation
    two_after = run([first], "--epoch-ends", "--converged", "3")
    assert two_after.returncode == 1, two_after.stderr
    assert "best loss 4.0 at update 200 (epoch 2), 2 validation(s) after it" in two_after.stdout
    # the resumed log ends epoch 5 at 4.1: three epochs without improvement
    three_after = run([first, resumed], "--epoch-ends", "--converged", "3")
    assert three_after.returncode == 0, three_after.stderr
    assert "update 200 (epoch 2), 3 validation(s) after it" in three_after.stdout
    # every validation counted: the mid-epoch 3.9 is the best, with one after it
    every = run([first, resumed], "--converged", "1")
    assert every.returncode == 0
    assert "best loss 3.9 at update 450 (epoch 5), 1 validation(s) after it" in every.stdout
    # a metric to maximize: the best is the first 5.0 of loss read as "higher is better"
    assert "best loss 5.0 at update 100" in run([first], "--maximize").stdout


def test_a_stop_before_the_epoch_end_line_still_ends_the_epoch_once_the_next_begins(tmp_path):
    log = tmp_path / "train.log"
    lines = [validation_line(1, 100, 5.0), epoch_end_line(1), validation_line(2, 200, 5.1),
             "2026-11-23 15:30:01 | INFO | fairseq.trainer | begin training epoch 3"]  # fmt: skip
    log.write_text("\n".join(lines) + "\n")
    assert "1 validation(s) after it" in run([log], "--epoch-ends").stdout


def test_errors_exit_2_in_one_line_not_1_as_not_converged(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("nothing validated\n")
    result = run([log])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"learning_curve.py: no validations in {log}"]
    assert run([log], "--converged", "3").returncode == 1  # not validated yet: not converged
    log.write_text(validation_line(1, 100, 5.0) + "\n" + epoch_end_line(1) + "\n")
    result = run([log], "--converged", "3", "--best-metric", "accepted_lossless")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "learning_curve.py: --best-metric accepted_lossless: not logged at every validation"
    ]
    log.write_text(validation_line(1, 100, 5.0)[:-40] + "\n")  # a line cut short
    result = run([log], "--converged", "3")
    assert result.returncode == 2  # (it lacks num_updates)
    assert result.stderr.strip().splitlines() == ["learning_curve.py: KeyError: 'num_updates'"]


def test_min_delta_counts_only_gains_larger_than_it_as_improvements(tmp_path):
    # acceptance to maximize, epoch by epoch: 1.0, 1.5, then creeping by thousandths
    log = tmp_path / "train.log"
    lines = []
    for epoch, accepted in enumerate([1.0, 1.5, 1.505, 1.508, 1.509, 1.512], start=1):
        lines += [validation_line(epoch, 100 * epoch, accepted), epoch_end_line(epoch)]
    log.write_text("\n".join(lines) + "\n")
    flags = ["--epoch-ends", "--maximize", "--converged", "3"]
    plain = run([log], *flags)
    assert plain.returncode == 1  # every thousandth is an improvement: still rising
    assert "best loss 1.512 at update 600 (epoch 6), 0 validation(s) after it" in plain.stdout
    # gains over the best 1.5 of 0.005, 0.008, 0.009: none; then 0.012: a new best
    some = run([log], *flags, "--min-delta", "0.01")
    assert "best loss 1.512 at update 600 (epoch 6), 0 validation(s) after it" in some.stdout
    assert some.returncode == 1
    stopped = run([log], *flags, "--min-delta", "0.02")
    assert "best loss 1.5 at update 200 (epoch 2), 4 validation(s) after it" in stopped.stdout
    assert stopped.returncode == 0
    # to minimize: a fall of exactly D is no improvement
    falling = tmp_path / "falling.log"
    falling.write_text("\n".join([validation_line(1, 100, 5.0), epoch_end_line(1),
                                  validation_line(2, 200, 4.5), epoch_end_line(2)]) + "\n")  # fmt: skip
    assert "best loss 5.0 at update 100" in run([falling], "--min-delta", "0.5").stdout
    assert "best loss 4.5 at update 200" in run([falling], "--min-delta", "0.4").stdout
    # a gain of exactly D is none, whatever the floats make of the difference (1.51 - 1.5 > 0.01)
    exact = tmp_path / "exact.log"
    exact.write_text("\n".join([validation_line(1, 100, 1.5), validation_line(2, 200, 1.51)]) + "\n")
    assert "best loss 1.5 at update 100" in run([exact], "--maximize", "--min-delta", "0.01").stdout
    bad = run([tmp_path / "empty.log"], "--converged", "3", "--min-delta", "-1")  # before reading
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == ["learning_curve.py: --min-delta must be >= 0, got -1"]


def train_inner_line(update, seconds):
    return (f"2026-11-23 13:20:00 | INFO | train_inner | epoch 001:     50 / 653 loss=9.1, "
            f"ups=0.75, num_updates={update}, lr=0.0001, gnorm=0.6, clip=0, train_wall={seconds}, "
            "wall=0")


def test_training_time_sums_train_wall_over_resumed_logs(tmp_path):
    first, resumed = tmp_path / "train.log", tmp_path / "train2.log"
    first.write_text("\n".join([train_inner_line(50, 66), train_inner_line(100, 70),
                                validation_line(1, 100, 5.0)]) + "\n")  # fmt: skip
    # the resumed run redid updates 51-100: that took time again
    resumed.write_text("\n".join([train_inner_line(100, 3464), validation_line(1, 100, 5.0)]) + "\n")
    assert "training steps: 1.00 h (train_wall" in run([first, resumed]).stdout
    assert "training steps: 0.04 h" in run([first]).stdout
