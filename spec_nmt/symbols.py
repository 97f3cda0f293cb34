"""Characters the vocabulary lacks (emoji, symbols, letters of other scripts): kept out of what
the model reads and put back into its translation at their place.

The model reads such a character as ``<unk>`` and writes a word of its own for it ("Wir fahren
nach Москва" → "We'll go to accommodated", a lone "🍕" → "Surprising"), and it can never write
the character itself. So each run of them (with the spaces between them: "🍕 😀") is cut out of
the sentence before it is encoded, and put back into the translation:

- after the output word that is the source word before it, when exactly one output word is
  ("Pizza 🍕" → "pizza 🍕");
- else at the same share of the words ("nach Москва und" → "to Москва and");
- before the final punctuation when only punctuation followed it in the source ("Kaffee ☕."
  → "coffee ☕."), at the very end when nothing did, at the start when it opened the sentence;
- glued to the word before it when it was glued in the source ("Pizza🍕").

A sentence of nothing but such characters, spaces and punctuation is copied, not translated.
Lossless decoding is the verifier's greedy translation of the sentence it reads, without them.
"""

import dataclasses
import re
import unicodedata
from dataclasses import dataclass
from typing import Callable, Dict, List, Set, Tuple

from spec_nmt.text import WORD_START

WORD = re.compile(r"\w+")
# trailing punctuation of an output: closing marks and sentence ends
TRAILING_PUNCTUATION = re.compile(r"(.*?)([.!?…:;,\"'»«“”„)\]]*)", re.S)
# the punctuation around an output word, stripped before it is compared with a source word
OUTPUT_MARKS = ".,;:!?\"'»«“”„()"
# where a run stood between a word and punctuation ("Kaffee ☕." read as "Kaffee.")
SPACE_BEFORE_PUNCTUATION = re.compile(r" ([.,;:!?…)])")


@dataclass(frozen=True)
class Run:
    """A run of characters the model cannot read, and where it stood in its sentence."""

    text: str
    share: float  # the share of the readable sentence's words that stand before it
    anchor: str  # the word right before it ("" at the start)
    glued: bool  # no space between it and the word before
    tail: str  # "end": nothing after it, "punctuation": only punctuation, else "words"


def _is_punctuation_or_space(text: str) -> bool:
    return all(ch.isspace() or unicodedata.category(ch)[0] in "PS" for ch in text)


def nothing_to_translate(readable: str, runs: List[Run]) -> bool:
    """Whether a sentence split into ``readable`` and ``runs`` is runs alone (and spaces and
    punctuation): it is copied."""
    return bool(runs) and _is_punctuation_or_space(readable)


class ForeignCharacters:
    """Which characters a model cannot read: those that no piece of its source dictionary
    (``readable``: their characters) holds, as its sentencepiece model normalizes them
    (``normalize``: "ﬁ" is "fi"). Encoding a character alone is no test: a word-start piece such
    as "▁9" can be missing where "9" inside a word is not. A word with one of them goes whole
    ("Привет" where "р" and "т" are readable). And a sentence's runs of them taken out and put
    back."""

    def __init__(self, readable: Set[str], normalize: Callable[[str], str] = str):
        self.readable, self.normalize = readable, normalize
        self._foreign: Dict[str, bool] = {}

    def foreign(self, ch: str) -> bool:
        if ch.isspace():
            return False
        if ch not in self._foreign:
            normalized = self.normalize(ch).replace(WORD_START, "")
            self._foreign[ch] = any(c not in self.readable for c in normalized)
        return self._foreign[ch]

    def _marks(self, sentence: str) -> List[bool]:
        """Per character of ``sentence``, whether it goes: foreign, or in a word with one."""
        marks = [self.foreign(ch) for ch in sentence]
        for word in WORD.finditer(sentence):
            if any(marks[word.start() : word.end()]):
                marks[word.start() : word.end()] = [True] * (word.end() - word.start())
        return marks

    @staticmethod
    def _spans(sentence: str, marks: List[bool]) -> List[Tuple[int, int]]:
        """(start, end) of each run: marked characters, and the spaces between them."""
        spans, start = [], None
        for i, ch in enumerate(sentence):
            if marks[i]:
                if start is None:
                    start = i
                end = i + 1
            elif not ch.isspace() and start is not None:
                spans.append((start, end))
                start = None
        if start is not None:
            spans.append((start, end))
        return spans

    def split(self, sentence: str) -> Tuple[str, List[Run]]:
        """``sentence`` without its runs (spaces collapsed, none left before punctuation) and
        the runs."""
        readable, runs, position = "", [], 0
        marks = self._marks(sentence)
        for start, end in self._spans(sentence, marks):
            readable += sentence[position:start]
            rest = "".join(ch for ch, mark in zip(sentence[end:], marks[end:]) if not mark)
            tail = "end" if not sentence[end:].strip() else \
                "punctuation" if _is_punctuation_or_space(rest) else "words"  # fmt: skip
            words = WORD.findall(readable)
            runs.append(Run(sentence[start:end], len(words), words[-1] if words else "",
                            start > 0 and not sentence[start - 1].isspace(), tail))  # fmt: skip
            position = end
        readable += sentence[position:]
        total = max(len(WORD.findall(readable)), 1)
        runs = [dataclasses.replace(run, share=run.share / total) for run in runs]
        if runs:
            readable = SPACE_BEFORE_PUNCTUATION.sub(r"\1", re.sub(r"\s+", " ", readable))
        return readable.strip(), runs

    @staticmethod
    def restore(translation: str, runs: List[Run]) -> str:
        """``translation`` with ``runs`` put back at their place (the module's docstring)."""
        words = translation.split()
        placed = []  # (position among words, order, run) of the runs inserted as words
        for order, run in enumerate(runs):
            if run.tail == "punctuation" and words:
                continue  # joins the last word, below
            if run.tail != "words":
                position = len(words)
            elif not run.share:
                position = 0
            else:
                anchor = run.anchor.casefold()
                same = [i for i, word in enumerate(words)
                        if word.strip(OUTPUT_MARKS).casefold() == anchor]  # fmt: skip
                share = min(max(round(run.share * len(words)), 1), len(words))
                position = same[0] + 1 if len(same) == 1 else share
            placed.append((position, order, run))
        if words:  # before the final punctuation first: the runs after it go after that
            for run in runs:
                if run.tail == "punctuation":
                    body, marks = TRAILING_PUNCTUATION.fullmatch(words[-1]).groups()
                    words[-1] = (body + run.text if run.glued else f"{body} {run.text}") + marks
        for position, _, run in sorted(placed, reverse=True):  # (orders differ: runs unsorted)
            if run.glued and position:
                words[position - 1] += run.text
            else:
                words.insert(position, run.text)
        return " ".join(words)
