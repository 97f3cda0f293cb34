"""make bleu / scripts/bleu.py (issue 67, item 2): a raw test set scored with a model directory
through the plugin and through stock fairseq-generate --beam 1, the two scores printed with
sacreBLEU's signature and required to agree; offline without a test set, one line that says how
to give one; and the README's fairseq-generate command runs as printed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, script_module

# the offline benchmark split (../shared/data/README.md); a few of its lines are copied per run
BENCHMARK_SPLIT = REPO.parent / "shared" / "data" / "bench-de-en"
VENV = Path(sys.executable).parent.parent


@pytest.fixture
def bleu():
    return script_module("bleu")


@pytest.mark.skipif(not (BENCHMARK_SPLIT / "test.de").is_file(), reason="no offline test set")
def test_make_bleu_scores_a_few_lines_alike_and_the_readmes_generate_command_runs(tmp_path):
    for language in ("de", "en"):
        lines = (BENCHMARK_SPLIT / f"test.{language}").read_text(encoding="utf-8").splitlines()
        (tmp_path / f"test.{language}").write_text("\n".join(lines[:4]) + "\n", encoding="utf-8")
    result = subprocess.run(
        ["make", "-s", "-o", f"{VENV}/.installed", "bleu", f"VENV={VENV}",
         f"SRC={tmp_path / 'test.de'}", f"REF={tmp_path / 'test.en'}",
         f"WORK_DIR={tmp_path / 'work'}"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr == ""
    plugin, stock = result.stdout.splitlines()
    assert plugin.startswith("spec_nmt plugin, lossless (fairseq-generate --task spec_translation)"
                             ": BLEU = ")  # fmt: skip
    assert stock.startswith("stock fairseq-generate --beam 1: BLEU = ")
    assert plugin.split(": BLEU = ")[1] == stock.split(": BLEU = ")[1]
    assert plugin.endswith("| nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0")
    assert "BPE tokens" not in result.stdout
    # the README's fairseq-generate command, as printed, on the data-bin kept in WORK_DIR
    readme = (REPO / "README.md").read_text()
    command = readme.split("# lossless: identical to")[1].split("\n", 1)[1].split("\n#")[0]
    command = command.replace("\\\n", " ").replace("work/bin", str(tmp_path / "work" / "bin"))
    generated = subprocess.run(
        ["bash", "-c", "M=data/models/bench-de-en; " + command], cwd=REPO, capture_output=True,
        text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
                                          PATH=f"{VENV / 'bin'}{os.pathsep}{os.environ['PATH']}"),
    )  # fmt: skip
    assert generated.returncode == 0, generated.stderr[-3000:]
    score = plugin.split(": ", 1)[1].split(" | ")[0]
    assert f"Generate test with beam=1: {score}\n" in generated.stdout
    assert "BPE tokens" not in generated.stdout + generated.stderr


def test_offline_without_a_test_set_it_says_in_one_line_how_to_give_one(bleu, monkeypatch,
                                                                        capsys):  # fmt: skip
    monkeypatch.setattr(bleu, "FETCH", [sys.executable, "-c", "raise SystemExit(1)"])
    assert bleu.main([]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "bleu: could not fetch newstest2014 (`sacrebleu -t wmt14/full`, online): give a test set "
        "instead, make bleu SRC=test.de REF=test.en"
    ]


def test_a_source_without_references_is_refused(bleu, capsys, tmp_path):
    assert bleu.main(["--src", str(tmp_path / "test.de")]) == 1
    assert capsys.readouterr().err.startswith("bleu: give both --src and --ref")


def test_scores_that_differ_fail(bleu, monkeypatch, capsys, tmp_path):
    src, ref = tmp_path / "test.de", tmp_path / "test.en"
    src.write_text("Guten Morgen.\nDas Haus ist groß.\n")
    ref.write_text("Good morning.\nThe house is big.\n")
    outputs = {"plugin": ["Good morning.", "The house is big."],
               "stock": ["Good morning.", "The house is large."]}  # fmt: skip
    monkeypatch.setattr(bleu, "binarize", lambda *args: tmp_path / "bin")
    monkeypatch.setattr(bleu, "translations",
                        lambda data_bin, model_dir, name, *rest: outputs[name])  # fmt: skip
    assert bleu.main(["--src", str(src), "--ref", str(ref)]) == 1
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 2
    assert err.startswith("bleu: the scores differ (1 of 2 translations differ)")
