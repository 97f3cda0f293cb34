"""Speculative sampling and RSD through fairseq-generate and fairseq-interactive: seeded runs
reproduce, every input line gets one output in order, bad flags give one-line errors."""

import os

import pytest

from spec_nmt.settings import VERIFY_RULES, DecodingSettings
from tests.conftest import (
    BLOCK_SIZE, OPTIMIZATION, TINY_TRANSFORMER, USER_DIR, fairseq, fairseq_error,
    fairseq_in_process,
)
from tests.test_errors import assert_one_line_error, data_with_extra_lines
from tests.test_lossless import hypotheses

SAMPLING = ["--user-dir", USER_DIR, "--task", "spec_translation", "--max-len-b", 40, "--cpu"]
RULES = {
    "sampling": ["--verify", "sampling", "--block-size", BLOCK_SIZE],
    "rsd-c": ["--verify", "rsd", "--tree-branching", "2,2,1"],
    "rsd-s": ["--verify", "rsd", "--tree-budget", 8, "--block-size", 4],
}


def generate_flags(toy, drafter, rule, *extra):
    return [toy["bin"], "--path", toy["verifier"], "--drafter-path", toy[drafter], *SAMPLING,
            *RULES[rule], "--max-draft-batch", 0, "--batch-size", 8,
            "--required-batch-size-multiple", 1, *extra]  # fmt: skip


# each rule once, both drafter kinds among them (interactive below: RSD-S with the AR drafter)
@pytest.mark.parametrize("rule,drafter", [("sampling", "drafter"), ("rsd-c", "ar_drafter"),
                                          ("rsd-s", "drafter")])  # fmt: skip
def test_generate_samples_reproducibly_with_a_seed(toy, drafter, rule):
    """The console script, then its main again in this process, draw the same samples.
    (That another seed gives other samples is tested in-process, in test_sampling_exact.)"""
    flags = generate_flags(toy, drafter, rule, "--seed", 7, "--temperature", 0.9)
    first = hypotheses(fairseq("generate", *flags).stdout)
    again = hypotheses(fairseq_in_process("generate", *flags))
    assert len(first) == 60
    assert first == again


def test_rsd_without_tree_flags_draws_the_default_tree(toy):
    output = fairseq_in_process(
        "generate", toy["bin"], "--path", toy["verifier"], "--drafter-path", toy["drafter"],
        *SAMPLING, "--verify", "rsd", "--max-draft-batch", 0, "--batch-size", 8,
        "--required-batch-size-multiple", 1,
    )  # fmt: skip
    assert len(hypotheses(output)) == 60
    default = DecodingSettings(verify="rsd").draft_plan
    # as measured and documented (BENCHMARKS.md, README)
    assert VERIFY_RULES["rsd"].default_branching == "3,1"
    assert default.branching == (3, 1) and default.sample


def test_interactive_sampling_gives_every_line_one_output_in_order(toy):
    lines = (toy["raw"] / "test.de").read_text().splitlines()[:9]
    lines.insert(4, "")
    result = fairseq(
        "interactive", toy["bin"], "--path", toy["verifier"], "--drafter-path", toy["ar_drafter"],
        *SAMPLING, *RULES["rsd-s"], "--sampling", "--beam", 1, "--sampling-topp", 0.9, "--seed", 3,
        "--max-draft-batch", 0, "--batch-size", 3, "--buffer-size", 3,
        input_text="\n".join(lines) + "\n",
    )  # fmt: skip
    found = hypotheses(result.stdout)
    assert sorted(found) == list(range(10))
    assert found[4] == ""
    order = [int(line.split("\t")[0][2:]) for line in result.stdout.splitlines() if line[:2] == "H-"]
    assert order == sorted(order)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--verify", "rsd", "--tree-branching", "2,2", "--tree-budget", 4], "not both"),
        (["--verify", "rsd", "--tree-branching", "2,x"], "--tree-branching must be"),
        (["--verify", "rsd", "--tree-branching", "2,0"], "--tree-branching must be"),
        (["--verify", "rsd", "--tree-budget", 3, "--block-size", 4], "smaller than --block-size"),
        (["--verify", "sampling", "--tree-budget", 8], "--verify sampling drafts a chain"),
        (["--verify", "sampling", "--tree-branching", "2,1"], "--verify sampling drafts a chain"),
        (["--verify", "sampling", "--temperature", 0], "--temperature must be > 0"),
        (["--verify", "sampling", "--sampling-topp", 1.5], "--sampling-topp must be"),
        (["--verify", "rsd", "--tree-budget", 8, "--block-size", 4, "--sampling-topk", 0],
         "--sampling-topk must"),
    ],
)
def test_bad_sampling_flags_give_one_line_errors(toy, flags, message):
    assert message in fairseq_error(
        "interactive", toy["bin"], "--path", toy["verifier"], "--drafter-path", toy["drafter"],
        *SAMPLING, *flags, "--input", os.devnull,
    )  # fmt: skip


def test_ar_drafter_with_another_dictionary_is_refused(toy, tmp_path):
    other_bin = data_with_extra_lines(toy, tmp_path, "brandnew words only here", "ganz neue wörter")
    fairseq_in_process(
        "train", other_bin, "--task", "translation", "--arch", "transformer", *TINY_TRANSFORMER,
        "--decoder-layers", 1, *OPTIMIZATION, "--max-update", 1, "--save-dir", tmp_path / "ar",
    )  # fmt: skip
    result = fairseq(
        "interactive", toy["bin"], "--path", toy["verifier"], "--drafter-path",
        tmp_path / "ar" / "checkpoint_last.pt", *SAMPLING, input_text="s1 s2\n", check=False,
    )  # fmt: skip
    assert_one_line_error(result, "target symbols but the dictionary in", "must share")


def test_a_checkpoint_of_another_model_family_is_refused(toy, tmp_path):
    fairseq_in_process(
        "train", toy["bin"], "--task", "translation", "--arch", "lstm", "--encoder-layers", 1,
        "--decoder-layers", 1, "--encoder-embed-dim", 16, "--decoder-embed-dim", 16,
        "--decoder-out-embed-dim", 16, "--encoder-hidden-size", 16, "--decoder-hidden-size", 16,
        *OPTIMIZATION, "--max-update", 1, "--save-dir", tmp_path,
    )  # fmt: skip
    result = fairseq(
        "interactive", toy["bin"], "--path", toy["verifier"], "--drafter-path",
        tmp_path / "checkpoint_last.pt", *SAMPLING, input_text="s1 s2\n", check=False,
    )  # fmt: skip
    assert_one_line_error(
        result, "neither a Spec-Drafter, a cached drafter, a feature drafter nor a Transformer"
    )
