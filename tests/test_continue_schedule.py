"""scripts/continue_schedule.py: a checkpoint saved without optimizer state (the shared warm
start) resumes in fairseq-train at its saved update count, so the learning-rate schedule goes on."""

import subprocess
import sys

import torch

from tests.conftest import OPTIMIZATION, REPO, TINY_TRANSFORMER, fairseq_in_process


def continue_schedule(*args):
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "continue_schedule.py"), *map(str, args)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_a_weights_only_checkpoint_resumes_at_its_update_count(toy, tmp_path):
    state = torch.load(toy["verifier"], weights_only=False)
    updates = state["optimizer_history"][-1]["num_updates"]
    state["last_optimizer_state"] = None
    weights_only, resumable = tmp_path / "weights_only.pt", tmp_path / "resumable.pt"
    torch.save(state, weights_only)
    made = continue_schedule(weights_only, resumable, "--data", toy["bin"])
    assert made.returncode == 0, made.stderr[-2000:]

    def train():
        return fairseq_in_process(
            "train", toy["bin"], "--arch", "transformer", *TINY_TRANSFORMER, *OPTIMIZATION,
            "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", 0.1,
            "--max-update", updates + 5, "--save-dir", tmp_path / "save", "--continue-once", resumable,
        )  # fmt: skip

    first = train()
    assert f"Loaded checkpoint {resumable} (epoch" in first and f"@ {updates} updates)" in first
    assert f"num_updates {updates + 5}" in first
    # the same command again resumes from the save directory, not from the warm start
    assert f"@ {updates + 5} updates" in train()


def test_a_checkpoint_with_optimizer_state_is_refused(toy, tmp_path):
    refused = continue_schedule(toy["verifier"], tmp_path / "out.pt")
    assert refused.returncode != 0
    assert "already has optimizer state: resume it as it is" in refused.stderr.strip().splitlines()[-1]
