"""Characters the vocabulary lacks come back at their place (issue 67, item 4): runs of them
taken out of a sentence and put back into hand-written translations, then through the bundled
pair (the API and spec-nmt-translate), where a line of nothing else is copied; and the one
warning for sentences longer than the models were trained on (item 5)."""

import pytest

from spec_nmt import cli as translate_cli
from spec_nmt import translator as translator_module
from spec_nmt.symbols import ForeignCharacters, nothing_to_translate
from spec_nmt.translator import SpecTranslator
from tests.conftest import BUNDLED_MODEL_DIR

READABLE = set("abcdefghijklmnopqrstuvwxyzäöüßABCDEFGHIJKLMNOPQRSTUVWXYZÄÖÜ0123456789.,!?:;'\"-€")
FOREIGN = ForeignCharacters(READABLE)


@pytest.mark.parametrize(
    "source,readable,model_output,restored",
    [
        # the line: after the word it follows, before the final punctuation
        ("Ich liebe Pizza 🍕😀 und Kaffee ☕.", "Ich liebe Pizza und Kaffee.",
         "I love pizza and coffee.", "I love pizza 🍕😀 and coffee ☕."),
        # no word to follow: at the same share of the words
        ("Wir fahren nach Москва und Київ.", "Wir fahren nach und.",
         "We go to and.", "We go to Москва and Київ."),
        ("Er sagte: ♥ ist gut.", "Er sagte: ist gut.", "He said: is good.", "He said: ♥ is good."),
        # at the start, at the very end, glued, spaced runs kept as they were
        ("😀 Hallo Welt", "Hallo Welt", "Hello world", "😀 Hello world"),
        ("Kaffee ☕.🍕", "Kaffee.", "Coffee.", "Coffee ☕.🍕"),
        ("Pizza🍕 ist gut", "Pizza ist gut", "Pizza is good", "Pizza🍕 is good"),
        ("Pizza 🍕 😀 und Kaffee ☕", "Pizza und Kaffee", "pizza and coffee",
         "pizza 🍕 😀 and coffee ☕"),
        # a word with a character the model cannot read goes whole
        ("Wir grüßen Zoë heute.", "Wir grüßen heute.", "We greet today.", "We greet Zoë today."),
        # nothing to put back: the sentence as it is
        ("Guten Morgen.", "Guten Morgen.", "Good morning.", "Good morning."),
    ],
)  # fmt: skip
def test_runs_are_taken_out_and_put_back_at_their_place(source, readable, model_output,
                                                         restored):  # fmt: skip
    text, runs = FOREIGN.split(source)
    assert text == readable
    assert not nothing_to_translate(text, runs)
    assert ForeignCharacters.restore(model_output, runs) == restored


@pytest.mark.parametrize("line", ["🍕", "😀 😀!", "„☕“"])
def test_a_sentence_of_nothing_else_is_copied(line):
    assert nothing_to_translate(*FOREIGN.split(line))


# ----- the bundled pair ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def translator():
    return SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, device="cpu")


LINES = ["Ich liebe Pizza 🍕😀 und Kaffee ☕.", "🍕", "", "Guten Morgen.",
         "Wir fahren nach Москва.", "😀 😀"]  # fmt: skip


def test_the_bundled_pair_keeps_symbols_and_copies_lines_of_nothing_else(translator):
    outputs = translator.translate(LINES, batch_size=4)
    assert len(outputs) == len(LINES)
    assert outputs[0].startswith("I love pizza 🍕😀") and outputs[0].endswith("☕.")
    assert outputs[1] == "🍕" and outputs[5] == "😀 😀" and outputs[2] == ""
    # a copied line is not decoded: no iterations, no score
    assert translator.statistics[1]["iterations"] == 0 and translator.statistics[1]["score"] is None
    assert outputs[3] == translator.translate("Guten Morgen.")
    assert "Москва" in outputs[4]
    # the model reads the sentence without them, as typed without them
    assert outputs[0] == translator.translate("Ich liebe Pizza und Kaffee.").replace(
        "pizza", "pizza 🍕😀").replace("coffee.", "coffee ☕.")  # fmt: skip
    assert [translator.translate(line) for line in LINES] == outputs


def test_the_cli_keeps_symbols(capsys, tmp_path, translator):
    path = tmp_path / "in.de"
    path.write_text("".join(line + "\n" for line in LINES), encoding="utf-8")
    translate_cli.main([str(BUNDLED_MODEL_DIR), "--cpu", "--quiet", "--input", str(path)])
    assert capsys.readouterr().out.splitlines() == translator.translate(LINES)


def test_sentences_longer_than_the_training_data_are_named_once(translator, caplog, monkeypatch):
    monkeypatch.setattr(translator_module, "MAX_PIECES", 6)
    with caplog.at_level("WARNING", logger="spec_nmt"):
        translator.translate(["Das Haus ist sehr groß und sehr alt.", "Ja.",
                              "Der Hund schläft im Garten hinter dem Haus."],
                             split_sentences=False, block_size=0)  # fmt: skip
    warnings = [r.getMessage() for r in caplog.records if "trained on" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].startswith("2 sentence(s) longer than the 6 pieces the models were trained")
    assert "split such lines" in warnings[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="spec_nmt"):
        translator.translate("Ja.")
    assert not [r for r in caplog.records if "trained on" in r.getMessage()]
