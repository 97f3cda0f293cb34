"""Lines of several sentences: split into sentences, translated with all others in batches and
joined again, one output line per input line, through the API and `make translate`."""

import os
import subprocess

import pytest

from spec_nmt.text import join_sentences, split_sentences
from spec_nmt.translator import SpecTranslator
from tests.conftest import BIN, BUNDLED_MODEL_DIR, REPO

SENTENCES = ["Der Hund schläft im Garten.", "Morgen regnet es in Berlin.", "Am 3. Oktober feiern wir z. B. ein Fest!"]
PARAGRAPH = " ".join(SENTENCES)


def test_german_is_split_at_sentence_ends_not_after_ordinals_or_abbreviations():
    assert split_sentences(PARAGRAPH, "de") == SENTENCES
    assert split_sentences("  Er sagte: „Nein.“ Dann ging er.  ", "de") == ["Er sagte: „Nein.“", "Dann ging er."]
    assert split_sentences(" \t ", "de") == []
    assert join_sentences(["One.", "", "Two."]) == "One. Two."


@pytest.fixture(scope="module")
def translator():
    return SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, block_size=10)


@pytest.fixture(scope="module")
def sentences_alone(translator):
    return [translator.translate(sentence, split_sentences=False) for sentence in SENTENCES]


def test_a_paragraph_line_becomes_one_line_of_its_sentences_translations(translator, sentences_alone):
    lines = ["Guten Morgen.", PARAGRAPH, "", "Ja."]
    done = []
    translations = translator.translate(lines, batch_size=3, progress=done.append)
    statistics = translator.statistics
    assert [s["sentences"] for s in statistics] == [1, 3, 0, 1]
    assert statistics[1]["output_tokens"] > statistics[0]["output_tokens"]
    assert sum(done) == len(lines)
    assert translations[1] == " ".join(sentences_alone)
    assert translations[0] == translator.translate("Guten Morgen.", split_sentences=False)
    assert translations[2] == ""
    assert statistics[2]["score"] is None and statistics[1]["score"] < 0


def test_make_translate_gives_one_line_with_the_three_sentences(sentences_alone):
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    result = subprocess.run(
        ["make", "-s", "translate", "BLOCK_SIZE=10"], input=PARAGRAPH + "\n", cwd=REPO, env=env,
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    assert result.stdout.splitlines() == [" ".join(sentences_alone)]
    assert "1 line, 3 sentences" in result.stderr


def test_the_command_line_translates_buffer_by_buffer_in_input_order(translator, tmp_path):
    lines = [PARAGRAPH, "Guten Morgen.", "", "Das Haus ist groß. Es ist alt.", "Ja.", PARAGRAPH, "Nein."]
    path = tmp_path / "mixed.de"
    path.write_text("\n".join(lines) + "\n")
    result = subprocess.run(
        [str(BIN / "spec-nmt-translate"), str(BUNDLED_MODEL_DIR), "--input", str(path),
         "--block-size", "10", "--buffer-size", "3", "--batch-size", "2"],
        capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL, check=True,
    )  # fmt: skip
    assert result.stdout.splitlines() == translator.translate(lines)
    assert "7 lines, 11 sentences" in result.stderr


def test_the_command_line_refuses_a_missing_input_file_with_one_line(tmp_path):
    result = subprocess.run(
        [str(BIN / "spec-nmt-translate"), str(BUNDLED_MODEL_DIR), "--input", str(tmp_path / "none.de")],
        capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1].startswith("spec_nmt error: --input ")
    assert "Traceback" not in result.stderr
