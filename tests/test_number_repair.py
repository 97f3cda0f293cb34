"""Numbers survive translation (issue 58): which source numbers an output keeps (German formats
read the German way, English ones the English way), their repair on hand-built pairs, lines
without digits left alone, and the repair through the API and spec-nmt-translate on the bundled
pair, with keep_numbers=False / --no-number-repair giving the model's output as it is."""

import pytest

from spec_nmt import cli as translate_cli
from spec_nmt.number_repair import english, missing_numbers, numbers_in, repair, substitute
from spec_nmt.translator import SpecTranslator
from tests.conftest import BUNDLED_MODEL_DIR


@pytest.mark.parametrize(
    "source,output,missing",
    [
        ("Die Nummer ist 1234567890.", "The number is 1234567890.", []),
        ("Die Nummer ist 1234567890.", "The number is 123467890.", ["1234567890"]),
        ("Das kostet 4,20 Dollar.", "It costs 4.20 dollars.", []),
        ("Das kostet 4,20 Dollar.", "It costs 4,20 dollars.", ["4,20"]),  # German comma
        ("Das kostet $4.20.", "It costs $420.", ["4.20"]),  # the same digits, not the value
        ("1.234.567 Menschen", "1,234,567 people", []),
        ("1.234.567 Menschen", "1234567 people", []),
        ("1.500 Menschen", "1.500 people", ["1.500"]),  # one and a half in English
        ("8733 Kilometer", "8,733 kilometres", []),
        ("rund 200 000 Euro", "around 200,000 euros", []),
        ("am 20.12.2012 um 21:00 Uhr", "on 20.12.2012 at 21:00", []),
        ("am 6. Juni 1944", "on June 6, 1944", []),  # reordered: still kept
        ("von 10 auf 10 Prozent", "from 10 to 11 percent", ["10"]),  # each counted
        # 24-hour times the model wrote with a.m./p.m. (issue 67, item 3)
        ("von 11 bis 17 Uhr", "from 11 to 5 p.m.", []),
        ("von 14 bis 17 Uhr", "from 2 to 5 p.m.", []),
        ("um 17.30 Uhr", "at 5:30 pm", []),
        ("um 0 Uhr und um 9 Uhr", "at 12 a.m. and at 9am", []),
        ("um 17 Uhr", "at 6 p.m.", ["17"]),
        ("um 17 Uhr", "at 5", ["17"]),  # no p.m.: not that time
        # units the model converted, within rounding
        ("10 Meilen", "16 kilometres", []),
        ("100 km", "62 miles", []),
        ("100 km", "80 miles", ["100"]),
        ("30 Grad", "86 degrees Fahrenheit", []),
        ("2 Meter", "6.5 feet", []),
        ("2 Meter", "6.5 metres", ["2"]),  # the same unit: the same number
    ],
)  # fmt: skip
def test_which_numbers_an_output_keeps(source, output, missing):
    assert missing_numbers(source, output) == missing


@pytest.mark.parametrize(
    "source,output,repaired",
    [
        # the three examples
        ("Die Nummer ist 1234567890.", "The number is 123467890.", "The number is 1234567890."),
        ("Das kostet $4.20.", "It costs $4.4.", "It costs $4.20."),
        ("Die EU gibt 50 Milliarden Euro aus.", "The EU spends 2030 billion euros.",
         "The EU spends 50 billion euros."),
        # German formats become English ones
        ("Es warten 81.500 Einsprüche.", "81.500 objections are waiting.",
         "81,500 objections are waiting."),
        ("Die Quote stieg auf 7,5 Prozent.", "The rate rose to 7,5 percent.",
         "The rate rose to 7.5 percent."),
        # several wrong numbers, in order; a kept one is left where it is
        ("Von 1962 bis 1965 und 1970.", "From 1970, 19622 to 19655.",
         "From 1970, 1962 to 1965."),
    ],
)  # fmt: skip
def test_substitution_puts_the_lost_numbers_back(source, output, repaired):
    assert substitute(source, output) == repaired
    assert repair(source, output) == repaired
    assert not missing_numbers(source, repaired)


def test_english_forms_of_german_numbers():
    assert [english(n) for n in numbers_in("1.234.567 4,20 1.500,5 200 000 2013 20.12.2012")] \
        == ["1,234,567", "4.20", "1,500.5", "200,000", "2013", "20.12.2012"]  # fmt: skip


class Redecoder:
    """A stand-in for the constrained re-decoding: what it returns, and the calls it got."""

    def __init__(self, translation):
        self.translation, self.calls = translation, []

    def __call__(self, source):
        self.calls.append(source)
        return self.translation


def test_lines_without_digits_are_never_touched():
    redecode = Redecoder("something else")
    pairs = [("Der Hund schläft.", "The dog sleeps."),
             ("Der Hund schläft.", "The dog sleeps 3 hours."),
             ("Zwei Hunde.", "2 dogs."), ("", ""),
             # the digits of a name or code are no number
             ("Der G8-Gipfel mit dem A380.", "The G7 summit with the A38.")]  # fmt: skip
    for source, output in pairs:
        assert repair(source, output, redecode) == output
    assert redecode.calls == []


def test_a_translation_that_kept_its_numbers_is_not_decoded_again():
    redecode = Redecoder("other 1944")
    output = "He was born on 6 June 1944, at 5."  # an extra number does not matter
    assert repair("Er wurde am 6. Juni 1944 geboren.", output, redecode) == output
    assert redecode.calls == []


def test_a_dropped_number_is_decoded_again_and_kept_only_if_better():
    source = "Er wurde am 6. Juni 1944 geboren."
    # two numbers lost, one in their place: substitution cannot pair them
    better = Redecoder("He was born on 6 June 1944.")
    assert repair(source, "He was born on June 64.", better) == "He was born on 6 June 1944."
    assert better.calls == [source]
    worse = Redecoder("He was born.")
    assert repair(source, "He was born on June 64.", worse) == "He was born on June 64."
    # the re-decoding is substituted into as well
    close = Redecoder("He was born on 6 June 19444.")
    assert repair(source, "He was born in June.", close) == "He was born on 6 June 1944."


@pytest.mark.parametrize(
    "source,output,redecoded",
    [
        # German copied under the constraints (issue 67, item 3: newstest2014's line 57)
        ("Die staatliche Mineralölsteuer von 18,4 Cent pro Gallone ist seit 20 Jahren nicht "
         "gestiegen.", "State Mineralöl's state protein has not risen to 20 years.",
         "18.4 Cent pro Gallone has not risen to 20 years."),
        # a name the model copied, cut
        ("Der YMCA NSW sei zwischen 2009 und 2011 keine sichere Organisation gewesen.",
         "The YMCA NSW was no safe organisation and 2011.",
         "The YMCA NS 2011 was between 2009 and 2011 no safe organisation."),
        # a number neither the source nor the model wrote (newstest2013's line 2566)
        ("Sie zahlt 662 Rupiah (5 Euro) pro Kilo, seit 1960.",
         "She pays 662 Rupia (5 euros) for each kilo.",
         "1960, she pays 662 Rupia (562 Rupia, 5 euros) for each kilo."),
        # a clause written twice
        ("„Nichts“, sagte Hasan Ikhrata, der ab 2025 plant.",
         '"Nothing," said Hasan Ikhrata, executive director.',
         '"Nothing," said Hasan Ikhrata, executive of 2025, said Hasan Ikhrata, executive.'),
    ],
)  # fmt: skip
def test_a_redecoding_that_is_worse_than_the_model_is_not_taken(source, output, redecoded):
    redecode = Redecoder(redecoded)
    assert missing_numbers(source, output) and not missing_numbers(source, redecoded)
    assert repair(source, output, redecode) == output
    assert redecode.calls == [source]


def test_conversions_are_left_alone():
    redecode = Redecoder("something else with 17 and 10")
    pairs = [("Die Kinder helfen von 11 bis 17 Uhr.", "Children help from 11 to 5 p.m."),
             ("Es sind 10 Meilen.", "It is 16 kilometres.")]
    for source, output in pairs:
        assert repair(source, output, redecode) == output
    assert redecode.calls == []


# ----- the bundled pair ---------------------------------------------------------------------
# Lines whose greedy translation by the bundled pair loses a number (checked below), lines with
# numbers it keeps, and lines without digits.
LOSING = [
    "Er wurde am 6. Juni 1944 geboren.",
    "Die gefangen genommenen Diplomaten wurden schließlich nach 444 Tagen freigelassen.",
    "Dennoch warten in dem Amt immer noch 81.500 Einsprüche auf Erledigung.",
]
LINES = [LOSING[0], "Der Hund schläft im Garten.", LOSING[1], "",
         "Die Quote stieg auf 7,5 Prozent.", LOSING[2], "Wie geht es dir?"]  # fmt: skip
# newstest2014 lines whose repair made them worse (issue 67, item 3): the model writes "11 to 5
# p.m.", and re-decoding the second copies German ("18.4 Cent pro Gallone")
CONVERTED = "Den Kindern stehen regionale Handwerker von 11 bis 17 Uhr helfend zur Seite."
COPIED = ("Die staatliche Mineralölsteuer von 18,4 Cent pro Gallone (weniger als 4 Eurocent pro "
          "Liter) ist seit 20 Jahren nicht gestiegen.")  # fmt: skip


@pytest.fixture(scope="module")
def translator():
    return SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, device="cpu")


def test_the_api_keeps_every_number_and_touches_nothing_else(translator):
    raw = translator.translate(LINES, batch_size=4, keep_numbers=False)
    repaired = translator.translate(LINES, batch_size=4)
    assert len(raw) == len(repaired) == len(LINES)
    assert all(missing_numbers(line, out) for line, out in zip(LINES, raw) if line in LOSING)
    for line, before, after in zip(LINES, raw, repaired):
        assert not missing_numbers(line, after), (line, after)
        if not any(ch.isdigit() for ch in line) or not missing_numbers(line, before):
            assert after == before
    # one at a time as in a batch (the re-decoding runs sentence by sentence)
    assert [translator.translate(line) for line in LINES] == repaired
    # a paragraph: its sentences are repaired one by one
    assert translator.translate(" ".join(LOSING)) == " ".join(repaired[i] for i in (0, 2, 5))


def test_the_bundled_pair_keeps_right_conversions_and_writes_no_german(translator):
    converted, copied = translator.translate([CONVERTED, COPIED])
    raw_converted, raw_copied = translator.translate([CONVERTED, COPIED], keep_numbers=False)
    assert "5 p.m." in raw_converted and converted == raw_converted
    assert "Gallone" not in raw_copied and "Gallone" not in copied


def test_samples_keep_their_numbers_unless_told_not_to(translator):
    samples = translator.sample(LOSING, temperature=0.5, seed=3)
    assert all(not missing_numbers(line, out) for line, out in zip(LOSING, samples))
    raw = translator.sample(LOSING, temperature=0.5, seed=3, keep_numbers=False)
    assert any(missing_numbers(line, out) for line, out in zip(LOSING, raw))


def test_the_cli_repairs_numbers_unless_told_not_to(capsys, tmp_path, translator):
    path = tmp_path / "in.de"
    path.write_text("".join(line + "\n" for line in LINES), encoding="utf-8")
    for flags, keep in (((), True), (("--no-number-repair",), False)):
        translate_cli.main([str(BUNDLED_MODEL_DIR), "--cpu", "--quiet", "--input", str(path),
                            *flags])  # fmt: skip
        out = capsys.readouterr().out.splitlines()
        assert out == translator.translate(LINES, keep_numbers=keep)


def test_the_flag_says_what_it_does_and_what_lossless_means(capsys):
    with pytest.raises(SystemExit):
        translate_cli.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    help_text = text.split("--no-number-repair")[-1].split("--quiet")[0]
    assert "lost one of its source's numbers" in help_text
    assert "Lossless output (the verifier's greedy translation)" in help_text
    assert "before that repair" in help_text


def test_a_cut_line_decoded_again_by_the_repair_is_reported_once(translator, caplog,
                                                                  monkeypatch):  # fmt: skip
    """A line over the models' length whose number fell past the cut is decoded again with it
    as a constraint: its cut is still one warning."""
    monkeypatch.setattr(translator, "max_source_tokens", 12)
    line = "Das Haus ist sehr groß und sehr alt, es wurde im Jahr 1933 gebaut."
    with caplog.at_level("WARNING", logger="spec_nmt"):
        translator.translate(line, split_sentences=False, block_size=0)
    cuts = [r for r in caplog.records if "longer than the models accept" in r.getMessage()]
    assert len(cuts) == 1
