"""The recipes' steps one by one: data preparation checks its input and reads WMT archives,
drafters start from their verifier, the hydra configs train, export_model.py cannot overwrite or
mismatch a model pair, the verifier keeps the checkpoints its finishing step averages, usage lines
and help texts say what runs, make translate's switches read 0 as off. (The whole recipe runs in
test_pipeline.py; the campaign's stages in test_campaign.py.)"""

import ast
import io
import json
import os
import re
import subprocess
import sys
import tarfile

import pytest
import torch
from fairseq import checkpoint_utils
from packaging.specifiers import SpecifierSet

from spec_nmt.checkpoint_loading import save_checkpoint
from spec_nmt.data_prep import check_raw_dir
from spec_nmt.drafters.twin_drafter import TwinDrafter
from spec_nmt.errors import SpecNmtError
from tests.conftest import BIN, BUNDLED_MODEL_DIR, REPO, fairseq_error, script_module
from tests.toy_corpus import write_corpus

PYTHON_SCRIPTS = sorted((REPO / "scripts").glob("*.py")) + [REPO / "benchmarks" / "benchmark.py"]


def script(path, *args, check=True):
    result = subprocess.run(
        [sys.executable, str(path), *map(str, args)], capture_output=True, text=True, cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=600,
    )  # fmt: skip
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def export(out_dir, verifier=BUNDLED_MODEL_DIR / "verifier.pt", *extra, check=True):
    """export_model.py on the bundled pair's files (its directory holds the dictionaries)."""
    return script(
        REPO / "scripts" / "export_model.py", out_dir, "--verifier", verifier,
        "--drafter", BUNDLED_MODEL_DIR / "drafter.pt", "--data-bin", BUNDLED_MODEL_DIR,
        "--spm-model", BUNDLED_MODEL_DIR / "spm.model", "--draft-vocab-size", 0, *extra,
        check=check,
    )  # fmt: skip


def test_export_refuses_a_drafter_trained_for_another_verifier(tmp_path):
    state = checkpoint_utils.load_checkpoint_to_cpu(str(BUNDLED_MODEL_DIR / "verifier.pt"))
    weight = state["model"]["encoder.layers.0.fc1.weight"]
    weight += 0.01 * (1 + weight.abs())  # another verifier, as one trained further would be
    other = tmp_path / "other_verifier.pt"
    save_checkpoint(state, other)
    result = export(tmp_path / "model", other, check=False)
    assert result.returncode == 1
    # (fairseq's import hint "Please install tensorboardX" is an INFO line of its own)
    lines = [line for line in result.stderr.splitlines() if not line.startswith("INFO:")]
    assert len(lines) == 1 and "trained on another verifier's" in lines[0]
    assert not (tmp_path / "model").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["other_verifier.pt"]  # nothing left aside


def test_export_replaces_a_model_only_with_force_and_then_drops_its_model_card(tmp_path):
    model = tmp_path / "model"
    export(model)
    assert sorted(p.name for p in model.iterdir()) == [
        "dict.de.txt", "dict.en.txt", "drafter.pt", "spm.model", "verifier.pt"
    ]
    (model / "MODEL_CARD.md").write_text("the old pair\n")
    before = (model / "verifier.pt").stat().st_mtime_ns
    result = export(model, check=False)
    assert result.returncode == 1
    assert "already holds a model" in result.stderr and "--force" in result.stderr
    assert (model / "verifier.pt").stat().st_mtime_ns == before
    assert (model / "MODEL_CARD.md").exists()
    export(model, BUNDLED_MODEL_DIR / "verifier.pt", "--force")
    assert not (model / "MODEL_CARD.md").exists()
    assert (model / "verifier.pt").stat().st_mtime_ns != before


def test_train_verifier_keeps_the_checkpoints_finish_verifier_averages(tmp_path):
    bin_dir = tmp_path / "stand-in"
    bin_dir.mkdir()
    (bin_dir / "fairseq-train").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {tmp_path}/args\n')
    (bin_dir / "fairseq-train").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    subprocess.run(["scripts/train_verifier.sh", tmp_path / "bin", tmp_path / "save"], cwd=REPO,
                   env=env, check=True, timeout=60)  # fmt: skip
    args = (tmp_path / "args").read_text().splitlines()
    kept = [int(args[i + 1]) for i, arg in enumerate(args) if arg == "--keep-interval-updates"]
    averaged = re.search(r'"--last", type=int, default=(\d+)',
                         (REPO / "scripts" / "finish_verifier.py").read_text())  # fmt: skip
    assert kept[-1] >= int(averaged.group(1))  # fairseq keeps the last value given


TRAINING_SCRIPTS = ["train_verifier.sh", "train_drafter.sh", "train_ar_drafter.sh",
                    "train_feature_drafter.sh"]  # fmt: skip


@pytest.mark.parametrize("name", TRAINING_SCRIPTS)
def test_training_scripts_answer_no_arguments_and_help_with_their_usage_line(name, tmp_path):
    # a stand-in fairseq-train that leaves a trace: neither call may start a training run
    bin_dir = tmp_path / "stand-in"
    bin_dir.mkdir()
    (bin_dir / "fairseq-train").write_text(f"#!/bin/bash\ntouch {tmp_path}/trained\n")
    (bin_dir / "fairseq-train").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    def run(*args):
        return subprocess.run([f"scripts/{name}", *args], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=60)  # fmt: skip

    # the sizes are the presets the script's case handles, the first the default
    text = (REPO / "scripts" / name).read_text()
    presets = re.findall(r"^  (\w+)\)\s+MODEL=", text, re.M)
    usage = f"usage: scripts/{name} DATA_BIN SAVE_DIR [{'|'.join(presets)}] [fairseq-train flags]"
    bare = run()
    assert bare.returncode == 2 and bare.stdout == "" and bare.stderr == usage + "\n"
    for flag in ("--help", "-h"):
        helped = run(flag)
        assert helped.returncode == 0 and helped.stdout == usage + "\n" and helped.stderr == ""
    wrong = run(tmp_path, tmp_path / "save", "huge")
    assert wrong.returncode == 2
    assert wrong.stderr == f"scripts/{name}: size must be one of {' '.join(presets)}, got huge\n"
    assert not (tmp_path / "trained").exists()


def test_the_drafter_sizes_the_readme_uses_are_the_scripts():
    readme = (REPO / "README.md").read_text()
    used = set(re.findall(r"scripts/train_drafter\.sh \S+ \S+ (\w+)", readme))
    usage = subprocess.run(["scripts/train_drafter.sh", "--help"], cwd=REPO, capture_output=True,
                           text=True, timeout=60).stdout  # fmt: skip
    sizes = re.search(r"SAVE_DIR \[(.*?)\]", usage).group(1).split("|")
    assert used and used <= set(sizes), (used, sizes)


def test_prepare_data_refuses_a_vocabulary_too_large_with_one_line_and_writes_nothing(tmp_path):
    raw = write_corpus(tmp_path / "raw", n_train=20, n_valid=3, n_test=3)
    out = tmp_path / "data"
    result = script(REPO / "scripts" / "prepare_data.py", raw, out, "--vocab-size", 8000,
                    check=False)  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()
    assert len(last) == 1, result.stderr
    assert re.fullmatch(r"spec_nmt error: --vocab-size 8000 is more than sentencepiece can make "
                        r"of this training text \(at most (\d+) pieces\): give --vocab-size \1 "
                        r"or less, or more text", last[0])  # fmt: skip
    assert not out.exists()
    out.mkdir()  # an existing directory keeps what it held, and gets nothing
    (out / "notes.txt").write_text("mine")
    script(REPO / "scripts" / "prepare_data.py", raw, out, "--vocab-size", 8000, check=False)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("path", PYTHON_SCRIPTS, ids=lambda p: p.name)
def test_usage_lines_keep_their_line_continuations(path):
    source = path.read_text()
    tree = ast.parse(source)
    docstring = ast.get_source_segment(source, tree.body[0])
    shown = ast.get_docstring(tree, clean=False)

    def continued(text):
        return sum(line.rstrip().endswith("\\") for line in text.splitlines())

    assert continued(shown) == continued(docstring)


def test_prepare_data_help_names_scripts_that_exist():
    text = script(REPO / "scripts" / "prepare_data.py", "--help").stdout
    named = re.findall(r"scripts/[\w.]+", text)
    assert named and all((REPO / name.rstrip(".")).is_file() for name in named), named


def test_every_trace_flag_has_help_and_the_drafter_flag_is_the_clis():
    text = script(REPO / "scripts" / "trace.py", "--help").stdout
    options = text.split("options:")[1]
    entries = re.split(r"\n  (?=-)", options)[1:]
    for entry in entries:
        flag, *words = entry.split()
        assert len(words) > 2, f"{flag} has no help"
    assert "--drafter-path DRAFTER_PATH" in text and "--drafter DRAFTER" not in text


def make_translate(*variables):
    """The commands `make translate` would run (make -n), without an environment to build."""
    venv = "/nonexistent-venv"
    result = subprocess.run(
        ["make", "-n", "-o", f"{venv}/.installed", "translate", f"VENV={venv}", *variables],
        cwd=REPO, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return result.stdout


@pytest.mark.parametrize("value", ["0", "no", "false"])
def test_make_translate_reads_fairseq_output_0_as_off(value):
    commands = make_translate(f"FAIRSEQ_OUTPUT={value}")
    assert "spec-nmt-translate" in commands and "fairseq-interactive" not in commands
    assert "fairseq-interactive" in make_translate("FAIRSEQ_OUTPUT=1")


def test_make_translate_reads_stdin_at_a_terminal_too():
    """One behaviour at a terminal: make translate hands stdin to spec-nmt-translate, which
    translates typed lines as they come (test_cli_modes.py); the examples only with INPUT."""
    for commands in (make_translate(), make_translate("FAIRSEQ_OUTPUT=1")):
        assert "examples.de" not in commands
    assert "--input -" in make_translate()
    assert "--stats" in make_translate("STATS=1") and "--stats" not in make_translate("STATS=0")


def test_make_translate_passes_verify_and_seed_on():
    for commands in (make_translate("VERIFY=sampling", "SEED=3"),
                     make_translate("VERIFY=sampling", "SEED=3", "FAIRSEQ_OUTPUT=1")):  # fmt: skip
        assert "--verify sampling" in commands and "--seed 3" in commands
    assert "--verify" not in make_translate() and "--seed" not in make_translate()


@pytest.mark.parametrize("path", PYTHON_SCRIPTS, ids=lambda p: p.name)
def test_scripts_print_no_hints_of_fairseq_imports(path):
    """fairseq's modules configure logging at import and log INFO hints ("Please install
    tensorboardX"); scripts import spec_nmt first, which imports fairseq without them."""
    result = script(path, "--help")
    assert "tensorboardX" not in result.stderr and "INFO" not in result.stderr


def test_the_supported_pythons_are_those_fairseq_installs_on():
    setup = ast.parse((REPO / "setup.py").read_text())
    call = next(node for node in ast.walk(setup) if isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "setup")  # fmt: skip
    keywords = {k.arg: k.value for k in call.keywords}
    supported = SpecifierSet(ast.literal_eval(keywords["python_requires"]))
    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert running in supported
    assert "3.13" not in supported and "3.14" not in supported
    fairseq_markers = [r for r in ast.literal_eval(keywords["install_requires"]) if "fairseq" in r]
    assert any('python_version < "3.13"' in marker for marker in fairseq_markers)


def test_benchmark_run_reports_the_defaults_acceptance_at_batch_1(tmp_path):
    src, ref = tmp_path / "src.de", tmp_path / "ref.en"
    over_the_limit = TwinDrafter.default_draft_batch + 1  # (sentences the twin drafts for)
    pairs = [("Guten Morgen.", "Good morning."), ("Das Haus ist groß.", "The house is big."),
             ("Wie geht es dir heute?", "How are you today?")] * over_the_limit  # fmt: skip
    src.write_text("".join(de + "\n" for de, _ in pairs[:over_the_limit]))
    ref.write_text("".join(en + "\n" for _, en in pairs[:over_the_limit]))
    result_path = tmp_path / "run.json"
    script(REPO / "benchmarks" / "benchmark.py", "run", BUNDLED_MODEL_DIR, "--src", src,
           "--ref", ref, "--batch-size", over_the_limit, "--latency-lines", 3,
           "--warmup-lines", 0, "--json", result_path)  # fmt: skip
    rows = {row["system"]: row for row in json.loads(result_path.read_text())["rows"]}
    defaults = rows["spec-nmt defaults"]
    # a batch over the twin's limit does not draft ...
    assert defaults["mean_accepted_per_iteration"] == 0
    assert defaults["batch1_mean_accepted_per_iteration"] > 0  # ... one sentence does


def test_init_from_verifier_rejects_a_different_encoder_shape(toy, tmp_path):
    message = fairseq_error(
        "train", toy["bin"], "--user-dir", REPO / "spec_nmt", "--task", "spec_translation",
        "--arch", "spec_drafter_small", "--share-all-embeddings", "--criterion", "spec_drafter_loss",
        "--init-from-verifier", toy["verifier"], "--max-update", 1, "--cpu",
        "--save-dir", tmp_path, "--optimizer", "adam", "--lr", "0.001", "--max-tokens", "500",
    )  # fmt: skip
    assert "--init-from-verifier" in message


def test_prepare_checks_its_input(tmp_path):
    raw = write_corpus(tmp_path / "raw", n_train=10, n_valid=3, n_test=3)
    check_raw_dir(raw, "de", "en")
    (raw / "valid.en").write_text("only one line\n")
    with pytest.raises(SpecNmtError, match="valid.de has 3 lines but valid.en has 1"):
        check_raw_dir(raw, "de", "en")
    (raw / "test.de").unlink()
    with pytest.raises(SpecNmtError, match="test.de is missing"):
        check_raw_dir(raw, "de", "en", splits=("test",))


def test_wmt14_recipe_reads_archives_and_sgml(tmp_path):
    prepare_wmt14 = script_module("prepare_wmt14")
    orig = tmp_path / "orig"
    orig.mkdir()

    def add(tar, name, text):
        data = text.encode("utf-8")
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    with tarfile.open(orig / "train.tgz", "w:gz") as tar:
        for corpus in ("training/europarl-v7.de-en", "commoncrawl.de-en", "training/news-commentary-v9.de-en"):
            add(tar, f"{corpus}.de", "Hallo  Welt\n")
            add(tar, f"{corpus}.en", "Hello world\n")
    with tarfile.open(orig / "test.tgz", "w:gz") as tar:
        add(tar, "dev/newstest2013.de", "Ja\n")
        add(tar, "dev/newstest2013.en", "Yes\n")
        sgm = '<srcset>\n<doc docid="1">\n<seg id="1">Gro&szlig;e &amp; kleine</seg>\n</doc>\n'
        add(tar, "test-full/newstest2014-deen-src.de.sgm", sgm)
        add(tar, "test-full/newstest2014-deen-ref.en.sgm", sgm.replace("Gro&szlig;e", "Big"))
    prepare_wmt14.write_raw(orig, tmp_path / "raw")
    assert (tmp_path / "raw" / "train.de").read_text() == "Hallo Welt\n" * 3
    assert (tmp_path / "raw" / "valid.en").read_text() == "Yes\n"
    assert (tmp_path / "raw" / "test.de").read_text() == "Große & kleine\n"
    assert (tmp_path / "raw" / "test.en").read_text() == "Big & kleine\n"


@pytest.mark.parametrize("config_dir", ["verifier", "drafter"])
def test_hydra_configs_train(toy, tmp_path, config_dir):
    overrides = [f"task.data={toy['bin']}", f"checkpoint.save_dir={tmp_path}",
                 f"common.user_dir={REPO / 'spec_nmt'}", "common.cpu=true",
                 "optimization.max_update=2", "dataset.max_tokens=1000"]  # fmt: skip
    def hydra_train(*extra):
        return subprocess.run(
            [str(BIN / "fairseq-hydra-train"), "--config-dir", REPO / "configs" / config_dir,
             "--config-name", "small", *overrides, *extra],
            capture_output=True, text=True, cwd=tmp_path, check=False,
        )  # fmt: skip

    if config_dir == "drafter":
        failed = hydra_train(f"+model.init_from_verifier={tmp_path / 'missing.pt'}")
        assert failed.returncode != 0 and "missing.pt: no such file" in failed.stderr
    result = hydra_train()
    assert result.returncode == 0, result.stderr[-3000:]
    state = torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)
    expected = {"verifier": "transformer", "drafter": "spec_drafter_small"}[config_dir]
    assert state["cfg"]["model"]["_name"] == expected
