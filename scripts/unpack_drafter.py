#!/usr/bin/env python3
r"""A model directory's drafter as a checkpoint that fairseq-train can start from.

    python scripts/unpack_drafter.py MODEL_DIR OUT.pt [--verifier VERIFIER.pt]

export_model.py stores a cached drafter without its copy of the verifier's encoder (a feature
drafter without the verifier inside it) and in fp16; this puts the copy back (from
MODEL_DIR/verifier.pt, or from --verifier: a verifier fine-tuned with --task
translation_frozen_encoder has the same encoder) and writes the weights in fp32, without the
draft vocabulary, so the drafter can be trained further:

    scripts/train_drafter.sh DISTILLED_BIN SAVE_DIR cached_small --init-from-verifier V.pt \
        --finetune-from-model OUT.pt ...
"""

import argparse
from pathlib import Path

import spec_nmt.plugin  # noqa: F401  isort: skip  (first: fairseq quiet, the plugin registered)
from fairseq import checkpoint_utils

# (importing spec_nmt also lets torch.load read fairseq checkpoints)
from spec_nmt.checkpoint_loading import (
    VERIFIER_COPIES_KEY,
    checkpoint_arch,
    model_config,
    save_checkpoint,
)
from spec_nmt.compact_drafter import with_verifier_copies
from spec_nmt.errors import SpecNmtError
from spec_nmt.loading import DRAFT_VOCABULARY_KEY


def unpacked(model_dir: Path, verifier_path: Path, source_lang="de", target_lang="en"):
    drafter_path = model_dir / "drafter.pt"
    for path in (drafter_path, verifier_path):
        if not path.is_file():
            raise SpecNmtError(f"{path}: no such file")
    state = checkpoint_utils.load_checkpoint_to_cpu(str(drafter_path))
    (verifier,), _ = checkpoint_utils.load_model_ensemble(
        [str(verifier_path)],
        arg_overrides={"data": str(model_dir), "source_lang": source_lang,
                       "target_lang": target_lang},  # fmt: skip
    )
    try:
        state = with_verifier_copies(state, verifier, str(drafter_path))
    except SpecNmtError as error:
        raise SpecNmtError(
            f"{drafter_path} was trained on another verifier than {verifier_path}: give the "
            "verifier it was exported with (--verifier)"
        ) from error
    weights = {
        name: tensor.float() if tensor.is_floating_point() else tensor
        for name, tensor in state["model"].items()
    }
    kept = {key: value for key, value in state.items()
            if key not in (DRAFT_VOCABULARY_KEY, VERIFIER_COPIES_KEY)}  # fmt: skip
    if checkpoint_arch(state) == "feature_drafter":  # its model is built around its verifier
        model_config(kept).verifier_path = str(verifier_path)
    return dict(kept, model=weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path, help="model directory (export_model.py's)")
    parser.add_argument("out", type=Path, help="the trainable drafter checkpoint to write")
    parser.add_argument("--verifier", type=Path,
                        help="verifier whose encoder the copy comes from (default: "
                        "MODEL_DIR/verifier.pt)")  # fmt: skip
    parser.add_argument("--source-lang", default="de", help="source language suffix (default: de)")
    parser.add_argument("--target-lang", default="en", help="target language suffix (default: en)")
    args = parser.parse_args()
    state = unpacked(args.model_dir, args.verifier or args.model_dir / "verifier.pt",
                     args.source_lang, args.target_lang)  # fmt: skip
    save_checkpoint(state, args.out)
    print(f"wrote {args.out}: {len(state['model'])} tensors in fp32")


if __name__ == "__main__":
    main()
