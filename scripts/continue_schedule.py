#!/usr/bin/env python3
"""Make a weights-only fairseq checkpoint resumable on its own learning-rate schedule.

    python scripts/continue_schedule.py WEIGHTS_ONLY.pt OUT.pt

A checkpoint saved without optimizer state (such as ../shared/warmstart/*/checkpoint_last.pt) can
only be resumed with --reset-optimizer, and then fairseq restarts the update count at 0 and warms
the learning rate up again. OUT.pt gets an empty Adam state instead: fairseq-train loads it without
--reset-optimizer, keeps the saved update count (so inverse_sqrt continues where it stopped), the
epoch position and the best validation loss; only Adam's moment estimates start afresh. Pass it to
fairseq-train with --continue-once OUT.pt: a later run of the same command resumes from the save
directory's checkpoint_last.pt instead.
"""

import argparse
import ast
from pathlib import Path

import spec_nmt.plugin  # noqa: F401  isort: skip  (first: fairseq quiet, the plugin registered)
from fairseq import checkpoint_utils, tasks

# (importing spec_nmt also lets torch.load read fairseq checkpoints)
from spec_nmt.checkpoint_loading import save_checkpoint
from spec_nmt.errors import SpecNmtError


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", type=Path, help="fairseq checkpoint without optimizer state")
    parser.add_argument("out", type=Path, help="where to write the resumable checkpoint")
    parser.add_argument(
        "--data", help="data-bin to build the model with (default: the one saved in the checkpoint)"
    )
    args = parser.parse_args()

    state = checkpoint_utils.load_checkpoint_to_cpu(str(args.checkpoint))
    if state.get("last_optimizer_state") is not None:
        raise SpecNmtError(f"{args.checkpoint} already has optimizer state: resume it as it is")
    history = state.get("optimizer_history") or []
    optimizer_name = history[-1].get("optimizer_name") if history else None
    if optimizer_name != "FairseqAdam":
        raise SpecNmtError(
            f"{args.checkpoint} was trained with {optimizer_name or 'an unknown optimizer'}; only "
            "fp32 training with --optimizer adam is supported (fp16 keeps other optimizer state)"
        )
    cfg = state["cfg"]
    if args.data:
        cfg.task.data = args.data
    # The optimizer state must list exactly the trainer's parameters: the model's (tied ones once)
    # in model.parameters() order.
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model, from_checkpoint=True)  # not started again
    parameter_count = sum(1 for p in model.parameters() if p.requires_grad)
    optimizer = cfg.optimizer
    state["last_optimizer_state"] = {
        "state": {},
        "param_groups": [
            {
                "lr": cfg.optimization.lr[0],
                "betas": tuple(ast.literal_eval(str(optimizer.adam_betas))),
                "eps": optimizer.adam_eps,
                "weight_decay": optimizer.weight_decay,
                "amsgrad": False,
                "params": list(range(parameter_count)),
            }
        ],
    }
    save_checkpoint(state, args.out)
    print(
        f"{args.out}: update {history[-1]['num_updates']}, epoch "
        f"{state['extra_state']['train_iterator']['epoch']}, {parameter_count} parameter tensors"
    )


if __name__ == "__main__":
    main()
