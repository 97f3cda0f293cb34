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
"$420" does not keep "$4.20". A source's numbers are kept when every one of them, counted as
often as it occurs, has its own same number in the output.

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
   1) when it loses fewer numbers. It runs one sentence at a time, so the result does not
   depend on the batch.

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


def _same(source_number: str, output_number: str) -> bool:
    wanted = _source_value(source_number)
    return wanted in (output_number, _english_value(output_number))


def _pairs(source: str, output: str) -> Tuple[List[int], List[int]]:
    """The source's numbers (indices) that no output number keeps, and the output's numbers
    (indices) that keep none of the source's: each source number, in order, claims the first
    unclaimed output number that is the same number."""
    source_numbers, output_numbers = numbers_in(source), numbers_in(output)
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


def repair(source: str, output: str,
           redecode: Optional[Callable[[str], str]] = None) -> str:  # fmt: skip
    """The translation ``output`` of the sentence ``source`` with the numbers it lost put back
    (substitution, then ``redecode(source)`` if given and still needed); ``output`` itself when
    nothing was lost or nothing repairs more."""
    if not missing_numbers(source, output):
        return output
    best = substitute(source, output)
    lost = len(missing_numbers(source, best))
    if lost and redecode is not None:
        again = substitute(source, redecode(source))
        if len(missing_numbers(source, again)) < lost:
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

