"""Drafter training under fairseq's own distributed training: two processes on this CPU (gloo),
launched the way fairseq launches one process per node."""

import re
import socket
import subprocess

from tests.conftest import BIN, BLOCK_SIZE, OPTIMIZATION, TINY_DRAFTER, USER_DIR


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def batches_per_epoch(log):
    return int(re.search(r"epoch 001:\s+\d+ / (\d+)", log).group(1))


def test_two_process_gloo_training_shards_the_data(toy, tmp_path):
    port = free_port()
    command = [
        str(BIN / "fairseq-train"), str(toy["bin"]), "--user-dir", USER_DIR,
        "--task", "spec_translation", "--block-size", str(BLOCK_SIZE),
        "--criterion", "spec_drafter_loss", *TINY_DRAFTER, *map(str, OPTIMIZATION),
        "--max-update", "4", "--log-interval", "1", "--save-dir", str(tmp_path / "ddp"),
        "--distributed-world-size", "2", "--distributed-backend", "gloo",
        "--distributed-init-method", f"tcp://127.0.0.1:{port}", "--distributed-no-spawn",
        "--ddp-backend", "legacy_ddp",
    ]  # fmt: skip
    single = subprocess.run(
        command[:command.index("--distributed-world-size")] + ["--max-update", "1", "--no-save"],
        capture_output=True, text=True, check=True, timeout=600,
    ).stdout  # fmt: skip
    processes = [
        subprocess.Popen(command + ["--distributed-rank", str(rank)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
        for rank in (1, 0)
    ]  # fmt: skip
    logs = [p.communicate(timeout=600)[0] for p in processes]
    assert [p.returncode for p in processes] == [0, 0], logs[1][-3000:]
    rank0 = logs[1]
    assert "training on 2 devices" in rank0
    assert "num_updates 4" in rank0
    assert (tmp_path / "ddp" / "checkpoint_last.pt").is_file()  # written by rank 0
    # each rank reads half of the batches a single process reads
    full = batches_per_epoch(single)
    assert batches_per_epoch(rank0) in (full // 2, (full + 1) // 2)
