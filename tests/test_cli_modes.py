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
from spec_nmt import cli_session, loading
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


LOADS_NOTHING_HEAVY = """
import sys
from spec_nmt import cli
from spec_nmt.errors import SpecNmtError
try:
    cli.main(sys.argv[1:])
except (SystemExit, SpecNmtError) as stop:
    print(type(stop).__name__, file=sys.stderr)
print(sorted({"torch", "fairseq", "ctranslate2"} & set(sys.modules)))
"""


@pytest.mark.parametrize(
    "args, ending",
    [(["--help"], "SystemExit"), ([str(BUNDLED_MODEL_DIR), "--threads", "0"], "SpecNmtError"),
     ([str(BUNDLED_MODEL_DIR), "--verify", "nope"], "SystemExit")],
)  # fmt: skip
def test_help_and_argument_errors_load_neither_torch_nor_fairseq(args, ending):
    """--help and a refused flag answer in a fraction of a second (issue 67): the parser's
    modules import nothing heavy, and the models' modules load only after the check."""
    done = subprocess.run([sys.executable, "-c", LOADS_NOTHING_HEAVY, *args], capture_output=True,
                          text=True, cwd=REPO, timeout=120)  # fmt: skip
    assert done.stderr.split()[-1] == ending, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


def run_main(capsys, *args):
    """main() in this process (the models load in a few seconds): (stdout lines, stderr)."""
    translate_cli.main([str(BUNDLED_MODEL_DIR), "--cpu", *map(str, args)])
    out, err = capsys.readouterr()
    return out.splitlines(), err


@pytest.fixture(scope="module")
def translator():
    return SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, device="cpu")


def test_stats_say_that_a_batch_did_not_draft_and_why():
    result = cli("--stats", "--drafter", "file", stdin="\n".join(LINES) + "\n")
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
    assert len(out) == len(LINES)  # (auto: the twin drafts the lossless rule on a CPU)
    assert "drafting on: --verify top_beta, whole continuations (--drafter twin)" in err
    assert "stats: drafter: the verifier's CTranslate2 int8 twin (--drafter twin)" in err
    out, err = run_main(capsys, "--input", path, "--batch-size", 1, "--stats", "--drafter",
                        "file")  # fmt: skip
    assert "drafting on: --verify top_beta, --block-size 3" in err
    # the precision it drafted in (--drafter-precision auto: bf16 on a CPU with native bf16)
    precision = "bf16" if loading.native_bf16() else "fp32"
    assert f"stats: drafter: {BUNDLED_MODEL_DIR / 'drafter.pt'} ({precision})" in err
    accepted = float(re.search(r"stats: ([0-9.]+) accepted drafts per iteration", err).group(1))
    assert accepted > 0
    _, err = run_main(capsys, "--input", path, "--batch-size", 1, "--beta", 3, "--tau", 1,
                      "--stats", "--quiet")  # fmt: skip
    assert f"stats: drafter: {BUNDLED_MODEL_DIR / 'drafter.pt'} (fp32)" in err  # its fp32 twin
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
    assert "`" not in text  # no reStructuredText markup
    block_size = text.split("--block-size BLOCK_SIZE")[-1].split("--beta")[0]
    assert "drafted tokens per iteration" in block_size and "training" not in block_size


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


# ----- issue 58, point 6: what a new user met on first contact ----------------------------------
def test_the_progress_bar_shows_for_a_few_lines_once_decoding_takes_long(capsys, tmp_path,
                                                                          monkeypatch):  # fmt: skip
    """The bar is time-based, not gated by a line count (a 50-line file sat silent for 10 s):
    with the delay at 0 it shows for 3 lines."""
    path = tmp_path / "in.de"
    path.write_text("\n".join(LINES) + "\n")
    monkeypatch.setattr(cli_session, "PROGRESS_DELAY_S", 0)
    out, err = run_main(capsys, "--input", path)
    assert len(out) == len(LINES) and "3/3" in err
    _, err = run_main(capsys, "--input", path, "--quiet")
    assert "3/3" not in err


def test_progress_is_reported_after_every_batch_of_a_long_line(translator):
    """A long line's sentences are decoded in several batches: progress is called after each
    (finishing no line until the last), so a bar moves while the line is decoded."""
    calls = []
    line = "Guten Morgen. Das Haus ist groß. Wie geht es dir heute?"
    translator.translate(line, batch_size=1, progress=calls.append)
    assert calls == [0, 0, 1]


def test_a_cut_line_is_reported_in_the_commands_one_line_style(capsys, tmp_path, monkeypatch):
    from spec_nmt.task import SpecTranslationTask

    # the models take 8 source tokens here, so a short line is cut (no 1,000-token decoding)
    monkeypatch.setattr(SpecTranslationTask, "source_token_limit", lambda *args: 8)
    path = tmp_path / "in.de"
    path.write_text("Die Regierung hat am Dienstag ein neues Gesetz für die Schulen beschlossen.\n")
    out, err = run_main(capsys, "--input", path, "--quiet")
    assert len(out) == 1 and out[0]
    assert re.search(r"^spec-nmt-translate warning: input line of \d+ tokens is longer than the "
                     r"models accept; translating its first 7 tokens$", err, re.M), err
    assert "WARNING" not in err


class TypedLines:
    """stdin at a terminal, a user taking 100 s to type each line (on a fake clock)."""

    def __init__(self, clock, lines):
        self.clock, self.lines = clock, lines

    def __iter__(self):
        for line in self.lines:
            self.clock.now += 100.0
            yield line + "\n"


class FakeClock:
    now = 0.0

    def __call__(self):
        return self.now


class OneSecondTranslator:
    """Translates each line in 1 s of the fake clock, 1 sentence and 4 tokens per line."""

    settings = DEFAULTS
    statistics = [{"sentences": 1, "decoded": 1, "output_tokens": 4, "score": -0.5}]

    def __init__(self, clock):
        self.clock = clock
        self.decoding_stats = cli_session.DecodingStats()

    def translate(self, line, split_sentences=True, keep_numbers=True):
        self.clock.now += 1.0
        return line.upper()


def test_the_closing_summary_counts_decoding_time_not_typing_time(capsys, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(cli_session.time, "perf_counter", clock)
    monkeypatch.setattr(sys, "stdin", TypedLines(clock, ["eins", "zwei"]))
    args = translate_cli.parse_args([str(BUNDLED_MODEL_DIR), "--quiet"])
    translator, totals = OneSecondTranslator(clock), cli_session.Totals()
    cli_session.translate_typed_lines(translator, args, totals)
    args.quiet = False
    cli_session.report(translator, totals, args)
    out, err = capsys.readouterr()
    assert out.splitlines() == ["EINS", "ZWEI"]
    assert "8 target tokens in 2.0 s of decoding: 1.0 sentences/s, 4 tokens/s" in err


GERMAN_WITH_UMLAUTS = "Die Ärztin hat heute früh über die Straße gesprochen.\n"


def test_latin1_input_is_read_as_latin1_with_a_warning(capsys, tmp_path):
    """German saved in Latin-1 was translated as if its umlauts were noise ("Ärztin" became
    "rubber"): it is read as Latin-1, as the same text in UTF-8 is read."""
    utf8, latin1 = tmp_path / "utf8.de", tmp_path / "latin1.de"
    utf8.write_text(GERMAN_WITH_UMLAUTS, encoding="utf-8")
    latin1.write_text(GERMAN_WITH_UMLAUTS, encoding="latin-1")
    expected, err = run_main(capsys, "--input", utf8, "--quiet")
    assert "warning" not in err
    out, err = run_main(capsys, "--input", latin1, "--quiet")
    assert out == expected
    assert err.splitlines() == [
        f"spec-nmt-translate warning: {latin1} is not UTF-8; reading it as Latin-1 "
        "(Windows-1252); --encoding ENCODING names its encoding"
    ]
    out, err = run_main(capsys, "--input", latin1, "--quiet", "--encoding", "latin-1")
    assert out == expected and err == ""
    result = cli("--quiet", stdin=GERMAN_WITH_UMLAUTS.encode("latin-1"))  # stdin too
    assert result.stdout.decode().splitlines() == expected
    assert b"stdin is not UTF-8; reading it as Latin-1" in result.stderr


def test_utf8_with_a_stray_byte_stays_utf8(capsys, tmp_path):
    path = tmp_path / "in.de"
    path.write_bytes(GERMAN_WITH_UMLAUTS.encode() + b"Das Haus \xff ist gro\xc3\x9f.\n")
    out, err = run_main(capsys, "--input", path, "--quiet")
    assert len(out) == 2 and "Latin-1" not in err


def test_an_unknown_encoding_is_one_line():
    with pytest.raises(SpecNmtError, match=r"^--encoding klingon: no such encoding"):
        translate_cli.parse_args([str(BUNDLED_MODEL_DIR), "--encoding", "klingon"])
