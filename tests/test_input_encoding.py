"""spec-nmt-translate's input encodings (issue 67, item 4): short Latin-1 text is read as Latin-1
with the warning, whatever its length; a refusal names --encoding; bytes that are not UTF-8
inside UTF-8 text are named by their line. (Longer Latin-1 text and input that is not text:
test_cli_modes.py.)"""

import pytest

from spec_nmt.errors import SpecNmtError
from spec_nmt.input_text import input_encoding
from tests.test_cli_modes import NOT_TEXT, cli, run_main

SHORT_GERMAN = "Schöne Grüße\nDie Straße ist schön.\n"


def test_short_latin1_text_is_read_as_latin1_with_the_warning(capsys, tmp_path):
    utf8, latin1 = tmp_path / "utf8.de", tmp_path / "latin1.de"
    utf8.write_text(SHORT_GERMAN, encoding="utf-8")
    latin1.write_text(SHORT_GERMAN, encoding="latin-1")  # 5 of its 35 characters not UTF-8
    expected, _ = run_main(capsys, "--input", utf8, "--quiet")
    out, err = run_main(capsys, "--input", latin1, "--quiet")
    assert out == expected and len(out) == 2
    assert err.splitlines() == [
        f"spec-nmt-translate warning: {latin1} is not UTF-8; reading it as Latin-1 "
        "(Windows-1252); --encoding ENCODING names its encoding"
    ]


@pytest.mark.parametrize("text", ["Grüße\n", "schön", "„Straße“ – Köln\n"])
def test_a_line_or_word_of_latin1_is_latin1(capsys, text):
    assert input_encoding(text.encode("cp1252"), "stdin") == "cp1252"
    assert "stdin is not UTF-8; reading it as Latin-1" in capsys.readouterr().err


@pytest.mark.parametrize("kind", NOT_TEXT)
def test_a_refusal_names_the_encoding_flag(kind):
    with pytest.raises(SpecNmtError, match="it is not text .*name its encoding with --encoding$"):
        input_encoding(NOT_TEXT[kind][:8192], "stdin")


def test_latin1_bytes_inside_utf8_text_are_named_by_their_line(capsys, tmp_path):
    path = tmp_path / "mixed.de"
    path.write_bytes("Das Haus ist groß.\n".encode() + "Grüße aus Köln.\n".encode("latin-1")
                     + "Die Straße ist schön.\n".encode())  # fmt: skip
    out, err = run_main(capsys, "--input", path, "--quiet")
    assert len(out) == 3
    assert err.splitlines() == [
        f"spec-nmt-translate warning: {path} line 2 holds 3 byte(s) that are not utf-8, read "
        "as U+FFFD; --encoding ENCODING names the input's encoding"
    ]
    result = cli("--quiet", stdin=path.read_bytes())  # from stdin too
    assert len(result.stdout.splitlines()) == 3
    assert b"warning: stdin line 2 holds 3 byte(s) that are not utf-8" in result.stderr


def test_after_a_few_bad_lines_one_warning_says_more_follow(capsys, tmp_path):
    path = tmp_path / "mixed.de"
    # (enough UTF-8 that the input is not refused as mostly not UTF-8)
    utf8_line = "Das Haus ist groß. ".encode() * 10 + b"\n"
    path.write_bytes(utf8_line + "Grüße.\n".encode("latin-1") * 7)
    out, err = run_main(capsys, "--input", path, "--quiet", "--block-size", 0)
    warnings = err.splitlines()
    assert len(out) == 8 and len(warnings) == 6
    assert [w.split(" line ")[1].split()[0] for w in warnings[:5]] == ["2", "3", "4", "5", "6"]
    assert warnings[5] == (f"spec-nmt-translate warning: {path}: more lines hold bytes that are "
                           "not utf-8; they are not named")  # fmt: skip
