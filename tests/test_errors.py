"""Bad flags, files and input lines: one clear line each, and nothing else lost."""

import os
import shutil

import pytest

from tests.conftest import BLOCK_SIZE, USER_DIR, fairseq, fairseq_error, preprocess, train_drafter
from tests.test_lossless import hypotheses

COMMON = ["--user-dir", USER_DIR, "--max-len-b", 40, "--cpu"]


def interactive_flags(toy, *flags, drafter=None):
    drafter = toy["drafter"] if drafter is None else drafter
    return ["--task", "spec_translation", "--path", toy["verifier"], "--drafter-path", drafter,
            "--block-size", BLOCK_SIZE, *flags, *COMMON]  # fmt: skip


def interactive(toy, *flags, drafter=None, input_text="s1 s2 s3\n"):
    return fairseq("interactive", toy["bin"], *interactive_flags(toy, *flags, drafter=drafter),
                   input_text=input_text, check=False)  # fmt: skip


def interactive_error(toy, *flags, drafter=None) -> str:
    """fairseq-interactive's one-line error for these flags, run in this process."""
    return fairseq_error("interactive", toy["bin"], "--input", os.devnull,
                         *interactive_flags(toy, *flags, drafter=drafter))  # fmt: skip


def assert_one_line_error(result, *fragments):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("spec_nmt error: "), result.stderr[-2000:]
    for fragment in fragments:
        assert fragment in last, last


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--block-size", -1], "--block-size must be an integer >= 0 (0: no drafts)"),
        (["--block-size", 0, "--verify", "rsd"], "--block-size 0 (no drafts) decodes with the"),
        (["--block-size", 0, "--tree-branching", "2,1"], "--block-size 0 (no drafts) decodes"),
        (["--beta", 0], "--beta must be an integer >= 1"),
        (["--max-draft-batch", -2], "--max-draft-batch must be an integer >= 0"),
        (["--draft-stop", 1.5], "--draft-stop must be in [0, 1)"),
        (["--draft-stop", 0.5, "--tree-branching", "2,1"], "--draft-stop ends chains of drafts"),
        (["--beta", 3, "--tau", 1, "--max-draft-batch", 4],
         "would make a sentence's translation depend on its batch"),
        (["--tau", -0.5], "--tau must be >= 0"),
        (["--beam", 5], "--beam 5 cannot be combined with --drafter-path"),
        (["--nbest", 2], "--nbest must be 1"),
        (["--sampling", "--beam", 1], "needs --verify sampling or --verify rsd"),
        (["--prefix-size", 2], "--prefix-size is not supported"),
    ],
)
def test_invalid_flags(toy, flags, message):
    assert message in interactive_error(toy, *flags)


def test_explicit_beam_one_is_fine(toy):
    result = interactive(toy, "--beam", 1)
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(hypotheses(result.stdout)) == 1


def test_missing_drafter_file(toy, tmp_path):
    missing = tmp_path / "nowhere.pt"
    assert_one_line_error(interactive(toy, drafter=missing), str(missing), "no such file")




@pytest.mark.parametrize("content", [b"", b"not a checkpoint at all", "truncated"])
def test_unreadable_drafter_checkpoint(toy, tmp_path, content):
    broken = tmp_path / "broken.pt"
    if content == "truncated":
        data = toy["drafter"].read_bytes()
        content = data[: len(data) // 2]
    broken.write_bytes(content)
    message = interactive_error(toy, drafter=broken)
    assert str(broken) in message and "not a readable fairseq checkpoint" in message


def data_with_extra_lines(toy, tmp_path, en_line, de_line=None):
    """The toy data-bin preprocessed again with extra training lines: another dictionary."""
    other_raw = tmp_path / "raw"
    shutil.copytree(toy["raw"], other_raw)
    for lang, line in (("en", en_line), ("de", de_line)):
        if line is not None:
            with open(other_raw / f"train.{lang}", "a") as extra:
                extra.write(line + "\n")
    return preprocess(other_raw, tmp_path / "bin")


def test_drafter_trained_with_another_dictionary(toy, tmp_path):
    other_bin = data_with_extra_lines(toy, tmp_path, "brandnew words only here", "ganz neue wörter")
    train_drafter(other_bin, tmp_path / "drafter", 1)
    result = interactive(toy, drafter=tmp_path / "drafter" / "checkpoint_last.pt")
    assert_one_line_error(result, "different dictionary", str(toy["bin"]))


def test_truncated_verifier_checkpoint(toy, tmp_path):
    broken = tmp_path / "verifier.pt"
    data = toy["verifier"].read_bytes()
    broken.write_bytes(data[: len(data) // 3])
    result = interactive(toy, "--path", broken)
    assert_one_line_error(result, str(broken), "not a readable fairseq checkpoint")


def test_drafter_given_as_the_verifier(toy):
    message = interactive_error(toy, "--path", toy["drafter"])
    assert "is a Spec-Drafter, not a verifier" in message and "--drafter-path" in message


def test_verifier_with_another_data_directory(toy, tmp_path):
    # more new words than the dictionary's size padding absorbs
    other_bin = data_with_extra_lines(toy, tmp_path, " ".join(f"brandnew{i}" for i in range(20)))
    result = fairseq(
        "interactive", other_bin, "--task", "spec_translation", "--path", toy["verifier"],
        "--drafter-path", toy["drafter"], *COMMON, input_text="s1 s2\n", check=False,
    )  # fmt: skip
    assert_one_line_error(result, str(toy["verifier"]), "does not fit", "another dictionary")


def test_training_a_non_drafter_with_the_task(toy, tmp_path):
    message = fairseq_error(
        "train", toy["bin"], "--user-dir", USER_DIR, "--task", "spec_translation",
        "--arch", "transformer", "--criterion", "spec_drafter_loss", "--optimizer", "adam",
        "--max-update", 1, "--max-tokens", 1000, "--cpu", "--save-dir", tmp_path,
    )  # fmt: skip
    assert "train the verifier with --task translation" in message


def test_every_input_line_gets_one_output_in_order(toy):
    overlong = " ".join(f"s{i % 40}" for i in range(1100))  # more tokens than max positions
    lines = ["s1 s2 s3", "", "   ", overlong, "foo bar ünknown €", "s7 s8", "\t"]
    result = interactive(
        toy, "--batch-size", 3, "--buffer-size", 3, input_text="\n".join(lines) + "\n"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = hypotheses(result.stdout)
    assert sorted(found) == list(range(len(lines)))
    order = [
        int(line.split("\t")[0][2:]) for line in result.stdout.splitlines() if line[:2] == "H-"
    ]
    assert order == sorted(order)
    for empty in (1, 2, 6):
        assert found[empty] == ""
    for translated in (0, 3, 4, 5):
        assert found[translated] != ""
    assert "longer than the models accept" in result.stderr
