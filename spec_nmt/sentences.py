"""Paragraphs in, sentences to the models, paragraphs out.

The models are trained on single sentences, so a line holding several is split before it is
translated and the translations are joined again with one space: one output line per input line.
The splitter is Koehn and Schroeder's rule-based one (the Moses splitter, package
``sentence-splitter``) with its German non-breaking prefixes. It does not know German quotation
marks („…“, »…«), so it is shown straight quotes in their place. On rejoined newstest lines it
found more sentence boundaries than pysbd and sentencex and made the fewest wrong cuts (after
ordinals such as "am 6. Juni", before closing quotes); scripts/compare_sentence_splitters.py
measures it.
"""

import functools
from typing import List

from sentence_splitter import SentenceSplitter, SentenceSplitterException


@functools.lru_cache(maxsize=None)
def _splitter(language: str) -> SentenceSplitter:
    try:
        return SentenceSplitter(language=language)
    except SentenceSplitterException:
        # No non-breaking prefixes for this language: English ones, the rules split at . ! ?
        return SentenceSplitter(language="en")


_AS_STRAIGHT_QUOTES = str.maketrans("„“”»«‚‘’›‹", '"""""' + "'''''")


def split_sentences(line: str, language: str) -> List[str]:
    """The sentences of ``line``, stripped and otherwise unchanged; none for a blank line."""
    sentences, position = [], 0
    # The splitter also collapses runs of spaces, so each sentence is found again in ``line`` by
    # its non-space characters, which it leaves as they are.
    for piece in _splitter(language).split(line.translate(_AS_STRAIGHT_QUOTES)):
        remaining = sum(not ch.isspace() for ch in piece)
        if not remaining:
            continue
        while line[position].isspace():
            position += 1
        start = position
        while remaining:
            remaining -= not line[position].isspace()
            position += 1
        sentences.append(line[start:position])
    return sentences


def join_sentences(translations: List[str]) -> str:
    return " ".join(t for t in translations if t)
