"""Stock fairseq in the installed environment, without --user-dir: torch >= 2.6 loads fairseq
checkpoints only because installing spec-nmt puts spec_nmt_torch_load.pth into site-packages."""

import subprocess
import sys
import zipfile

from spec_nmt_torch_load import PTH_LINE, PTH_NAME
from tests.conftest import BUNDLED_MODEL_DIR, OPTIMIZATION, REPO, TINY_TRANSFORMER, fairseq


def test_stock_fairseq_interactive_translates_with_the_bundled_verifier():
    model = BUNDLED_MODEL_DIR
    result = fairseq(
        "interactive", model, "--path", model / "verifier.pt", "--source-lang", "de",
        "--target-lang", "en", "--bpe", "sentencepiece", "--sentencepiece-model", model / "spm.model",
        "--beam", 2, "--cpu", input_text="Guten Morgen.\nDas Haus ist groß.\n",
    )  # fmt: skip
    assert [line[:4] for line in result.stdout.splitlines() if line.startswith("D-")] == [
        "D-0\t",
        "D-1\t",
    ]


def test_stock_fairseq_generate_and_train_resume_a_toy_checkpoint(toy, tmp_path):
    result = fairseq(
        "generate", toy["bin"], "--path", toy["verifier"], "--beam", 2, "--cpu", "--quiet"
    )
    assert "Generate test with beam=2" in result.stdout + result.stderr
    # fairseq-train resumes from a checkpoint (optimizer state included) without the plugin
    save_dir = tmp_path / "resume"
    save_dir.mkdir()
    (save_dir / "checkpoint_last.pt").symlink_to(toy["verifier"])
    log = fairseq(
        "train", toy["bin"], "--arch", "transformer", *TINY_TRANSFORMER, *OPTIMIZATION,
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", 0.1,
        "--max-update", 302, "--save-dir", save_dir, "--no-save",
    )  # fmt: skip
    assert "Loaded checkpoint" in log.stdout + log.stderr


def test_the_safe_loader_stays_on_and_only_allows_fairseq_types():
    load = f"import torch; torch.load({str(BUNDLED_MODEL_DIR / 'verifier.pt')!r})"
    without_fairseq = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True)
    assert without_fairseq.returncode != 0 and "Weights only load failed" in without_fairseq.stderr
    with_fairseq = subprocess.run(
        [sys.executable, "-c", "import fairseq; " + load], capture_output=True, text=True
    )
    assert with_fairseq.returncode == 0, with_fairseq.stderr[-2000:]


def test_a_regular_install_carries_the_pth_file_and_it_tolerates_a_removed_package(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
         str(tmp_path), str(REPO)],
        check=True, capture_output=True, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("spec_nmt-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read(PTH_NAME).decode() == PTH_LINE
        assert "spec_nmt_torch_load.py" in archive.namelist()
    # where the package is gone, the line does nothing instead of failing at every start
    gone = subprocess.run([sys.executable, "-I", "-c", PTH_LINE], capture_output=True, text=True)
    assert gone.returncode == 0 and gone.stderr == ""
