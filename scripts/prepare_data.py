#!/usr/bin/env python3
"""Prepare a directory of raw parallel text for fairseq.

    python scripts/prepare_data.py RAW_DIR OUT_DIR [--vocab-size 8000]

RAW_DIR holds {train,valid,test}.{de,en} (raw, cased, one sentence per line), e.g.
../shared/data/bench-de-en or the output of scripts/prepare_wmt14.py. OUT_DIR receives
spm.model (joint sentencepiece), spm/ (encoded text) and bin/ (fairseq-preprocess output with a
joined dictionary, ready for fairseq-train).
"""

import argparse
import logging

from spec_nmt.data_prep import MAX_PIECES, MAX_RATIO, VOCAB_SIZE, prepare


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("raw_dir", help="directory with {train,valid,test}.{SRC,TGT}")
    parser.add_argument("out_dir", help="output directory (spm.model, spm/, bin/)")
    parser.add_argument("--source-lang", default="de", help="source language suffix")
    parser.add_argument("--target-lang", default="en", help="target language suffix")
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE,
                        help="joint sentencepiece vocabulary size")
    parser.add_argument("--max-len", type=int, default=MAX_PIECES,
                        help="drop training pairs longer than this (pieces)")
    parser.add_argument("--max-ratio", type=float, default=MAX_RATIO,
                        help="drop training pairs with a longer length ratio")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s | %(levelname)s | %(name)s | %(message)s")
    prepare(args.raw_dir, args.out_dir, args.source_lang, args.target_lang, args.vocab_size,
            args.max_len, args.max_ratio)


if __name__ == "__main__":
    main()
