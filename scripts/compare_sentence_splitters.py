#!/usr/bin/env python3
"""Measure sentence splitters on German news: how spec_nmt's splitter was chosen.

    pip install pysbd sentencex      # the candidates that spec-nmt does not install
    python scripts/compare_sentence_splitters.py ../shared/data/bench-de-en/valid.de [more.de ...]

Consecutive lines are joined in groups of three, as if they were one paragraph, and split again.
A group is right when every joint between its lines is a cut. Lines with several sentences do
occur in news, so extra cuts are counted but are not all wrong. Two kinds are counted apart: a
piece of punctuation only (a closing quote cut off: always wrong) and a cut after digits and a
full stop (wrong after German ordinals, "am 6. Juni"; right after a year that ends a sentence).
"""

import argparse
import re

from spec_nmt.text import split_sentences

GROUP = 3


def candidates():
    import pysbd
    import sentencex
    from sentence_splitter import SentenceSplitter

    moses = SentenceSplitter(language="de")
    segmenter = pysbd.Segmenter(language="de", clean=False)
    return {
        "spec_nmt (sentence-splitter, German quotes as straight ones)": lambda text: (
            split_sentences(text, "de")
        ),
        "sentence-splitter 1.4": moses.split,
        "pysbd 0.3.4": segmenter.segment,
        "sentencex": lambda text: list(sentencex.segment("de", text)),
    }


def cut_positions(text, pieces):
    """Character offsets in ``text`` where one piece ends and the next begins (by non-space
    characters, which every candidate keeps)."""
    cuts, seen = set(), 0
    nonspace_offsets = [i for i, ch in enumerate(text) if not ch.isspace()]
    for piece in pieces[:-1]:
        seen += sum(not ch.isspace() for ch in piece)
        if 0 < seen < len(nonspace_offsets):
            cuts.add(nonspace_offsets[seen - 1] + 1)
    return cuts


def wrong_cut_kinds(pieces):
    kinds = {"punctuation only": 0, "after a number.": 0}
    pieces = [p.strip() for p in pieces if p.strip()]
    for before, after in zip(pieces, pieces[1:]):
        if not re.search(r"\w", before) or not re.search(r"\w", after):
            kinds["punctuation only"] += 1
        elif re.search(r"\d\.$", before):
            kinds["after a number."] += 1
    return kinds


def measure(split, lines):
    right = joints = found = extra = 0
    wrong = {}
    for start in range(0, len(lines) - GROUP + 1, GROUP):
        group = lines[start : start + GROUP]
        text = " ".join(group)
        pieces = [p for p in split(text) if p.strip()]
        cuts = cut_positions(text, pieces)
        boundaries, offset = set(), 0
        for line in group[:-1]:
            offset += len(line)
            boundaries.add(offset)
            offset += 1
        right += boundaries <= cuts
        joints += len(boundaries)
        found += len(boundaries & cuts)
        extra += len(cuts - boundaries)
        for kind, count in wrong_cut_kinds(pieces).items():
            wrong[kind] = wrong.get(kind, 0) + count
    return {
        "groups": len(lines) // GROUP,
        "right": right,
        "joints": joints,
        "found": found,
        "extra": extra,
        **wrong,
    }


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("files", nargs="+", help="German text, one sentence or paragraph per line")
    args = parser.parse_args()
    splitters = candidates()
    print("| file | splitter | groups right | joints found | extra cuts | punctuation only | after digits. |")
    print("|---|---|---|---|---|---|---|")
    for path in args.files:
        lines = [line.strip() for line in open(path, encoding="utf-8") if line.strip()]
        for name, split in splitters.items():
            m = measure(split, lines)
            share = f"{m['right']}/{m['groups']} ({100 * m['right'] / m['groups']:.1f}%)"
            print(f"| {path.split('/')[-1]} | {name} | {share} | {m['found']}/{m['joints']} "
                  f"| {m['extra']} | {m['punctuation only']} | {m['after a number.']} |")  # fmt: skip


if __name__ == "__main__":
    main()
