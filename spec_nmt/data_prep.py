"""Raw parallel text -> joint sentencepiece -> fairseq binary data.

Shared by ``scripts/prepare_data.py`` (any directory of ``{train,valid,test}.{src,tgt}``),
``scripts/prepare_wmt14.py`` (downloads WMT14 first) and ``scripts/distill.py`` (re-binarizes
the verifier's translations with the original dictionaries).
"""

import logging
import os
import subprocess
import sys
from pathlib import Path

from spec_nmt.errors import SpecNmtError

logger = logging.getLogger(__name__)

SPLITS = ("train", "valid", "test")
SPM_PREFIX = "spm"


def check_raw_dir(raw_dir, src, tgt, splits=SPLITS):
    """Fail early, naming the file, if a split is missing or its sides differ in length."""
    for split in splits:
        counts = {}
        for lang in (src, tgt):
            path = Path(raw_dir) / f"{split}.{lang}"
            if not path.is_file():
                raise SpecNmtError(f"{path} is missing: expected {{{','.join(splits)}}}.{{{src},{tgt}}}")
            with open(path, encoding="utf-8") as f:
                counts[lang] = sum(1 for _ in f)
        if counts[src] != counts[tgt]:
            raise SpecNmtError(
                f"{raw_dir}/{split}.{src} has {counts[src]} lines but {split}.{tgt} has {counts[tgt]}"
            )


def train_sentencepiece(train_files, model_prefix, vocab_size, max_sentences=2_000_000):
    """One unigram model over both languages, so source and target share a dictionary."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        input=",".join(str(f) for f in train_files),
        model_prefix=str(model_prefix),
        vocab_size=vocab_size,
        model_type="unigram",
        character_coverage=1.0,
        input_sentence_size=max_sentences,
        shuffle_input_sentence=True,
        # fairseq maps pieces to its own dictionary (with its own <s>, <pad>, </s>, <unk>), so
        # sentencepiece needs no control symbols besides the unknown piece.
        bos_id=-1,
        eos_id=-1,
        unk_id=0,
        num_threads=os.cpu_count() or 1,
        minloglevel=2,
    )
    return Path(f"{model_prefix}.model")


def encode_file(sp, in_path, out_path):
    """Encode line by line so the output stays aligned with the input (empty lines stay empty)."""
    with open(in_path, encoding="utf-8") as fin, open(out_path, "w", encoding="utf-8") as fout:
        for line in fin:
            fout.write(" ".join(sp.encode(line.strip(), out_type=str)) + "\n")


def filter_pair_lengths(src_path, tgt_path, max_len, max_ratio):
    """Drop training pairs that are empty, longer than max_len pieces or badly unbalanced,
    like Moses' clean-corpus-n does in fairseq's WMT recipes. Rewrites both files in place."""
    kept = dropped = 0
    with open(src_path, encoding="utf-8") as fs, open(tgt_path, encoding="utf-8") as ft:
        pairs = list(zip(fs, ft))
    with open(src_path, "w", encoding="utf-8") as fs, open(tgt_path, "w", encoding="utf-8") as ft:
        for s, t in pairs:
            ls, lt = len(s.split()), len(t.split())
            if 0 < ls <= max_len and 0 < lt <= max_len and max(ls, lt) <= max_ratio * min(ls, lt):
                fs.write(s)
                ft.write(t)
                kept += 1
            else:
                dropped += 1
    logger.info("length filter on %s: kept %d pairs, dropped %d", src_path, kept, dropped)
    return kept


def run_fairseq_preprocess(src, tgt, destdir, trainpref=None, validpref=None, testpref=None,
                           srcdict=None, workers=None):
    """fairseq-preprocess with a joined dictionary (or the given one, e.g. for distilled data)."""
    args = [sys.executable, "-m", "fairseq_cli.preprocess", "--source-lang", src,
            "--target-lang", tgt, "--destdir", str(destdir),
            "--workers", str(workers or os.cpu_count() or 1)]
    for flag, pref in (("--trainpref", trainpref), ("--validpref", validpref),
                       ("--testpref", testpref)):
        if pref is not None:
            args += [flag, str(pref)]
    args.append("--joined-dictionary")
    if srcdict is not None:
        args += ["--srcdict", str(srcdict)]
    logger.info("running %s", " ".join(args))
    subprocess.run(args, check=True)


def prepare(raw_dir, out_dir, src="de", tgt="en", vocab_size=8000, max_len=250, max_ratio=1.5):
    """raw_dir/{train,valid,test}.{src,tgt} -> out_dir/{spm.model, spm/*, bin/}."""
    import sentencepiece as spm

    check_raw_dir(raw_dir, src, tgt)
    out_dir = Path(out_dir)
    spm_dir = out_dir / "spm"
    spm_dir.mkdir(parents=True, exist_ok=True)
    model = train_sentencepiece(
        [Path(raw_dir) / f"train.{lang}" for lang in (src, tgt)], out_dir / SPM_PREFIX, vocab_size
    )
    sp = spm.SentencePieceProcessor(model_file=str(model))
    for split in SPLITS:
        for lang in (src, tgt):
            encode_file(sp, Path(raw_dir) / f"{split}.{lang}", spm_dir / f"{split}.{lang}")
    # Only training pairs are filtered: valid/test must stay complete and aligned with references.
    filter_pair_lengths(spm_dir / f"train.{src}", spm_dir / f"train.{tgt}", max_len, max_ratio)
    run_fairseq_preprocess(
        src, tgt, out_dir / "bin",
        trainpref=spm_dir / "train", validpref=spm_dir / "valid", testpref=spm_dir / "test",
    )
    return out_dir
