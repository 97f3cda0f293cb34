"""The static-cost benchmark mode's iteration timer (benchmarks/static_cost.py): it times every
iteration the static loop runs, one by one, and decoding through it is unchanged."""

import json
import subprocess
import sys

import torch

from spec_nmt.decoding.loop import DecodingStats
from spec_nmt.translator import SpecTranslator
from tests.conftest import BUNDLED_MODEL_DIR, REPO, script_module

static_cost = script_module("static_cost", folder="benchmarks")


def test_the_timer_sees_every_iteration_and_changes_no_output():
    pair = SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, device="cpu", drafter="file",
                                          decoding_loop="static")  # fmt: skip
    lines = (REPO / "data" / "examples.de").read_text(encoding="utf-8").splitlines()[:3]
    tokens = pair.encode(lines)
    generator = pair.generator(block_size=3, max_draft_batch=0)

    def outputs():
        generator.stats = DecodingStats()
        found = []
        with torch.inference_mode():
            for _, sample in pair.batches(tokens, 1):
                found.append(generator.generate([pair.verifier], sample)[0][0]["tokens"].tolist())
        return found

    untimed = outputs()
    timer = static_cost.IterationTimer(generator.static)
    timed = outputs()
    timer.stop()
    assert "_batch" not in vars(generator.static)
    assert timed == untimed
    assert timer.count == generator.stats.iterations > len(lines)
    assert timer.seconds > 0


def test_the_mode_writes_its_rows_end_to_end(tmp_path):
    """``benchmark.py static-cost`` on one line: a row per system, with its record."""
    result = tmp_path / "cost.json"
    subprocess.run([sys.executable, "benchmarks/benchmark.py", "static-cost",
                    str(BUNDLED_MODEL_DIR), "--src", str(REPO / "data" / "examples.de"),
                    "--lines", "1", "--blocks", "3", "--warmup-lines", "0", "--threads", "1",
                    "--json", str(result)], cwd=REPO, check=True, capture_output=True)  # fmt: skip
    found = json.loads(result.read_text())
    assert [row["system"] for row in found["rows"]] == ["no drafts", "oracle k=3",
                                                        "real drafter k=3"]  # fmt: skip
    assert all(row["iterations"] > 0 for row in found["rows"])
    assert found["environment"]["drafter_precision"]
