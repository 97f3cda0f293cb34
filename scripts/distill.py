#!/usr/bin/env python3
"""Sequence-level distillation (Kim & Rush, 2016), as SpecDec trains its drafter: translate the
training set with the verifier and binarize (source, verifier output) pairs with the original
dictionary, so the drafter learns to predict what the verifier will accept.

    python scripts/distill.py DATA_BIN VERIFIER.pt OUT_DIR [--beam 5] [--max-tokens 8000]
        [--num-shards N --shard-id I] [-- extra fairseq-generate flags]

OUT_DIR becomes a data-bin: train = distilled pairs, valid/test = copies of DATA_BIN's (real
references), dict.*.txt = DATA_BIN's. Train the drafter on it with --task spec_translation.
--num-shards/--shard-id translate every N-th batch only (a subset on small machines, or one
shard per GPU; merge by running the script per shard into separate directories).
"""

import argparse
import logging
import shutil
import tempfile
from pathlib import Path

from spec_nmt.data_prep import filter_pair_lengths, run_fairseq_preprocess, translate_subset
from spec_nmt.errors import SpecNmtError

logger = logging.getLogger("distill")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data_bin", type=Path, help="fairseq data-bin the verifier was trained on")
    parser.add_argument("verifier", type=Path, help="verifier checkpoint")
    parser.add_argument("out_dir", type=Path, help="output data-bin for the drafter")
    parser.add_argument("--source-lang", default="de")
    parser.add_argument("--target-lang", default="en")
    parser.add_argument("--beam", type=int, default=5, help="beam size of the verifier's translations")
    parser.add_argument("--max-tokens", type=int, default=8000, help="source tokens per batch")
    parser.add_argument("--num-shards", type=int, default=1, help="translate every N-th batch ...")
    parser.add_argument("--shard-id", type=int, default=0, help="... starting with this one")
    parser.add_argument("--max-len", type=int, default=250, help="drop longer pairs (pieces)")
    parser.add_argument("--max-ratio", type=float, default=3.0,
                        help="drop pairs with a longer source/output length ratio (hallucinations)")
    parser.add_argument("--cpu", action="store_true", help="translate on CPU")
    args, extra = parser.parse_known_args()
    if extra[:1] == ["--"]:
        extra = extra[1:]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s | %(levelname)s | %(name)s | %(message)s")
    src, tgt = args.source_lang, args.target_lang
    for name in (f"dict.{src}.txt", f"dict.{tgt}.txt", f"train.{src}-{tgt}.{src}.bin"):
        if not (args.data_bin / name).is_file():
            raise SpecNmtError(f"{args.data_bin / name} is missing: DATA_BIN must be a fairseq-preprocess output")
    if not args.verifier.is_file():
        raise SpecNmtError(f"verifier checkpoint {args.verifier} does not exist")

    pairs = translate_subset(
        args.data_bin, args.verifier, "train", args.beam, args.max_tokens,
        languages=(src, tgt), cpu=args.cpu, shard=(args.shard_id, args.num_shards), extra=extra,
    )  # fmt: skip
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "train"
        with open(f"{prefix}.{src}", "w", encoding="utf-8") as fs, \
                open(f"{prefix}.{tgt}", "w", encoding="utf-8") as ft:
            for source, hypothesis in pairs.values():
                fs.write(source + "\n")
                ft.write(hypothesis + "\n")
        kept = filter_pair_lengths(f"{prefix}.{src}", f"{prefix}.{tgt}", args.max_len, args.max_ratio)
        run_fairseq_preprocess(src, tgt, args.out_dir, trainpref=prefix,
                               srcdict=args.data_bin / f"dict.{src}.txt")
    # Validation and test keep the real references: the drafter is judged on real data.
    for path in args.data_bin.iterdir():
        if path.name.startswith(("valid.", "test.")):
            shutil.copy(path, args.out_dir / path.name)
    logger.info("distilled %d of %d translated pairs into %s", kept, len(pairs), args.out_dir)


if __name__ == "__main__":
    main()
