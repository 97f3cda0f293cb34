#!/usr/bin/env python3
r"""Package a trained verifier + drafter as a compact model directory for translation only.

    python scripts/export_model.py --verifier WORK/verifier/checkpoint_final.pt \
        --drafter WORK/drafter-cached/checkpoint_best.pt --data-bin WORK/distilled \
        --spm-model spm.model OUT_DIR

(the names scripts/campaign.sh gives: the verifier finish_verifier.py kept, the drafter that
agreed best with it). Writes OUT_DIR/{verifier.pt, drafter.pt, dict.SRC.txt, dict.TGT.txt,
spm.model}: weights in fp16 (they are cast back to the running dtype on load), no optimizer
state, no training paths. This is the layout `make translate` and `fairseq-interactive MODEL_DIR
--path MODEL_DIR/verifier.pt --drafter-path MODEL_DIR/drafter.pt` expect.

The directory is written aside and loaded as spec-nmt-translate loads it before it takes OUT_DIR's
place, so a verifier and a drafter that do not belong together (a drafter trained for another
verifier or dictionary, the verifier given as drafter) are refused and nothing is written. An
OUT_DIR that already holds a model (the bundled data/models/bench-de-en, say) is replaced only
with --force; its MODEL_CARD.md, which describes the old pair, is then removed.

A Spec-Drafter, cached drafter or feature drafter also gets its draft vocabulary: the
--draft-vocab-size target symbols most frequent on the target side of DATA_BIN's training split
(give the data-bin the drafter was trained on, e.g. the distilled one; its dictionaries are the
verifier's). It drafts only those, so its output projection, the largest matrix it reads per
iteration, keeps only their rows; what it drafts is still only proposed, so lossless decoding
stays lossless.

A cached drafter's drafter.pt holds only its own weights: its copy of the verifier's encoder (and
with --verifier-states of its decoder) is rebuilt from verifier.pt when it is loaded
(spec_nmt/compact_drafter.py), which more than halves the file. So is a feature drafter's: the
verifier inside it is rebuilt the same way.
"""

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import spec_nmt.plugin  # noqa: F401  isort: skip  (first: fairseq quiet, the plugin registered)
import torch
from fairseq import checkpoint_utils
from fairseq.data import Dictionary, data_utils

# (importing spec_nmt also lets torch.load read fairseq checkpoints)
from spec_nmt.checkpoint_loading import map_tied, save_checkpoint
from spec_nmt.compact_drafter import (
    VERIFIER_COPIES_KEY,
    copied_parts,
    copies_verifier,
    without_verifier_copies,
)
from spec_nmt.drafters.spec_drafter import MASK_SYMBOL
from spec_nmt.errors import SpecNmtError
from spec_nmt.loading import DRAFT_VOCABULARY_KEY, drafts_over_vocabulary
from spec_nmt.translator import SpecTranslator

# Symbols a drafter drafts over by default: the 4,000 most frequent target symbols of
# bench-de-en's training set (of 8,008) held 99.5 % of the first bundled cached drafter's
# accepted drafts on newstest2013, for half of its output projection's rows
# (docs/lab-notes.md, "By draft vocabulary").
DEFAULT_DRAFT_VOCAB_SIZE = 4000
# sentences counted per bincount
COUNTING_CHUNK = 10000
# what describes a model directory's pair beside its files (data/models/bench-de-en has one)
MODEL_CARD = "MODEL_CARD.md"


def target_counts(data_bin: Path, source_lang: str, target_lang: str) -> torch.Tensor:
    """How often each target symbol occurs on the target side of DATA_BIN's training split
    (EOS once per sentence), [symbols of dict.TGT.txt]."""
    dictionary = Dictionary.load(str(data_bin / f"dict.{target_lang}.txt"))
    prefix = data_bin / f"train.{source_lang}-{target_lang}.{target_lang}"
    dataset = data_utils.load_indexed_dataset(str(prefix), dictionary)
    if dataset is None:
        raise SpecNmtError(
            f"{prefix}.bin: no training split to count the draft vocabulary on (give the "
            "data-bin the drafter was trained on, or --draft-vocab-size 0)"
        )
    counts = torch.zeros(len(dictionary), dtype=torch.long)
    for start in range(0, len(dataset), COUNTING_CHUNK):
        tokens = [dataset[i] for i in range(start, min(start + COUNTING_CHUNK, len(dataset)))]
        counts += torch.bincount(torch.cat(tokens).long(), minlength=len(dictionary))
    return counts


def draft_vocabulary(counts: torch.Tensor, dictionary: Dictionary, size: int) -> torch.Tensor:
    """The ascending ids of the ``size`` symbols of highest ``counts`` that occur at all (ties:
    the lower id), EOS always among them; never BOS, PAD or the drafter's [MASK]."""
    counts = counts.clone()
    never = [dictionary.bos(), dictionary.pad()]
    if MASK_SYMBOL in dictionary.indices:
        never.append(dictionary.index(MASK_SYMBOL))
    counts[never] = 0
    counts[dictionary.eos()] = counts.max() + 1
    order = torch.sort(counts, descending=True, stable=True).indices
    chosen = order[: min(size, int(counts.gt(0).sum()))]
    return torch.sort(chosen).values


def compact_checkpoint(src: Path, dst: Path, vocabulary: Optional[torch.Tensor] = None,
                       verifier: Optional[Path] = None) -> int:
    """fp16 weights, no optimizer state, no machine-specific paths, the draft ``vocabulary``
    when given; without the copies of the ``verifier``'s weights when given (a cached or feature
    drafter).
    Returns the file size."""
    state = checkpoint_utils.load_checkpoint_to_cpu(str(src))
    if verifier is not None and VERIFIER_COPIES_KEY not in state:  # (not if exported before)
        verifier_weights = checkpoint_utils.load_checkpoint_to_cpu(str(verifier))["model"]
        state["model"], state[VERIFIER_COPIES_KEY] = without_verifier_copies(
            state["model"], verifier_weights, src, copied_parts(state)
        )
    if vocabulary is None:  # (a drafter exported before keeps none either)
        state.pop(DRAFT_VOCABULARY_KEY, None)
    else:
        state[DRAFT_VOCABULARY_KEY] = vocabulary
    state["model"] = map_tied(
        state["model"], lambda _, tensor: tensor.half() if tensor.is_floating_point() else tensor
    )
    state["last_optimizer_state"] = None
    state["optimizer_history"] = state.get("optimizer_history", [])[-1:]
    cfg = state["cfg"]
    cfg.task.data = "."  # the model directory itself holds the dictionaries
    cfg.common.user_dir = None
    cfg.checkpoint.save_dir = "."
    if cfg.task._name == "translation_frozen_encoder":  # a way of training a stock model
        cfg.task._name = "translation"  # which plain fairseq and converters then load
        if getattr(cfg.model, "task", None):  # (fairseq's legacy namespace repeats it)
            cfg.model.task = "translation"
    for training_path in ("init_from_verifier", "verifier_path"):  # the verifier it copied
        if getattr(cfg.model, training_path, None):
            setattr(cfg.model, training_path, None)
    if getattr(cfg.task, "eval_acceptance_verifier", None):  # a training-time path
        cfg.task.eval_acceptance_verifier = None
        if "eval_acceptance_sentences" in cfg.task:  # (drafters trained before the flag lack it)
            cfg.task.eval_acceptance_sentences = 0
    save_checkpoint(state, dst)
    return dst.stat().st_size


def model_files(source_lang: str, target_lang: str):
    return ["verifier.pt", "drafter.pt", f"dict.{source_lang}.txt", f"dict.{target_lang}.txt",
            "spm.model"]  # fmt: skip


def write_model_dir(args, out_dir: Path) -> None:
    """The model directory's files, written into ``out_dir``."""
    vocabulary = None
    drafter_state = checkpoint_utils.load_checkpoint_to_cpu(str(args.drafter))
    if args.draft_vocab_size and drafts_over_vocabulary(drafter_state):
        counts = target_counts(args.data_bin, args.source_lang, args.target_lang)
        dictionary = Dictionary.load(str(args.data_bin / f"dict.{args.target_lang}.txt"))
        vocabulary = draft_vocabulary(counts, dictionary, args.draft_vocab_size)
        print(f"draft vocabulary: {vocabulary.numel()} of {len(dictionary)} target symbols")
    total = 0
    copied = args.verifier if copies_verifier(drafter_state) else None
    for name, src, extra, verifier in (("verifier.pt", args.verifier, None, None),
                                       ("drafter.pt", args.drafter, vocabulary, copied)):
        size = compact_checkpoint(src, out_dir / name, extra, verifier)
        print(f"{args.out_dir / name}: {size / 2**20:.1f} MiB")
        total += size
    for lang in (args.source_lang, args.target_lang):
        shutil.copy(args.data_bin / f"dict.{lang}.txt", out_dir / f"dict.{lang}.txt")
    shutil.copy(args.spm_model, out_dir / "spm.model")
    print(f"total {total / 2**20:.1f} MiB of weights in {args.out_dir}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path, help="the model directory to write")
    parser.add_argument("--verifier", type=Path, required=True, help="verifier checkpoint")
    parser.add_argument("--drafter", type=Path, required=True,
                        help="drafter checkpoint (Spec-Drafter, cached, feature or autoregressive "
                        "drafter)")
    parser.add_argument("--data-bin", type=Path, required=True, help="data-bin both were trained on")
    parser.add_argument("--spm-model", type=Path, required=True, help="sentencepiece model of the data")
    parser.add_argument("--source-lang", default="de", help="source language suffix (default: de)")
    parser.add_argument("--target-lang", default="en", help="target language suffix (default: en)")
    parser.add_argument("--draft-vocab-size", type=int, default=DEFAULT_DRAFT_VOCAB_SIZE,
                        help="a Spec-Drafter, cached or feature drafter drafts only this many of "
                        "the target symbols, the most frequent on the target side of DATA_BIN's "
                        "training split (0: every symbol; default: %(default)s)")
    parser.add_argument("--force", action="store_true",
                        help=f"replace the model in an OUT_DIR that holds one (and remove its "
                        f"{MODEL_CARD}, which describes the old pair)")
    args = parser.parse_args()
    if args.draft_vocab_size < 0:
        raise SpecNmtError(f"--draft-vocab-size must be >= 0, got {args.draft_vocab_size}")
    inputs = [args.verifier, args.drafter, args.spm_model] + [
        args.data_bin / f"dict.{lang}.txt" for lang in (args.source_lang, args.target_lang)
    ]
    for path in inputs:
        if not path.is_file():
            raise SpecNmtError(f"{path} does not exist")
    names = model_files(args.source_lang, args.target_lang)
    existing = [name for name in names + [MODEL_CARD] if (args.out_dir / name).exists()]
    if existing and not args.force:
        raise SpecNmtError(
            f"{args.out_dir} already holds a model ({', '.join(existing)}): export into a new "
            "directory, or give --force to replace it"
        )
    args.out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{args.out_dir.name}.", dir=args.out_dir.parent))
    try:
        write_model_dir(args, staging)
        # the loader's own checks, on what would be installed
        SpecTranslator.from_pretrained(staging, source_lang=args.source_lang,
                                       target_lang=args.target_lang, device="cpu")  # fmt: skip
        args.out_dir.mkdir(exist_ok=True)
        for name in names:
            os.replace(staging / name, args.out_dir / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if MODEL_CARD in existing:
        (args.out_dir / MODEL_CARD).unlink()
        print(f"removed {args.out_dir / MODEL_CARD}: it described the pair this export replaced")


if __name__ == "__main__":
    main()
