#!/usr/bin/env python3
"""Package a trained verifier + drafter as a compact model directory for translation only.

    python scripts/export_model.py --verifier V.pt --drafter D.pt --data-bin DATA_BIN \
        --spm-model spm.model OUT_DIR

Writes OUT_DIR/{verifier.pt, drafter.pt, dict.SRC.txt, dict.TGT.txt, spm.model}: weights in fp16
(they are cast back to the running dtype on load), no optimizer state, no training paths. This is
the layout `make translate` and `fairseq-interactive MODEL_DIR --path MODEL_DIR/verifier.pt
--drafter-path MODEL_DIR/drafter.pt` expect.
"""

import argparse
import shutil
from pathlib import Path

from fairseq import checkpoint_utils

# (importing spec_nmt also lets torch.load read fairseq checkpoints)
from spec_nmt.checkpoint_loading import map_tied, save_checkpoint
from spec_nmt.errors import SpecNmtError


def compact_checkpoint(src: Path, dst: Path) -> int:
    """fp16 weights, no optimizer state, no machine-specific paths. Returns the file size."""
    state = checkpoint_utils.load_checkpoint_to_cpu(str(src))
    state["model"] = map_tied(
        state["model"], lambda _, tensor: tensor.half() if tensor.is_floating_point() else tensor
    )
    state["last_optimizer_state"] = None
    state["optimizer_history"] = state.get("optimizer_history", [])[-1:]
    cfg = state["cfg"]
    cfg.task.data = "."  # the model directory itself holds the dictionaries
    cfg.common.user_dir = None
    cfg.checkpoint.save_dir = "."
    if getattr(cfg.model, "init_from_verifier", None):
        cfg.model.init_from_verifier = None
    if getattr(cfg.task, "eval_acceptance_verifier", None):  # a training-time path
        cfg.task.eval_acceptance_verifier = None
        if "eval_acceptance_sentences" in cfg.task:  # (drafters trained before the flag lack it)
            cfg.task.eval_acceptance_sentences = 0
    save_checkpoint(state, dst)
    return dst.stat().st_size


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--verifier", type=Path, required=True, help="verifier checkpoint")
    parser.add_argument("--drafter", type=Path, required=True,
                        help="drafter checkpoint (Spec-Drafter, cached or autoregressive drafter)")
    parser.add_argument("--data-bin", type=Path, required=True, help="data-bin both were trained on")
    parser.add_argument("--spm-model", type=Path, required=True, help="sentencepiece model of the data")
    parser.add_argument("--source-lang", default="de")
    parser.add_argument("--target-lang", default="en")
    args = parser.parse_args()
    inputs = [args.verifier, args.drafter, args.spm_model] + [
        args.data_bin / f"dict.{lang}.txt" for lang in (args.source_lang, args.target_lang)
    ]
    for path in inputs:
        if not path.is_file():
            raise SpecNmtError(f"{path} does not exist")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    total = 0
    for name, src in (("verifier.pt", args.verifier), ("drafter.pt", args.drafter)):
        size = compact_checkpoint(src, args.out_dir / name)
        print(f"{args.out_dir / name}: {size / 2**20:.1f} MiB")
        total += size
    for lang in (args.source_lang, args.target_lang):
        shutil.copy(args.data_bin / f"dict.{lang}.txt", args.out_dir / f"dict.{lang}.txt")
    shutil.copy(args.spm_model, args.out_dir / "spm.model")
    print(f"total {total / 2**20:.1f} MiB of weights in {args.out_dir}")


if __name__ == "__main__":
    main()
