"""The kernel-choice benchmark mode (benchmarks/kernel_choice.py) end to end: both choices timed
in records of their own (the user's is neither read nor written), each decoding every line as
the other does; and the first decoding on a machine saying that it times them (issue 67)."""

import json
import os
import subprocess
import sys

import pytest

from spec_nmt.decoding import linears
from spec_nmt.decoding.linears import packing_available
from spec_nmt.translator import SpecTranslator
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
    # (the twin the pair loads is kept there: only the kernels' record must not be)
    assert not (cache / "spec-nmt" / "product-kernels.json").exists(), "the user's record"


@pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN")
def test_the_first_decoding_on_a_machine_tells_a_terminal_once_that_it_times_kernels(
    monkeypatch, tmp_path, caplog
):
    monkeypatch.setattr(linears, "CHOICES_FILE", tmp_path / "kernels.json")  # none recorded
    monkeypatch.setattr(linears, "_timed_packed_from", lambda *shape: 16)  # (no timing here)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # (a person watching)
    for _ in range(2):
        with caplog.at_level("WARNING", logger="spec_nmt"):
            SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, device="cpu")
    monkeypatch.setattr(linears, "CHOICES_FILE", tmp_path / "other.json")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)  # a log or a pipe: not told
    with caplog.at_level("WARNING", logger="spec_nmt"):
        SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, device="cpu")
    said = [r.getMessage() for r in caplog.records if "timing the CPU's" in r.getMessage()]
    assert said == [
        "first decoding on this machine: timing the CPU's matrix-product kernels for each "
        f"weight shape (about 8 s for the bundled pair), once; the choice is kept in "
        f"{tmp_path / 'kernels.json'}"
    ]
