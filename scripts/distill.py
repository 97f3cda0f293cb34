#!/usr/bin/env python3
"""Sequence-level distillation (Kim & Rush, 2016), as SpecDec trains its drafter: translate the
training set with the verifier and binarize (source, verifier output) pairs with the original
dictionary, so the drafter learns to predict what the verifier will accept.

    python scripts/distill.py DATA_BIN VERIFIER.pt OUT_DIR [--beam 5] [--max-tokens 8000]
        [--num-shards N [--shard-id I]] [-- extra fairseq-generate flags]

OUT_DIR becomes a data-bin: train = distilled pairs, valid/test = copies of DATA_BIN's (real
references), dict.*.txt = DATA_BIN's. Train the drafter on it with --task spec_translation.

The training batches are split into --num-shards shards (shard I = every N-th batch from batch
I); each translated shard is kept in OUT_DIR/shards/ as soon as it is done, and the data-bin is
made from every shard there. Without --shard-id the script translates the shards not there yet,
so a stopped run goes on where it stopped when started again (a long distillation on a CPU:
--num-shards 10). With --shard-id only that shard is translated: a subset on a small machine, or
one shard per GPU or machine, with the shard files copied into one OUT_DIR/shards/ at the end.
"""

import argparse
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from spec_nmt.data_prep import (
    MAX_PIECES,
    filter_pair_lengths,
    run_fairseq_preprocess,
    translate_subset,
)
from spec_nmt.errors import SpecNmtError
from spec_nmt.files import written_whole

logger = logging.getLogger("distill")


def check_same_settings(path: Path, settings) -> None:
    """Shards made with another verifier, beam or batching must not be mixed: the first run
    writes its settings, later runs must match them."""
    if not path.is_file():
        with written_whole(path) as partial:
            partial.write_text(json.dumps(settings, indent=1) + "\n")
        return
    try:
        recorded = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise SpecNmtError(f"{path} is not JSON ({error}): remove it and run again") from error
    changed = sorted(key for key in settings if recorded.get(key) != settings[key])
    if changed:
        raise SpecNmtError(
            f"{path.parent} holds translations made with other settings ({', '.join(changed)} "
            "differ): remove that directory or choose another OUT_DIR"
        )


def shard_path(shard_dir: Path, shard: int, num_shards: int) -> Path:
    return shard_dir / f"shard-{shard}-of-{num_shards}.tsv"


def read_shards(shard_dir: Path, num_shards: int):
    """({sentence id: (source, hypothesis)} from every translated shard in id order, the ids of
    the shards not translated)."""
    pairs, missing = {}, []
    for shard in range(num_shards):
        path = shard_path(shard_dir, shard, num_shards)
        if not path.is_file():
            missing.append(shard)
            continue
        with open(path, encoding="utf-8") as lines:
            for line in lines:
                sentence_id, source, hypothesis = line.rstrip("\n").split("\t")
                pairs[int(sentence_id)] = (source, hypothesis)
    return dict(sorted(pairs.items())), missing


def write_data_bin(args, shard_dir: Path) -> None:
    """OUT_DIR's data-bin from every translated shard: train = (source, translation) pairs
    within the length limits, valid and test = DATA_BIN's (real references)."""
    src, tgt = args.source_lang, args.target_lang
    pairs, missing = read_shards(shard_dir, args.num_shards)
    if missing:
        logger.warning("shards %s of %d are not translated: the data-bin is a subset",
                       ", ".join(map(str, missing)), args.num_shards)  # fmt: skip
    with tempfile.TemporaryDirectory(dir=args.out_dir) as tmp:  # same file system: os.replace
        prefix = Path(tmp) / "train"
        with open(f"{prefix}.{src}", "w", encoding="utf-8") as fs, \
                open(f"{prefix}.{tgt}", "w", encoding="utf-8") as ft:
            for source, hypothesis in pairs.values():
                fs.write(source + "\n")
                ft.write(hypothesis + "\n")
        kept = filter_pair_lengths(f"{prefix}.{src}", f"{prefix}.{tgt}", args.max_len, args.max_ratio)
        # binarized aside, then moved in: fairseq-preprocess refuses a directory with a dictionary
        run_fairseq_preprocess(src, tgt, Path(tmp) / "bin", trainpref=prefix,
                               srcdict=args.data_bin / f"dict.{src}.txt")
        for path in (Path(tmp) / "bin").iterdir():
            os.replace(path, args.out_dir / path.name)
    # Validation and test keep the real references: the drafter is judged on real data.
    for path in args.data_bin.iterdir():
        if path.name.startswith(("valid.", "test.")):
            shutil.copy(path, args.out_dir / path.name)
    logger.info("distilled %d of %d translated pairs into %s", kept, len(pairs), args.out_dir)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data_bin", type=Path, help="fairseq data-bin the verifier was trained on")
    parser.add_argument("verifier", type=Path, help="verifier checkpoint")
    parser.add_argument("out_dir", type=Path, help="output data-bin for the drafter")
    parser.add_argument("--source-lang", default="de")
    parser.add_argument("--target-lang", default="en")
    parser.add_argument("--beam", type=int, default=5,
                        help="beam size of the verifier's translations (default: %(default)s, as "
                        "SpecDec distils and scripts/campaign.sh runs it; 1: greedy, the exact "
                        "target of the lossless rule, at a fifth of the cost)")
    parser.add_argument("--max-tokens", type=int, default=8000, help="source tokens per batch")
    parser.add_argument("--num-shards", type=int, default=1, help="split the batches into N shards")
    parser.add_argument("--shard-id", type=int, default=None,
                        help="translate this shard only (default: every shard not done yet)")
    parser.add_argument("--max-len", type=int, default=MAX_PIECES, help="drop longer pairs (pieces)")
    parser.add_argument("--max-ratio", type=float, default=3.0,
                        help="drop pairs with a longer source/output length ratio (hallucinations)")
    parser.add_argument("--cpu", action="store_true", help="translate on CPU")
    args, extra = parser.parse_known_args()
    if extra[:1] == ["--"]:
        extra = extra[1:]
    logging.basicConfig(level=logging.INFO, force=True,  # fairseq's import configured it already
                        format="%(asctime)s | %(levelname)s | %(name)s | %(message)s")
    src, tgt = args.source_lang, args.target_lang
    for name in (f"dict.{src}.txt", f"dict.{tgt}.txt", f"train.{src}-{tgt}.{src}.bin"):
        if not (args.data_bin / name).is_file():
            raise SpecNmtError(f"{args.data_bin / name} is missing: DATA_BIN must be a fairseq-preprocess output")
    if not args.verifier.is_file():
        raise SpecNmtError(f"verifier checkpoint {args.verifier} does not exist")

    if args.num_shards < 1 or not 0 <= (args.shard_id or 0) < args.num_shards:
        raise SpecNmtError(
            f"--shard-id must be in [0, --num-shards), got {args.shard_id} of {args.num_shards}"
        )
    shard_dir = args.out_dir / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    with open(args.verifier, "rb") as checkpoint:
        verifier_digest = hashlib.file_digest(checkpoint, "sha256").hexdigest()
    check_same_settings(shard_dir / "settings.json", {
        "data_bin": str(args.data_bin.resolve()), "languages": [src, tgt],
        "verifier_sha256": verifier_digest, "beam": args.beam, "max_tokens": args.max_tokens,
        "num_shards": args.num_shards, "fairseq_generate_flags": extra,
    })  # fmt: skip
    wanted = range(args.num_shards) if args.shard_id is None else [args.shard_id]
    for shard in wanted:
        path = shard_path(shard_dir, shard, args.num_shards)
        if path.is_file():
            logger.info("%s is done: not translated again", path)
            continue
        pairs = translate_subset(
            args.data_bin, args.verifier, "train", args.beam, args.max_tokens,
            languages=(src, tgt), cpu=args.cpu, shard=(shard, args.num_shards), extra=extra,
        )  # fmt: skip
        with written_whole(path) as partial, open(partial, "w", encoding="utf-8") as out:
            for sentence_id, (source, hypothesis) in pairs.items():
                out.write(f"{sentence_id}\t{source}\t{hypothesis}\n")
        logger.info("shard %d of %d: %d sentences in %s", shard, args.num_shards, len(pairs), path)

    write_data_bin(args, shard_dir)


if __name__ == "__main__":
    main()
