#!/usr/bin/env python3
"""The drafter's on-policy training data from the verifier's own translations: raw sources and
the verifier's greedy output of them (line for line, e.g. `spec-nmt-translate --block-size 0
--no-split-sentences --no-number-repair`, or scripts/gpu_check.sh's distill step), encoded with
the model directory's sentencepiece model and binarized with its dictionary, plus a validation
split of real references.

    python scripts/drafter_data.py MODEL_DIR SOURCES.de TRANSLATIONS.en VALID_PREFIX OUT_BIN

VALID_PREFIX names VALID_PREFIX.de and VALID_PREFIX.en (e.g. newstest2013). TRANSLATIONS may be
shorter than SOURCES (a distillation cut short): the pairs it has are used. OUT_BIN receives
dict.{de,en}.txt, train.* and valid.*, what scripts/train_drafter.sh reads.
"""

import argparse
import logging
import sys
import tempfile
from pathlib import Path

import spec_nmt.plugin  # noqa: F401  isort: skip  (first: fairseq quiet, the plugin registered)
import sentencepiece

from spec_nmt.data_prep import (
    MAX_PIECES,
    MAX_RATIO,
    encode_file,
    filter_pair_lengths,
    run_fairseq_preprocess,
)
from spec_nmt.errors import SpecNmtError

logger = logging.getLogger("drafter_data")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path, help="spm.model and dict.{de,en}.txt")
    parser.add_argument("sources", type=Path, help="raw source lines")
    parser.add_argument("translations", type=Path, help="the verifier's translations of them")
    parser.add_argument("valid_prefix", help="VALID_PREFIX.de and .en: real references")
    parser.add_argument("out_bin", type=Path, help="the data-bin to write (must not exist)")
    args = parser.parse_args()
    logging.basicConfig(format="%(name)s: %(message)s", level=logging.INFO)
    try:
        make(args)
    except SpecNmtError as error:
        sys.exit(f"drafter_data.py: {error}")


def make(args) -> None:
    needed = [args.model_dir / name for name in ("spm.model", "dict.de.txt")]
    needed += [args.sources, args.translations, Path(f"{args.valid_prefix}.de"),
               Path(f"{args.valid_prefix}.en")]  # fmt: skip
    for path in needed:
        if not path.is_file():
            raise SpecNmtError(f"{path} is missing")
    if args.out_bin.exists():
        raise SpecNmtError(f"{args.out_bin} exists: choose a new directory")
    spm = sentencepiece.SentencePieceProcessor(model_file=str(args.model_dir / "spm.model"))
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw"
        raw.mkdir()
        translations = args.translations.read_text(encoding="utf-8").splitlines()
        sources = args.sources.read_text(encoding="utf-8").splitlines()[: len(translations)]
        logger.info("%d pairs of %s and %s", len(sources), args.sources, args.translations)
        (raw / "train.de").write_text("".join(line + "\n" for line in sources), encoding="utf-8")
        (raw / "train.en").write_text("".join(line + "\n" for line in translations),
                                      encoding="utf-8")  # fmt: skip
        encoded = Path(tmp) / "spm"
        encoded.mkdir()
        for split, prefix in (("train", raw / "train"), ("valid", Path(args.valid_prefix))):
            for side in ("de", "en"):
                encode_file(spm, f"{prefix}.{side}", encoded / f"{split}.{side}")
        if not filter_pair_lengths(encoded / "train.de", encoded / "train.en", MAX_PIECES,
                                   MAX_RATIO):  # fmt: skip
            raise SpecNmtError(f"no pair of {args.sources} and {args.translations} is left "
                               f"after the length filter (at most {MAX_PIECES} pieces, ratio "
                               f"{MAX_RATIO}): are they each other's translations?")
        run_fairseq_preprocess("de", "en", args.out_bin, trainpref=encoded / "train",
                               validpref=encoded / "valid",
                               srcdict=args.model_dir / "dict.de.txt")  # fmt: skip


if __name__ == "__main__":
    main()
