"""Fine-tuning a verifier's decoder with ``--task translation_frozen_encoder``: the encoder, and
so the cached drafter trained on it, stay valid."""

import torch
from fairseq import checkpoint_utils

from tests.conftest import (
    OPTIMIZATION,
    TINY_TRANSFORMER,
    USER_DIR,
    fairseq_in_process,
    script_module,
    train_losses,
)


def test_the_decoder_trains_and_the_cached_drafter_still_pairs_with_it(toy, tmp_path):
    log = fairseq_in_process(
        "train", toy["bin"], "--user-dir", USER_DIR, "--task", "translation_frozen_encoder",
        "--arch", "transformer", *TINY_TRANSFORMER, *OPTIMIZATION, "--max-update", 40,
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", 0.1,
        "--finetune-from-model", toy["verifier"], "--save-dir", tmp_path,
    )  # fmt: skip
    assert len(train_losses(log)) >= 1
    (drafter,), _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(toy["cached_drafter"])], arg_overrides={"data": str(toy["bin"])}
    )
    before, after = (
        checkpoint_utils.load_model_ensemble([str(path)], task=task)[0][0].state_dict()
        for path in (toy["verifier"], tmp_path / "checkpoint_last.pt")
    )
    encoder = [name for name in before if name.startswith("encoder.")]
    decoder_layers = [name for name in before if name.startswith("decoder.layers.")]
    assert encoder and decoder_layers
    assert all(torch.equal(before[name], after[name]) for name in encoder)
    assert all(not torch.equal(before[name], after[name]) for name in decoder_layers
               if name.endswith("weight"))  # fmt: skip
    fine_tuned = checkpoint_utils.load_model_ensemble(
        [str(tmp_path / "checkpoint_last.pt")], task=task
    )[0][0]
    drafter.check_verifier_matches(fine_tuned)  # raises if the encoder moved

    # exported, it is a stock checkpoint: plain fairseq and converters know no such task
    exported = tmp_path / "verifier.pt"
    script_module("export_model").compact_checkpoint(tmp_path / "checkpoint_last.pt", exported)
    cfg = checkpoint_utils.load_checkpoint_to_cpu(str(exported))["cfg"]
    assert cfg["task"]["_name"] == "translation"
    assert getattr(cfg["model"], "task", "translation") == "translation"
