"""scripts/drafter_data.py end to end on the bundled model's dictionary: sources and their
translations (a translation file cut short keeps its pairs) become a data-bin train_drafter.sh
reads; an existing output directory is refused with one line."""

import subprocess
import sys

from fairseq.data import data_utils

from tests.conftest import BUNDLED_MODEL_DIR, REPO

SCRIPT = REPO / "scripts" / "drafter_data.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, cwd=REPO, timeout=300)  # fmt: skip


def test_translations_become_a_data_bin_and_an_existing_output_is_refused(tmp_path):
    sources = ["Das Haus ist groß.", "Wie geht es dir?", "Guten Morgen.", "Der Hund schläft."]
    (tmp_path / "src.de").write_text("".join(line + "\n" for line in sources), encoding="utf-8")
    translations = ["The house is big.", "How are you?", "Good morning."]  # cut short
    (tmp_path / "tr.en").write_text("".join(line + "\n" for line in translations), encoding="utf-8")
    for side, text in (("de", "Guten Morgen.\n"), ("en", "Good morning.\n")):
        (tmp_path / f"valid.{side}").write_text(text, encoding="utf-8")
    out = tmp_path / "bin"
    done = run(BUNDLED_MODEL_DIR, tmp_path / "src.de", tmp_path / "tr.en", tmp_path / "valid", out)
    assert done.returncode == 0, done.stderr[-2000:]
    for name in ("dict.de.txt", "dict.en.txt", "train.de-en.de.bin", "valid.de-en.en.idx"):
        assert (out / name).is_file()
    assert (out / "dict.en.txt").read_text() == (BUNDLED_MODEL_DIR / "dict.en.txt").read_text()
    train = data_utils.load_indexed_dataset(str(out / "train.de-en.en"), None)
    assert len(train) == len(translations)
    again = run(BUNDLED_MODEL_DIR, tmp_path / "src.de", tmp_path / "tr.en", tmp_path / "valid", out)
    assert again.returncode != 0
    assert again.stderr.strip().splitlines() == [
        f"drafter_data.py: {out} exists: choose a new directory"]
