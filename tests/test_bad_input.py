"""Bad input, nothing lost: 36 kinds of awkward lines through fairseq-interactive (toy models) and
the Python API (bundled pair). Every input line gives exactly one output, in order; the process
never dies on input; lossless output equals the verifier's greedy output wherever stock fairseq
can translate the line at all."""

import os

import pytest
import sentencepiece

from spec_nmt.errors import SpecNmtError
from spec_nmt.translator import SpecTranslator
from tests.conftest import BLOCK_SIZE, BUNDLED_MODEL_DIR, USER_DIR, fairseq
from tests.test_lossless import hypotheses

LONG_WORDS = " ".join(f"s{i % 40}" for i in range(2000))  # past the models' 1024 positions
KINDS = {
    "plain": "s1 s2 s3",
    "empty": "",
    "one space": " ",
    "tabs": "\t\t",
    "unicode spaces": "\u00a0\u2003 \u3000",
    "10k characters": "x" * 10000,
    "over max positions": LONG_WORDS,
    "one long word": "w" * 500,
    "control characters": "\x01\x02 s4 \x03",
    "nul": "s5\x00s6",
    "ansi escape": "\x1b[31m s7 \x1b[0m",
    "carriage return inside": "s8\rs9",
    "vertical tab and form feed": "s1\x0bs2\x0cs3",
    "emoji": "😀 🚀 s4",
    "mixed scripts": "Das Haus 家 дом بيت",
    "bidi marks": "\u200f s5 \u200e",
    "zero width": "s6\u200b\u200ds7",
    "combining": "e\u0301 s8",
    "mask symbol": "[MASK]",
    "many masks": "[MASK] [MASK] [MASK] s9",
    "bos symbol": "<s>",
    "eos symbol": "</s>",
    "pad symbol": "<pad>",
    "unk symbol": "<unk>",
    "fairseq filler word": "madeupword0000",
    "punctuation only": "!!! ??? ...",
    "digits": "1234567890 3.14",
    "html": "<b>bold</b> &amp; <script>",
    "url": "https://example.com/?a=1&b=2",
    "byte order mark": "\ufeffs1 s2",
    "backslashes": "\\\\ \\n \\t",
    "repeated word": "s3 " * 300,
    "quotes": "\"s4\" 's5' „s6“",
    "lone surrogate escape text": "\\ud800",
    "private use": "\ue000\uf8ff",
    "trailing spaces": "s7 s8     ",
}
INVALID_UTF8 = b"s1 \xff\xfe s2"  # interactive only: the API takes text


def test_there_are_at_least_30_kinds():
    assert len(KINDS) + 1 >= 30


def interactive(toy, stdin_bytes, *task):
    result = fairseq(
        "interactive", toy["bin"], "--path", toy["verifier"], *task, "--batch-size", 3,
        "--buffer-size", 4, "--user-dir", USER_DIR, "--max-len-b", 40, "--cpu",
        input_text=stdin_bytes, check=False,
    )  # fmt: skip
    return result


def test_interactive_gives_one_output_per_line_in_order_and_stays_lossless(toy):
    lines = list(KINDS.values()) * 4  # a long run of batches
    payload = "\n".join(lines).encode("utf-8") + b"\n" + INVALID_UTF8 + b"\n" + b"s9 s1"  # no final newline
    result = interactive(toy, payload, "--task", "spec_translation", "--drafter-path",
                         toy["drafter"], "--block-size", BLOCK_SIZE, "--max-draft-batch", 0)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    found = hypotheses(result.stdout.decode("utf-8"))
    total = len(lines) + 2
    assert sorted(found) == list(range(total))
    order = [int(line.split("\t")[0][2:]) for line in result.stdout.decode().splitlines()
             if line.startswith("H-")]  # fmt: skip
    assert order == sorted(order)
    # lossless: stock greedy on the lines stock fairseq survives (valid UTF-8, no bare \r,
    # within its position limit)
    readable = [i for i, line in enumerate(lines) if "\r" not in line and len(line.split()) < 1000]
    stock_input = "\n".join(lines[i] for i in readable).encode("utf-8") + b"\n"
    stock = interactive(toy, stock_input, "--task", "translation", "--beam", 1)
    assert stock.returncode == 0, stock.stderr[-2000:]
    expected = hypotheses(stock.stdout.decode("utf-8"))
    for position, i in enumerate(readable):
        # fairseq's collater counts a typed "<pad>" as padding: that line is an empty source
        if set(lines[i].split()) - {"<pad>"}:
            assert found[i] == expected[position], (lines[i][:40], found[i], expected[position])
        else:
            assert found[i] == ""




def bundled_translator(device=None):
    """The bundled pair with this file's settings, on ``device`` (default: CUDA if available)."""
    return SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, device=device, block_size=6,
                                          max_len_a=0, max_len_b=12)  # fmt: skip


@pytest.fixture(scope="module")
def translator():
    return bundled_translator()


def test_the_api_gives_one_output_per_line_and_stays_lossless(translator):
    lines = list(KINDS.values()) + ["\ud800 Haus"]  # a lone surrogate, possible in a str
    outputs = translator.translate(lines, batch_size=8)
    assert len(outputs) == len(lines) and all(isinstance(o, str) for o in outputs)
    assert len(translator.statistics) == len(lines)
    alone = [translator.translate(line) for line in lines]
    assert outputs == alone
    for line, output in zip(lines, outputs):
        if not "".join(ch for ch in line if ch.isprintable()).strip():
            assert output == ""


@pytest.mark.parametrize("bad", [b"bytes", None, 3, ["ok", None]])
def test_the_api_refuses_non_text_with_one_line(translator, bad):
    with pytest.raises(SpecNmtError, match="a string or a list of strings"):
        translator.translate(bad)


def model_dir_with(tmp_path, **replaced):
    """A copy of the bundled model directory (links) with some files replaced by bytes or by
    links to other files."""
    directory = tmp_path / "model"
    directory.mkdir()
    for name in os.listdir(BUNDLED_MODEL_DIR):
        target = directory / name
        content = replaced.get(name, BUNDLED_MODEL_DIR / name)
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.symlink_to(content)
    return directory


def half(name):
    data = (BUNDLED_MODEL_DIR / name).read_bytes()
    return data[: len(data) // 2]


def other_sentencepiece_model(tmp_path):
    text = tmp_path / "other.txt"
    text.write_text("".join(f"zebra {i} quokka {i * 7} xylophon\n" for i in range(300)))
    prefix = tmp_path / "other_spm"
    sentencepiece.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(prefix), vocab_size=60, minloglevel=2
    )
    return prefix.with_suffix(".model").read_bytes()


def bigger_dictionary():
    words = (BUNDLED_MODEL_DIR / "dict.en.txt").read_text()
    return (words + "".join(f"extraword{i} 1\n" for i in range(8))).encode()


BAD_MODEL_DIRECTORIES = {
    "truncated verifier": ({"verifier.pt": lambda tmp: half("verifier.pt")},
                           "verifier.pt is not a readable fairseq checkpoint"),
    "truncated drafter": ({"drafter.pt": lambda tmp: half("drafter.pt")},
                          "drafter.pt is not a readable fairseq checkpoint"),
    "empty verifier": ({"verifier.pt": lambda tmp: b""},
                       "verifier.pt is not a readable fairseq checkpoint"),
    "drafter as verifier": ({"verifier.pt": lambda tmp: BUNDLED_MODEL_DIR / "drafter.pt"},
                            "verifier.pt is a Spec-Drafter, not a verifier"),
    "garbage sentencepiece": ({"spm.model": lambda tmp: b"not a model"},
                              "spm.model is not a readable sentencepiece model"),
    "another sentencepiece": ({"spm.model": other_sentencepiece_model},
                              "spm.model does not match"),
    "another dictionary": ({"dict.de.txt": lambda tmp: bigger_dictionary(),
                            "dict.en.txt": lambda tmp: bigger_dictionary()},
                           "verifier.pt does not fit the model built from the data directory"),
}  # fmt: skip


@pytest.mark.parametrize("kind", BAD_MODEL_DIRECTORIES)
def test_bad_model_files_give_one_line_naming_the_file(tmp_path, kind):
    replacements, message = BAD_MODEL_DIRECTORIES[kind]
    directory = model_dir_with(tmp_path, **{name: make(tmp_path) for name, make in replacements.items()})
    with pytest.raises(SpecNmtError) as error:
        SpecTranslator.from_pretrained(directory, device="cpu")
    assert message in str(error.value) and str(directory) in str(error.value)
    assert "\n" not in str(error.value)
