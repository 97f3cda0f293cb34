"""Numbers in a translation: which of the source's numbers the output kept, and their repair.

A number is a run of digits with single ``.``, ``,`` or ``:`` between digit groups ("50",
"4,20", "1.234.567", "20.12.2012", "21:00"), or groups of three digits after a space ("200
000", as German also writes thousands), that does not follow a letter: the digits of a name
or code ("G8", "A380") are no number here. A source number is read the German way and an output
number the English way, and they are the same number when they have the same value:

- German "4,20" (decimal comma) is English "4.20"; German "1.234.567" and "200 000"
  (thousands) are English "1,234,567", "1234567" or "200,000";
- a source number with other separators ("20.12.2012", "21:00", "$4.20" quoted in English
  form) must be copied as it is, and so must one without separators (or written with English
  thousands commas: "8733" is kept by "8,733").

So English "1.500" (one and a half) does not keep German "1.500" (fifteen hundred), and
"$420" does not keep "$4.20". Two conversions a translator makes keep a number too: a
24-hour time written with a.m. or p.m. ("17 Uhr" → "5 p.m.", "von 14 bis 17 Uhr" → "from 2 to 5
p.m.") and a unit converted to its English one ("10 Meilen" → "16 kilometres", "30 Grad" → "86
degrees Fahrenheit"; within 7 %, which rounding to the output's digits stays inside). A source's
numbers are kept when every one of them, counted as often as it occurs, has its own same
number in the output.

The bundled pair copies digits piece by piece and sometimes gets them wrong ("1933" →
"19333") or drops them with the words around them. A sentence whose translation lost a number
is repaired after decoding, in two steps, each only where the one before left a number out:

1. **Substitution.** The source's numbers that the output lacks and the output's numbers that
   keep none of the source's, when there are as many of each, are paired in order and the
   output's are replaced by the source's, written the English way (decimal point, thousands
   commas): "123467890" → "1234567890", "$4.4" → "$4.20", "2030 billion" → "50 billion".
   The rest of the translation is the model's own.
2. **Constrained re-decoding.** The sentence is translated again by the verifier with
   fairseq's lexically constrained beam search, every source number (written the English way)
   a constraint the output must contain; that translation is kept (and substituted into, as in
   1) when it loses fewer numbers and stays faithful to the model's own (``faithful``): it
   writes no source word the model did not write, drops none the model copied, invents no
   number, and repeats no run of words the model did not repeat. Constraints can push the beam
   into copying German ("18.4 Cent pro Gallone"), into cutting a name ("YMCA NSW" → "YMCA NS
   2011") or into writing a clause twice, and a repair must not make a translation worse than
   the one it repairs. It runs one sentence at a time, so the result does not depend on the
   batch.

Lines without digits are never touched, and neither is a translation that kept every number.
"""

import re
from typing import Callable, List, Optional, Tuple

import torch
from fairseq.search import LexicallyConstrainedBeamSearch
from fairseq.sequence_generator import SequenceGenerator
from fairseq.token_generation_constraints import pack_constraints

# never right after a letter (the digits of a name or code: "G8", "A380", "Ariane5"); thousands
# grouped by spaces first (a plain, no-break or narrow no-break space), else digit groups
# joined by single points, commas or colons
NUMBER = re.compile(
    r"(?<![^\W_])(?<![.,:])\d{1,3}(?:[ \u00a0\u202f]\d{3})+(?!\d|[.,:]\d)"
    r"|(?<![^\W_])\d+(?:[.,:]\d+)*"
)
# German thousands points with an optional decimal comma, or a decimal comma alone
GERMAN_GROUPED = re.compile(r"\d{1,3}(?:\.\d{3})+(?:,\d+)?")
GERMAN_DECIMAL = re.compile(r"\d+,\d+")
SPACE_GROUPED = re.compile(r"\d{1,3}(?:[ \u00a0\u202f]\d{3})+")
# English thousands commas with an optional decimal point
ENGLISH_GROUPED = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?")
# a time of day in English after a number, or after the first number of a range ("5 p.m.",
# "5pm", "2 to 5 p.m.", "9-11 a.m.")
TIME_OF_DAY = re.compile(
    r"\s*(?:(?:to|until|till|and|-|–)\s*\d{1,2}(?:[:.]\d\d)?\s*)?([ap])\.?\s?m\b\.?", re.I
)
CLOCK = re.compile(r"(\d{1,2})(?:[:.](\d\d))?")
# the word after a number (its unit), and the one after that ("degrees Fahrenheit")
UNIT = re.compile(r"\s*(°?[^\W\d_]+)\.?(?:\s+([^\W\d_]+))?")
# German units, the English units a translation converts them to, and English per German
CONVERSIONS = [
    ({"km", "Kilometer", "Kilometern", "Kilometers"}, {"miles", "mile", "mi"}, 0.621371),
    ({"Meilen", "Meile"}, {"km", "kilometres", "kilometers", "kilometre", "kilometer"}, 1.609344),
    ({"kg", "Kilo", "Kilogramm"}, {"pounds", "pound", "lb", "lbs"}, 2.204623),
    ({"m", "Meter", "Metern", "Meters"}, {"feet", "foot", "ft"}, 3.280840),
    ({"Fuß"}, {"m", "metres", "meters", "metre", "meter"}, 0.3048),
    ({"cm", "Zentimeter", "Zentimetern"}, {"inches", "inch", "in"}, 0.393701),
    ({"Zoll"}, {"cm", "centimetres", "centimeters"}, 2.54),
    ({"l", "Liter", "Litern"}, {"gallons", "gallon"}, 0.264172),
    ({"Gallonen", "Gallone"}, {"l", "litres", "liters", "litre", "liter"}, 3.785412),
    ({"ha", "Hektar"}, {"acres", "acre"}, 2.471054),
]
CELSIUS, FAHRENHEIT = {"Grad", "°C", "°", "Celsius"}, {"Fahrenheit", "°F", "F"}
CONVERSION_TOLERANCE = 0.07
WORD = re.compile(r"[^\W\d_]+")
# the beam of the constrained re-decoding; fairseq splits it among the sentences' constraints
# met so far, so it grows with their number
MIN_BEAM, MAX_BEAM = 5, 12


def numbers_in(text: str) -> List[str]:
    return NUMBER.findall(text)


def english(number: str) -> str:
    """A German number written the English way: "1.234,5" → "1,234.5", "4,20" → "4.20", "200
    000" → "200,000". Anything else (a year, "20.12.2012", "21:00") stays as it is."""
    if GERMAN_GROUPED.fullmatch(number):
        return number.translate(str.maketrans(".,", ",."))
    if GERMAN_DECIMAL.fullmatch(number):
        return number.replace(",", ".")
    if SPACE_GROUPED.fullmatch(number):
        return re.sub(r"\s", ",", number)
    return number


def _source_value(number: str) -> str:
    """What an output number must equal to keep the German ``number``."""
    return _english_value(english(number)) if english(number) != number else number


def _english_value(number: str) -> str:
    """An English number without its thousands separators ("1,234.5" → "1234.5")."""
    if ENGLISH_GROUPED.fullmatch(number) or SPACE_GROUPED.fullmatch(number):
        return re.sub(r"[,\s]", "", number)
    return number


def _float(number: str) -> Optional[float]:
    try:
        return float(number)
    except ValueError:  # "20.12.2012", "21:00"
        return None


def _same_time(source_number: str, output_number: str, output_after: str) -> bool:
    """Whether ``output_number`` with a.m./p.m. after it is the 24-hour ``source_number``."""
    marker, source, output = TIME_OF_DAY.match(output_after), CLOCK.fullmatch(source_number), \
        CLOCK.fullmatch(output_number)  # fmt: skip
    if not (marker and source and output) or not 1 <= int(output[1]) <= 12:
        return False
    hour = int(output[1]) % 12 + (12 if marker[1].lower() == "p" else 0)
    return hour == int(source[1]) % 24 and (output[2] or "00") == (source[2] or "00")


def _same_converted(source_number: str, source_after: str, output_number: str,
                    output_after: str) -> bool:  # fmt: skip
    """Whether ``output_number`` is ``source_number`` converted from the unit after it to the
    English unit after ``output_number``."""
    source, output = _float(_source_value(source_number)), _float(_english_value(output_number))
    source_unit, output_unit = UNIT.match(source_after), UNIT.match(output_after)
    if source is None or output is None or not (source_unit and output_unit):
        return False
    source_words, output_words = set(source_unit.groups()), set(output_unit.groups())
    if source_words & CELSIUS and output_words & FAHRENHEIT:
        wanted = source * 9 / 5 + 32
    else:
        factors = [factor for german, english_units, factor in CONVERSIONS
                   if source_unit[1] in german and output_unit[1] in english_units]  # fmt: skip
        if not factors:
            return False
        wanted = source * factors[0]
    return abs(output - wanted) <= CONVERSION_TOLERANCE * abs(wanted)


def _same(source: Tuple[str, str], output: Tuple[str, str]) -> bool:
    """Whether the output's (number, text after it) keeps the source's."""
    (source_number, source_after), (output_number, output_after) = source, output
    wanted = _source_value(source_number)
    return wanted in (output_number, _english_value(output_number)) \
        or _same_time(source_number, output_number, output_after) \
        or _same_converted(source_number, source_after, output_number, output_after)  # fmt: skip


def _numbers_in_context(text: str) -> List[Tuple[str, str]]:
    """Each number of ``text`` with the text after it (where its unit or a.m./p.m. stands)."""
    return [(m[0], text[m.end() : m.end() + 40]) for m in NUMBER.finditer(text)]


def _pairs(source: str, output: str) -> Tuple[List[int], List[int]]:
    """The source's numbers (indices) that no output number keeps, and the output's numbers
    (indices) that keep none of the source's: each source number, in order, claims the first
    unclaimed output number that is the same number."""
    source_numbers, output_numbers = _numbers_in_context(source), _numbers_in_context(output)
    unclaimed = list(range(len(output_numbers)))
    lost = []
    for i, number in enumerate(source_numbers):
        match = next((j for j in unclaimed if _same(number, output_numbers[j])), None)
        if match is None:
            lost.append(i)
        else:
            unclaimed.remove(match)
    return lost, unclaimed


def missing_numbers(source: str, output: str) -> List[str]:
    """The source's numbers that the output lacks, in source order (none: every one is kept)."""
    source_numbers = numbers_in(source)
    return [source_numbers[i] for i in _pairs(source, output)[0]]


def substitute(source: str, output: str) -> str:
    """``output`` with its numbers that keep none of the source's replaced, in order, by the
    source's numbers that it lacks (English form), when there are as many of each; else
    ``output`` unchanged."""
    lost, unclaimed = _pairs(source, output)
    if not lost or len(lost) != len(unclaimed):
        return output
    source_numbers, spans = numbers_in(source), [m.span() for m in NUMBER.finditer(output)]
    for i, j in reversed(list(zip(lost, unclaimed))):
        start, end = spans[j]
        output = output[:start] + english(source_numbers[i]) + output[end:]
    return output


def _repeated_runs(text: str, length: int = 3) -> set:
    words = WORD.findall(text)
    runs = [tuple(words[i : i + length]) for i in range(len(words) - length + 1)]
    return {run for run in runs if runs.count(run) > 1}


def faithful(source: str, output: str, again: str) -> bool:
    """Whether the re-decoding ``again`` may stand in for the model's ``output`` of ``source``:
    it writes no word of the source that ``output`` does not (German copied under the
    constraints), keeps every word ``output`` copied from the source (names, codes), writes no
    number that neither the source nor ``output`` has, and repeats no run of three words that
    ``output`` does not repeat (a clause written twice)."""
    source_words, output_words, again_words = (set(WORD.findall(text))
                                               for text in (source, output, again))  # fmt: skip
    invented = {numbers_in(again)[j] for j in _pairs(source, again)[1]} - set(numbers_in(output))
    return not (again_words & source_words) - output_words \
        and not (output_words & source_words) - again_words \
        and not invented and _repeated_runs(again) <= _repeated_runs(output)  # fmt: skip


def repair(source: str, output: str,
           redecode: Optional[Callable[[str], str]] = None) -> str:  # fmt: skip
    """The translation ``output`` of the sentence ``source`` with the numbers it lost put back
    (substitution, then ``redecode(source)`` if given, still needed and ``faithful``);
    ``output`` itself when nothing was lost or nothing repairs more."""
    if not missing_numbers(source, output):
        return output
    best = substitute(source, output)
    lost = len(missing_numbers(source, best))
    if lost and redecode is not None:
        again = substitute(source, redecode(source))
        if len(missing_numbers(source, again)) < lost and faithful(source, output, again):
            best = again
    return best


def constraints(source: str) -> List[str]:
    """What a re-decoding of ``source`` must contain: each of its numbers, the English way."""
    return [english(number) for number in numbers_in(source)]


class ConstrainedRedecoder:
    """Translates one sentence with the verifier's lexically constrained beam search, its
    numbers as constraints: ``redecode(source) -> text``. ``encode_source`` gives the source's
    token ids, ``encode_target`` a constraint's, ``decode`` turns target ids into text and
    ``batches`` is the translator's (line indices, fairseq sample) maker."""

    def __init__(self, verifier, tgt_dict, settings, encode_source, encode_target, decode,
                 batches):  # fmt: skip
        self.verifier, self.tgt_dict, self.settings = verifier, tgt_dict, settings
        self.encode_source, self.encode_target = encode_source, encode_target
        self.decode, self.batches = decode, batches

    def generator(self, beam: int) -> SequenceGenerator:
        s = self.settings
        return SequenceGenerator(
            [self.verifier], self.tgt_dict, beam_size=beam, max_len_a=s.max_len_a,
            max_len_b=s.max_len_b, min_len=s.min_len, len_penalty=s.lenpen,
            unk_penalty=s.unkpen, normalize_scores=not s.unnormalized,
            search_strategy=LexicallyConstrainedBeamSearch(self.tgt_dict, "unordered"),
        )  # fmt: skip

    def __call__(self, source: str) -> str:
        wanted = [self.encode_target(text) for text in constraints(source)]
        wanted = [ids for ids in wanted if ids.numel() and (ids != self.tgt_dict.unk()).all()]
        if not wanted:
            return ""
        beam = min(max(MIN_BEAM, len(wanted) + 1), MAX_BEAM)
        (_, sample), = self.batches(self.encode_source([source]), 1)
        packed = pack_constraints([wanted]).to(sample["net_input"]["src_tokens"].device)
        with torch.inference_mode():
            hypos = self.generator(beam).generate([self.verifier], sample, constraints=packed)
        return self.decode(hypos[0][0]["tokens"].cpu())

