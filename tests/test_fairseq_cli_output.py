"""What fairseq-generate and fairseq-interactive print with the plugin, on the bundled pair
(issue 58): the decoding they name, and no warnings a user cannot act on."""

import sentencepiece

from tests.conftest import BUNDLED_MODEL_DIR, USER_DIR, fairseq

MODEL = BUNDLED_MODEL_DIR
PAIR = ["--user-dir", USER_DIR, "--task", "spec_translation", "--source-lang", "de",
        "--target-lang", "en", "--path", MODEL / "verifier.pt",
        "--drafter-path", MODEL / "drafter.pt", "--cpu"]  # fmt: skip
SOURCES = ["Guten Morgen.", "Das Haus ist groß."]
REFERENCES = ["Good morning.", "The house is big."]


def test_fairseq_generate_names_the_greedy_decoding_it_did(tmp_path):
    spm = sentencepiece.SentencePieceProcessor(model_file=str(MODEL / "spm.model"))
    raw = tmp_path / "raw"
    raw.mkdir()
    for lang, lines in (("de", SOURCES), ("en", REFERENCES)):
        pieces = [" ".join(spm.encode(line, out_type=str)) for line in lines]
        (raw / f"test.{lang}").write_text("\n".join(pieces) + "\n")
    data_bin = tmp_path / "bin"
    # with the bundled pair's dictionary, so that its token ids hold
    fairseq("preprocess", "--source-lang", "de", "--target-lang", "en", "--testpref", raw / "test",
            "--destdir", data_bin, "--joined-dictionary", "--srcdict", MODEL / "dict.de.txt",
            "--workers", 1)  # fmt: skip
    result = fairseq("generate", data_bin, *PAIR, "--batch-size", 2,
                     "--required-batch-size-multiple", 1, "--quiet")  # fmt: skip
    output = result.stdout + result.stderr
    # fairseq's default --beam is 5; the plugin decoded greedily (speculatively)
    assert "Generate test with beam=1: BLEU" in output, output[-2000:]
    assert "beam=5" not in output


def test_fairseq_interactive_prints_no_deprecation_warnings_of_fairseqs_hydra_use(monkeypatch):
    monkeypatch.delenv("PYTHONWARNINGS", raising=False)  # (which `make translate` sets)
    result = fairseq(
        "interactive", MODEL, *PAIR, "--bpe", "sentencepiece",
        "--sentencepiece-model", MODEL / "spm.model", input_text="Guten Morgen.\n",
    )  # fmt: skip
    assert result.stdout.splitlines()[3].endswith("\tGood morning.")  # D-0
    assert "Warning" not in result.stderr, result.stderr[-3000:]
