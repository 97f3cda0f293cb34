"""Text in and out: lines cleaned, paragraphs split into sentences for the models and joined
again, lines cut to the length the models take (and those longer than they were trained on
named), and stdin read so that N lines in give N lines out.

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
import io
import logging
import sys
import unicodedata
from typing import List, Optional

import torch
from sentence_splitter import SentenceSplitter, SentenceSplitterException

logger = logging.getLogger(__name__)

# sentencepiece's word-start mark
WORD_START = "\u2581"


def clean_line(line: str) -> str:
    """One line of text: line breaks inside it would split it and control characters mean
    nothing (both become spaces); invisible format characters such as soft hyphens and
    zero-width spaces are dropped, since a space would split the word they sit in."""
    return "".join(
        "" if unicodedata.category(ch) == "Cf" else ch if ch.isprintable() else " " for ch in line
    ).strip()


def join_pieces(pieces: str) -> str:
    """Space-separated sentencepiece pieces as text, as fairseq's --bpe sentencepiece joins them."""
    return pieces.replace(" ", "").replace(WORD_START, " ").strip()


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


def cut_to_limit(line_tokens: torch.Tensor, limit: int, warn: bool = True) -> torch.Tensor:
    """A source line's token ids (EOS last) as the models can take them: a line of more than
    ``limit`` keeps its first ``limit - 1`` tokens and its EOS, with a warning unless not
    ``warn`` (a line encoded again, whose cut was reported the first time)."""
    if line_tokens.numel() <= limit:
        return line_tokens
    if warn:
        logger.warning(
            "input line of %d tokens is longer than the models accept; translating its first "
            "%d tokens", line_tokens.numel() - 1, limit - 1,
        )  # fmt: skip
    return torch.cat([line_tokens[: limit - 1], line_tokens[-1:]])


def warn_of_long_sentences(sources: List[torch.Tensor], trained: int) -> None:
    """One warning for the sentences (token ids, EOS last) of more than ``trained`` pieces: the
    models never saw so long a sentence, and their translation tends to loop ("the Airports,
    the Airports, ...")."""
    lengths = [ids.numel() - 1 for ids in sources if ids.numel() - 1 > trained]
    if lengths:
        logger.warning(
            "%d sentence(s) longer than the %d pieces the models were trained on (the longest: "
            "%d): so long a translation may repeat itself; split such lines into sentences",
            len(lengths), trained, max(lengths),
        )  # fmt: skip


def tolerant_stdin(encoding: Optional[str] = None, errors: str = "replace") -> None:
    """fairseq-interactive reads stdin with Python's defaults, so an invalid UTF-8 byte kills it
    and a lone carriage return splits a line in two. Before anything is read, make bad bytes
    U+FFFD (or what the codec error handler ``errors`` makes them) and only newlines end lines,
    so N input lines always give N outputs (and read ``encoding`` when given)."""
    if isinstance(sys.stdin, io.TextIOWrapper):
        try:
            sys.stdin.reconfigure(errors=errors, newline="\n",
                                  **({"encoding": encoding} if encoding else {}))  # fmt: skip
        except (OSError, ValueError):  # already read from (e.g. the API in a REPL): leave it
            pass
