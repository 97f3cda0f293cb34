"""torch's CPU threads (issues 58, 67): spec-nmt-translate --threads, from_pretrained(threads=),
make translate THREADS= and the task's --threads (fairseq-generate/-interactive) reach torch,
the default is spec_nmt.runtime's and --help says why, and a count below 1 is a one-line error
naming what the caller wrote."""

import os
import subprocess
import sys
from unittest import mock

import pytest
import torch
from fairseq import checkpoint_utils

from spec_nmt import cli as translate_cli
from spec_nmt.errors import SpecNmtError
from spec_nmt.runtime import DEFAULT_THREADS
from spec_nmt.task import SpecTranslationConfig, SpecTranslationTask
from spec_nmt.translator import SpecTranslator
from tests.conftest import BIN, BUNDLED_MODEL_DIR, REPO


@pytest.fixture(autouse=True)
def torch_threads_kept():
    """Each test may change torch's threads for the process: they are put back after it."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def run_main(capsys, *args):
    translate_cli.main([str(BUNDLED_MODEL_DIR), "--cpu", "--stats", *map(str, args)])
    return capsys.readouterr()


def test_the_cli_decodes_on_the_threads_it_is_given(capsys, tmp_path):
    path = tmp_path / "in.de"
    path.write_text("Guten Morgen.\n")
    for threads, shown in ((2, "2 CPU threads"), (1, "1 CPU thread")):
        torch.set_num_threads(3)
        out, err = run_main(capsys, "--input", path, "--threads", threads)
        assert out == "Good morning.\n"
        assert torch.get_num_threads() == threads
        assert f"tokens/s, {shown}\n" in err


def test_the_default_is_the_runtime_modules_and_help_says_why(capsys):
    assert DEFAULT_THREADS == 1
    assert translate_cli.parse_args([str(BUNDLED_MODEL_DIR)]).threads == DEFAULT_THREADS
    with pytest.raises(SystemExit):
        translate_cli.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    entry = text.split("--threads THREADS")[-1].split("--drafter-precision")[0]
    assert "(default: 1)" in entry and "beside other busy processes" in entry


@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_thread_count_below_1_is_a_one_line_error(value):
    with pytest.raises(SpecNmtError, match=f"^--threads must be an integer >= 1 .*got {value}$"):
        translate_cli.parse_args([str(BUNDLED_MODEL_DIR), "--threads", value])


def test_the_console_refuses_threads_0_with_one_line_before_loading():
    result = subprocess.run(
        [sys.executable, "-m", "spec_nmt.cli", str(BUNDLED_MODEL_DIR), "--threads", "0"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, cwd=REPO, timeout=300,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )  # fmt: skip
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "spec_nmt error: --threads must be an integer >= 1 (CPU threads), got 0"
    ]


def test_from_pretrained_sets_torchs_threads_and_names_its_keyword():
    torch.set_num_threads(3)
    translator = SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, device="cpu")
    assert torch.get_num_threads() == DEFAULT_THREADS
    assert translator.translate("Guten Morgen.") == "Good morning."
    SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, device="cpu", threads=2)
    assert torch.get_num_threads() == 2
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(SpecNmtError, match=r"^threads must be an integer >= 1"):
            SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, device="cpu", threads=bad)


def test_make_translate_passes_threads_on():
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(REPO))
    result = subprocess.run(
        ["make", "-s", "translate", "THREADS=2", "STATS=1"], input="Guten Morgen.\n", cwd=REPO,
        env=env, capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    assert result.stdout == "Good morning.\n"
    assert "tokens/s, 2 CPU threads\n" in result.stderr
    commands = subprocess.run(
        ["make", "-n", "-o", "/nonexistent-venv/.installed", "translate",
         "VENV=/nonexistent-venv", "FAIRSEQ_OUTPUT=1", "THREADS=3"],
        cwd=REPO, capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    assert "OMP_NUM_THREADS=3 " in commands  # fairseq-interactive reads it when OpenMP loads


@pytest.fixture(scope="module")
def bundled_task_and_verifier():
    """The plugin's task over the bundled pair, as fairseq-interactive sets it up."""
    cfg = SpecTranslationConfig(data=str(BUNDLED_MODEL_DIR), source_lang="de", target_lang="en",
                                drafter_path=str(BUNDLED_MODEL_DIR / "drafter.pt"))  # fmt: skip
    task = SpecTranslationTask.setup_task(cfg)
    models, _ = checkpoint_utils.load_model_ensemble([str(BUNDLED_MODEL_DIR / "verifier.pt")],
                                                     task=task)  # fmt: skip
    return task, models


@pytest.mark.parametrize(
    "omp_num_threads, flag, expected",
    [(None, None, DEFAULT_THREADS), ("3", None, 3), (None, 2, 2), ("3", 2, 2)],
)
def test_the_fairseq_commands_get_the_default_unless_omp_num_threads_or_the_flag_says(
    bundled_task_and_verifier, monkeypatch, omp_num_threads, flag, expected
):
    task, models = bundled_task_and_verifier
    if omp_num_threads is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp_num_threads)
    monkeypatch.setattr(task.cfg, "threads", flag)
    torch.set_num_threads(3)  # (as torch starts: OMP_NUM_THREADS, else one per core)
    with mock.patch("atexit.register"):
        task.build_generator(models, SpecTranslationConfig())
    assert torch.get_num_threads() == expected


def test_the_tasks_threads_flag_says_its_default_and_omp_num_threads():
    text = SpecTranslationConfig.__dataclass_fields__["threads"].metadata["help"]
    assert "beside other busy processes" in text and "The default, 1," in text
    assert "OMP_NUM_THREADS" in text


def test_the_readmes_fairseq_section_says_which_threads_the_task_gives():
    readme = (REPO / "README.md").read_text()
    section = readme.split("### fairseq-generate and fairseq-interactive")[1].split("\n### ")[0]
    text = " ".join(section.split())
    assert "the plugin's task gives torch the same default as `spec-nmt-translate`" in text
    assert "`OMP_NUM_THREADS` is set and `--threads` is not" in text
