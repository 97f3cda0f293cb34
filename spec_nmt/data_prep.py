"""Raw parallel text -> joint sentencepiece -> fairseq binary data.

Shared by ``scripts/prepare_data.py`` (any directory of ``{train,valid,test}.{src,tgt}``),
``scripts/prepare_wmt14.py`` (downloads WMT14 first) and ``scripts/distill.py`` (re-binarizes
the verifier's translations with the original dictionaries); ``translate_subset`` runs a verifier
over a binarized split for distillation and for ``scripts/finish_verifier.py``.
"""

import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from spec_nmt.errors import SpecNmtError
from spec_nmt.settings import DEFAULTS

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
                expected = f"{{{','.join(splits)}}}.{{{src},{tgt}}}"
                raise SpecNmtError(f"{path} is missing: expected {expected}")
            with open(path, encoding="utf-8") as f:
                counts[lang] = sum(1 for _ in f)
        if counts[src] != counts[tgt]:
            raise SpecNmtError(
                f"{raw_dir}/{split}.{src} has {counts[src]} lines but {split}.{tgt} has "
                f"{counts[tgt]}"
            )


def train_sentencepiece(train_files, model_prefix, vocab_size, max_sentences=2_000_000):
    """One unigram model over both languages, so source and target share a dictionary. A
    vocabulary the text cannot fill is a one-line error."""
    import sentencepiece as spm

    try:
        _train_unigram(spm, train_files, model_prefix, vocab_size, max_sentences)
    except RuntimeError as error:
        most = re.search(r"Vocabulary size too high.*<= (\d+)", str(error))
        if most is None:
            raise
        raise SpecNmtError(
            f"--vocab-size {vocab_size} is more than sentencepiece can make of this training "
            f"text (at most {most.group(1)} pieces): give --vocab-size {most.group(1)} or less, "
            "or more text"
        ) from None
    return Path(f"{model_prefix}.model")


def _train_unigram(spm, train_files, model_prefix, vocab_size, max_sentences):
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
                           srcdict=None, workers=None, tgtdict=None, output=None):
    """fairseq-preprocess with a joined dictionary (or the given one, e.g. for distilled data;
    with ``tgtdict`` too, each side's own: a model directory's dict.de.txt and dict.en.txt).
    ``output``: a file for its log instead of this process's stdout and stderr."""
    args = [sys.executable, "-m", "fairseq_cli.preprocess", "--source-lang", src,
            "--target-lang", tgt, "--destdir", str(destdir),
            "--workers", str(workers or os.cpu_count() or 1)]
    for flag, pref in (("--trainpref", trainpref), ("--validpref", validpref),
                       ("--testpref", testpref)):
        if pref is not None:
            args += [flag, str(pref)]
    if tgtdict is None:
        args.append("--joined-dictionary")
    else:
        args += ["--tgtdict", str(tgtdict)]
    if srcdict is not None:
        args += ["--srcdict", str(srcdict)]
    logger.info("running %s", " ".join(args))
    subprocess.run(args, check=True, stdout=output, stderr=output)


def translate_subset(data_bin, checkpoint, subset, beam, max_tokens, languages=("de", "en"),
                     cpu=False, shard=(0, 1), extra=()):
    """Translate split ``subset`` of a data-bin with stock fairseq-generate (``--beam``, the
    length limits of the decoding settings). Returns {sentence id: (source, hypothesis)} in
    the data's own tokens (sentencepiece pieces for prepare_data.py output). ``shard`` =
    (index, count) translates every count-th batch only, starting with batch ``index``."""
    src, tgt = languages
    shard_id, num_shards = shard
    command = [
        sys.executable, "-m", "fairseq_cli.generate", str(data_bin),
        "--user-dir", str(Path(__file__).resolve().parent),
        "--task", "translation", "--source-lang", src, "--target-lang", tgt,
        "--gen-subset", subset, "--path", str(checkpoint), "--beam", str(beam),
        "--max-tokens", str(max_tokens), "--required-batch-size-multiple", "1",
        # fairseq-generate shards batches by the distributed rank flags.
        "--distributed-world-size", str(num_shards), "--distributed-rank", str(shard_id),
        *DEFAULTS.fairseq_flags(["max_len_a", "max_len_b"]), *(["--cpu"] if cpu else []), *extra,
    ]  # fmt: skip
    logger.info("running %s", " ".join(command))
    sources, hypotheses = {}, {}
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, encoding="utf-8") as proc:
        for line in proc.stdout:
            kind, _, rest = line.rstrip("\n").partition("-")
            if kind not in ("S", "H") or not rest[:1].isdigit():
                continue
            fields = rest.split("\t")
            sentence_id = int(fields[0])
            if kind == "S":
                sources[sentence_id] = fields[1]
            else:
                hypotheses[sentence_id] = fields[2]
                if len(hypotheses) % 5000 == 0:
                    logger.info("%d sentences translated", len(hypotheses))
    if proc.returncode != 0:
        raise SpecNmtError(f"fairseq-generate failed with exit code {proc.returncode}")
    return {i: (sources[i], hypotheses[i]) for i in sorted(hypotheses)}


# the data recipe's defaults: joint sentencepiece vocabulary, and the training pairs kept (at
# most MAX_PIECES pieces a side, a length ratio of at most MAX_RATIO)
VOCAB_SIZE, MAX_PIECES, MAX_RATIO = 8000, 250, 1.5


def prepare(raw_dir, out_dir, src="de", tgt="en", vocab_size=VOCAB_SIZE, max_len=MAX_PIECES,
            max_ratio=MAX_RATIO):  # fmt: skip
    """raw_dir/{train,valid,test}.{src,tgt} -> out_dir/{spm.model, spm/*, bin/}. A run that
    stops with an error removes what it wrote, so a rerun never finds half an output."""
    check_raw_dir(raw_dir, src, tgt)
    out_dir = Path(out_dir)
    outputs = [out_dir] if not out_dir.exists() else [
        out_dir / name for name in (f"{SPM_PREFIX}.model", f"{SPM_PREFIX}.vocab", "spm", "bin")
        if not (out_dir / name).exists()
    ]  # fmt: skip
    try:
        return _prepare(raw_dir, out_dir, src, tgt, vocab_size, max_len, max_ratio)
    except BaseException:
        for path in outputs:
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        raise


def _prepare(raw_dir, out_dir, src, tgt, vocab_size, max_len, max_ratio):
    import sentencepiece as spm

    out_dir.mkdir(parents=True, exist_ok=True)
    # sentencepiece first: it refuses a vocabulary too large for the text before spm/ exists
    model = train_sentencepiece(
        [Path(raw_dir) / f"train.{lang}" for lang in (src, tgt)], out_dir / SPM_PREFIX, vocab_size
    )
    spm_dir = out_dir / "spm"
    spm_dir.mkdir(exist_ok=True)
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
