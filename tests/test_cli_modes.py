"""spec-nmt-translate and the API as a new user meets them (issue 37), on the bundled pair: every
mode on the command line, defaults and units in --help, --stats that say whether drafting ran,
samples that differ unless seeded, input that is not text refused, a quiet API."""

import gzip
import os
import pty
import re
import select
import subprocess
import sys

import pytest

from spec_nmt import cli as translate_cli
from spec_nmt.errors import SpecNmtError
from spec_nmt.settings import DEFAULTS
from spec_nmt.translator import SpecTranslator
from tests.conftest import BUNDLED_MODEL_DIR, REPO

LINES = ["Guten Morgen.", "Das Haus ist groß.", "Wie geht es dir heute?"]


def cli(*args, stdin=None):
    """spec-nmt-translate run as a user runs it, in a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "spec_nmt.cli", str(BUNDLED_MODEL_DIR), "--cpu", *args],
        input=stdin, capture_output=True, text=isinstance(stdin, str), cwd=REPO, timeout=300,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )  # fmt: skip


def run_main(capsys, *args):
    """main() in this process (the models load in a few seconds): (stdout lines, stderr)."""
    translate_cli.main([str(BUNDLED_MODEL_DIR), "--cpu", *map(str, args)])
    out, err = capsys.readouterr()
    return out.splitlines(), err


@pytest.fixture(scope="module")
def translator():
    return SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, device="cpu")


def test_stats_say_that_a_batch_did_not_draft_and_why():
    result = cli("--stats", stdin="\n".join(LINES) + "\n")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == len(LINES)
    off = "drafting off: every batch had more than 1 sentence (--max-draft-batch 1)"
    assert off in result.stderr
    assert re.search(r"stats: 0\.00 accepted drafts per iteration", result.stderr)
    assert re.search(r"stats: [0-9.]+ sentences/s, \d+ tokens/s", result.stderr)
    assert re.search(r"stats: mean score -[0-9.]+ \(.*in nats\)", result.stderr)


def test_stats_of_a_drafting_run_count_the_accepted_drafts(capsys, tmp_path):
    path = tmp_path / "in.de"
    path.write_text("\n".join(LINES) + "\n")
    out, err = run_main(capsys, "--input", path, "--batch-size", 1, "--stats")
    assert len(out) == len(LINES)
    assert "drafting on: --verify top_beta, --block-size 3" in err
    accepted = float(re.search(r"stats: ([0-9.]+) accepted drafts per iteration", err).group(1))
    assert accepted > 0
    out, err = run_main(capsys, "--input", path, "--block-size", 0, "--stats", "--quiet")
    assert "drafting off: --block-size 0" in err
    assert "target tokens in" not in err  # --quiet keeps the throughput line out, not --stats


def test_help_shows_defaults_units_and_every_mode(capsys):
    with pytest.raises(SystemExit):
        translate_cli.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--verify", "--temperature", "--sampling-topk", "--sampling-topp", "--seed"):
        assert flag in text
    assert "sentences per batch (default: 64)" in text
    assert "inside a buffer (default: 1000)" in text
    assert f"(default: {DEFAULTS.block_size})" in text
    assert "in nats" in text.split("--tau TAU")[-1].split("--max-draft-batch")[0]
    assert "mean score (the verifier's log- probability per output token" in text


def test_the_cli_samples_differently_unless_seeded(capsys, tmp_path):
    path = tmp_path / "in.de"
    path.write_text("Guten Morgen, wie geht es Ihnen?\n" * 4)
    sampling = ["--input", path, "--verify", "sampling", "--temperature", 1.5, "--quiet"]
    seeded = [run_main(capsys, *sampling, "--seed", 7)[0] for _ in range(2)]
    assert seeded[0] == seeded[1] and len(seeded[0]) == 4
    fresh = [tuple(run_main(capsys, *sampling)[0]) for _ in range(2)]
    assert len(set(fresh) | {tuple(seeded[0])}) > 1
    greedy, _ = run_main(capsys, "--input", path, "--quiet")
    assert len(set(greedy)) == 1  # the same line translated the same way every time ...
    assert len(set(fresh[0] + fresh[1])) > 1  # ... but sampled, not


@pytest.mark.parametrize("flags", [["--temperature", "0.7"], ["--seed", "3"],
                                   ["--verify", "top_beta", "--sampling-topp", "0.9"]])  # fmt: skip
def test_sampling_flags_without_a_sampling_rule_are_refused(flags):
    with pytest.raises(SpecNmtError, match="add --verify sampling or --verify rsd"):
        translate_cli.parse_args([str(BUNDLED_MODEL_DIR), *flags])


@pytest.mark.parametrize("flags, message", [
    (["--beta", "0"], "--beta must be an integer >= 1, got 0"),
    (["--beta", "3", "--max-draft-batch", "2"], "--max-draft-batch 2 with a relaxed top-beta/tau (--beta 3)"),
    (["--verify", "sampling", "--temperature", "0"], "--temperature must be > 0"),
])  # fmt: skip
def test_bad_settings_name_their_flags_before_the_models_load(flags, message):
    """The settings' one validation, worded for the command line (the API's: test_translator)."""
    with pytest.raises(SpecNmtError) as error:
        translate_cli.main(["/nonexistent-model-dir", *flags])
    assert message in str(error.value)


def test_the_api_samples_differently_unless_seeded(translator):
    line = "Guten Morgen, wie geht es Ihnen?"
    samples = {translator.sample(line, temperature=1.5) for _ in range(4)}
    assert len(samples) > 1
    assert translator.sample(line, temperature=1.5, seed=3) == translator.sample(
        line, temperature=1.5, seed=3
    )
    seeded = SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, device="cpu", seed=3)
    assert seeded.sample(line, temperature=1.5) == seeded.sample(line, temperature=1.5)
    assert seeded.sample(line, temperature=1.5) == translator.sample(line, temperature=1.5, seed=3)


ELF = bytes.fromhex("7f454c4602010100") + bytes(8) + bytes(range(256)) * 4
NOT_TEXT = {
    "elf": ELF,
    "gzip": gzip.compress("Guten Morgen.\n".encode() * 50),
    "random bytes without nul": bytes((i * 151 + 7) % 255 + 1 for i in range(4000)),
}


@pytest.mark.parametrize("kind", NOT_TEXT)
def test_input_that_is_not_text_is_refused_with_one_line(tmp_path, kind):
    path = tmp_path / "input"
    path.write_bytes(NOT_TEXT[kind])
    with pytest.raises(SpecNmtError) as error:
        translate_cli.main([str(BUNDLED_MODEL_DIR), "--input", str(path)])
    assert "it is not text" in str(error.value) and "\n" not in str(error.value)
    result = cli(stdin=NOT_TEXT[kind])  # through stdin too, as a one-line error
    assert result.returncode == 1 and result.stdout == b""
    assert result.stderr.decode().strip().splitlines() == [
        f"spec_nmt error: stdin {str(error.value).split(' ', 1)[1]}"
    ]


def test_text_with_some_bytes_that_are_not_utf8_is_translated_line_by_line(capsys, tmp_path):
    path = tmp_path / "latin1.de"
    text = ("Die Regierung hat am Dienstag ein neues Gesetz für die Schulen beschlossen.\n"
            "Das Haus ist groß.\n\nWir haben am Morgen lange über das Wetter gesprochen.\n")
    path.write_bytes(text.encode("latin-1"))  # German as often saved before UTF-8
    out, _ = run_main(capsys, "--input", path, "--quiet")
    assert len(out) == 4 and out[2] == "" and all(out[i] for i in (0, 1, 3))


def test_typed_lines_at_a_terminal_are_translated_as_they_come():
    pid, terminal = pty.fork()
    if pid == 0:  # the child: stdin, stdout and stderr are the terminal
        try:
            os.environ["PYTHONPATH"] = str(REPO)
            os.chdir(REPO)
            os.execv(sys.executable, [sys.executable, "-m", "spec_nmt.cli",
                                      str(BUNDLED_MODEL_DIR), "--cpu"])  # fmt: skip
        finally:
            os._exit(127)  # never back into pytest
    seen = b""

    def read_until(pattern, seconds=120):
        nonlocal seen
        while not re.search(pattern, seen):
            ready, _, _ = select.select([terminal], [], [], seconds)
            assert ready, f"no {pattern!r} in {seen!r}"
            seen += os.read(terminal, 4096)

    read_until(rb"type German text, one line at a time; Ctrl-D ends")
    os.write(terminal, "Guten Morgen.\n".encode())
    read_until(rb"Good morning\.")
    os.write(terminal, b"\x04")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    os.close(terminal)


def test_the_api_is_quiet_unless_asked_to_be_verbose():
    script = (
        "from spec_nmt.translator import SpecTranslator\n"
        f"t = SpecTranslator.from_pretrained({str(BUNDLED_MODEL_DIR)!r}, device='cpu')\n"
        "print(t.translate('Guten Morgen.'))\n"
        f"SpecTranslator.from_pretrained({str(BUNDLED_MODEL_DIR)!r}, device='cpu', verbose=True)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout == "Good morning.\n"
    # fairseq's INFO lines of loading: from the verbose translator only
    assert result.stderr.count("[de] dictionary: 8008 types") == 1


def test_the_verifier_given_as_drafter_is_refused(tmp_path):
    with pytest.raises(SpecNmtError) as error:
        SpecTranslator.from_pretrained(
            BUNDLED_MODEL_DIR, drafter_path=BUNDLED_MODEL_DIR / "verifier.pt", device="cpu"
        )
    assert "is the verifier itself" in str(error.value) and "\n" not in str(error.value)
