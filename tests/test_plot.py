"""benchmarks/plot.py draws BENCHMARKS.md's figures from benchmark JSON the test writes."""

import json

from tests.conftest import script_module

plot = script_module("plot", "benchmarks")


def test_figures_from_a_ceiling_and_an_acceptance_result(tmp_path):
    results, out = tmp_path / "results", tmp_path / "plots"
    results.mkdir()
    environment = {"cpu": "Test CPU", "torch_threads": 2}
    ceiling = {"lines": 8, "environment": environment, "rows": [
        {"batch_size": batch, "system": system, "block": 3, "speedup_vs_greedy": speedup}
        for batch in (1, 8)
        for system, speedup in (("fairseq greedy", 1.0), ("spec lossless, oracle drafter", 4.0))
    ]}  # fmt: skip
    (results / "ceiling.json").write_text(json.dumps(ceiling))
    acceptance = {"environment": environment, "rows": [
        {"system": "drafter", "acceptance_by_position": [0.6, 0.5, 1.0],
         "judged": [100, 40, 2]},  # position 3 was judged twice: too rarely to draw
    ]}  # fmt: skip
    (results / "acceptance.json").write_text(json.dumps(acceptance))
    out.mkdir()
    speed = plot.speed_by_batch(plot.load("ceiling.json", results), out)
    by_position = plot.acceptance_by_position(results, out)
    assert speed.stat().st_size > 1000 and by_position.stat().st_size > 1000
    (name, values, _), = plot.position_rows(results)
    assert name == "drafter (acceptance)" and values == [0.6, 0.5]


def test_acceptance_counts_kept_with_the_groups_and_files_chosen_by_name(tmp_path):
    """benchmark.py acceptance keeps its judged counts under groups["all"]; --acceptance picks
    the files drawn."""
    for stem, rate in (("first", 0.6), ("second", 0.7)):
        result = {"environment": {"cpu": "Test CPU"}, "rows": [
            {"system": "drafter, lossless", "acceptance_by_position": [rate, 0.5, 1.0],
             "groups": {"all": {"acceptance_by_position": [rate, 0.5, 1.0],
                                "judged": [100, 40, 2]}}},
        ]}  # fmt: skip
        (tmp_path / f"{stem}.json").write_text(json.dumps(result))
    rows = list(plot.position_rows(tmp_path, ["second.json"]))
    assert [(name, values) for name, values, _ in rows] == [
        ("drafter, lossless (second)", [0.7, 0.5])]  # fmt: skip
    assert len(list(plot.position_rows(tmp_path))) == 2
