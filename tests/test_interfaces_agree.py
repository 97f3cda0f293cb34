"""The interfaces agree (issue 67, item 6): spec-nmt-translate takes the tree flags the API and
the fairseq commands take, make translate passes the sampling variables on, a missing drafter
says "no such file" as the fairseq path does, an unseeded sampling run says its seed, and
--stats does not name a precision for a drafter that never drafted; and the README's --stats
example is what the tool prints (item 7)."""

import re
import subprocess

import pytest

from spec_nmt import cli as translate_cli
from spec_nmt.errors import SpecNmtError
from spec_nmt.translator import SpecTranslator
from tests.conftest import BUNDLED_MODEL_DIR, REPO
from tests.test_cli_modes import run_main

SAMPLING_VARIABLES = {"TEMPERATURE=0.5": "--temperature 0.5", "SAMPLING_TOPK=5":
                      "--sampling-topk 5", "SAMPLING_TOPP=0.9": "--sampling-topp 0.9"}  # fmt: skip


@pytest.mark.parametrize("mode", ["FAIRSEQ_OUTPUT=0", "FAIRSEQ_OUTPUT=1"])
def test_make_translate_passes_the_sampling_variables_on(mode):
    commands = subprocess.run(
        ["make", "-n", "-o", "/nonexistent-venv/.installed", "translate", "VENV=/nonexistent-venv",
         mode, "VERIFY=sampling", *SAMPLING_VARIABLES],
        cwd=REPO, capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    for flag in SAMPLING_VARIABLES.values():
        assert f"{flag} " in commands


def test_the_command_line_takes_the_tree_flags_and_decodes_with_a_tree(capsys, tmp_path):
    args = translate_cli.parse_args([str(BUNDLED_MODEL_DIR), "--tree-branching", "2,1",
                                     "--verify", "rsd", "--tree-budget", "0"])  # fmt: skip
    assert translate_cli.given_settings(args)["tree_branching"] == "2,1"
    with pytest.raises(SpecNmtError, match="tree_budget|--tree-budget"):
        translate_cli.parse_args([str(BUNDLED_MODEL_DIR), "--tree-branching", "2,1",
                                  "--tree-budget", "4"])  # fmt: skip
    path = tmp_path / "in.de"
    path.write_text("Guten Morgen.\n")
    chain, _ = run_main(capsys, "--input", path, "--quiet")
    tree, err = run_main(capsys, "--input", path, "--quiet", "--stats", "--tree-budget", 6)
    assert tree == chain == ["Good morning."]  # a lossless tree: the greedy output
    assert re.search(r"stats: [1-9][0-9.]* accepted drafts per iteration", err)


@pytest.mark.parametrize("drafter", ["/tmp/no-such-drafter.pt", "drafter-not-here.pt"])
def test_a_missing_drafter_path_says_no_such_file(drafter):
    with pytest.raises(SpecNmtError, match=f"^drafter {re.escape(drafter)}: no such file$"):
        SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, drafter_path=drafter, device="cpu")


def test_an_unseeded_sampling_run_prints_its_seed_and_that_seed_samples_the_same(capsys, tmp_path):
    path = tmp_path / "in.de"
    path.write_text("Guten Morgen, wie geht es Ihnen?\n" * 3)
    sampling = ["--input", path, "--verify", "sampling", "--block-size", 0, "--temperature", 1.5]
    drawn, err = run_main(capsys, *sampling, "--quiet", "--stats")
    seed = re.search(r"^spec-nmt-translate: sampling with seed (\d+), drawn for this run "
                     r"\(--seed \1 samples the same again\)$", err, re.M).group(1)  # fmt: skip
    again, err = run_main(capsys, *sampling, "--quiet", "--seed", seed)
    assert again == drawn and "sampling with seed" not in err
    _, err = run_main(capsys, *sampling, "--quiet")
    assert err == ""  # --quiet without --stats: nothing on stderr


def test_stats_say_no_drafts_instead_of_a_precision_when_nothing_drafted(capsys, tmp_path):
    path = tmp_path / "in.de"
    path.write_text("Guten Morgen.\nDas Haus ist groß.\n")
    # no drafts at all; batches of 2 > --max-draft-batch 1
    for flags in (["--block-size", 0], ["--max-draft-batch", 1]):
        _, err = run_main(capsys, "--input", path, "--stats", "--quiet", *flags)
        assert f"stats: drafter: {BUNDLED_MODEL_DIR / 'drafter.pt'} (no drafts)\n" in err


def test_the_readmes_stats_example_is_what_the_tool_prints(capsys, tmp_path):
    """Every line of the README's `make translate STATS=1` example, with its own numbers (speeds
    differ between machines, the drafter's precision between CPUs)."""
    readme = (REPO / "README.md").read_text()
    sentence = re.search(r'echo "([^"]+)" \| make -s translate STATS=1', readme).group(1)
    shown = readme.split("The last command shows")[1].split("```\n")[1].splitlines()
    path = tmp_path / "in.de"
    path.write_text(sentence + "\n")
    out, err = run_main(capsys, "--input", path, "--stats")
    printed = out + err.splitlines()
    assert len(printed) == len(shown), printed
    for example, line in zip(shown, printed):
        example = example.replace("data/models/bench-de-en", str(BUNDLED_MODEL_DIR))
        pieces = re.split(r"(?<![\w.])-?[0-9]+(?:\.[0-9]+)?", example)  # (any number there)
        pattern = "-?[0-9]+(?:\\.[0-9]+)?".join(map(re.escape, pieces))
        pattern = pattern.replace(r"\(fp32\)", r"\((fp32|bf16)\)")
        assert re.fullmatch(pattern, line), (example, line)
