"""The kernel-choice benchmark mode (benchmarks/kernel_choice.py) end to end: both choices timed
in records of their own (the user's is neither read nor written), each decoding every line as
the other does."""

import json
import os
import subprocess
import sys

import pytest

from spec_nmt.decoding.linears import packing_available
from tests.conftest import BUNDLED_MODEL_DIR, REPO


@pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN")
def test_the_mode_times_both_choices_apart_from_the_users_record(tmp_path):
    result = tmp_path / "choice.json"
    cache = tmp_path / "cache"
    subprocess.run([sys.executable, "benchmarks/benchmark.py", "kernel-choice",
                    str(BUNDLED_MODEL_DIR), "--src", str(REPO / "data" / "examples.de"),
                    "--lines", "2", "--rounds", "1", "--blocks", "0,3", "--warmup-lines", "0",
                    "--threads", "1", "--json", str(result)], cwd=REPO, check=True,
                   capture_output=True,
                   env=dict(os.environ, XDG_CACHE_HOME=str(cache)))  # fmt: skip
    found = json.loads(result.read_text())
    assert [(row["choice"], row["block"]) for row in found["rows"]] == [
        ("streamed (default)", 0), ("in cache", 0), ("streamed (default)", 3), ("in cache", 3)]
    assert all(row["identical_to_default"] == 2 for row in found["rows"])
    chosen = found["packed_from_rows"]
    assert set(chosen) == {"streamed (default)", "in cache"}
    assert all(shapes for roles in chosen.values() for shapes in roles.values()), "none timed"
    assert not cache.exists(), "the user's record was written"
