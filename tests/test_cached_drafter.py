"""The cached drafter: trained on the verifier's frozen encoder with the decoding attention
pattern, its cached iterations equal a full recomputation, and it refuses other verifiers."""

import re
import subprocess
import sys

import pytest
import torch
from fairseq import checkpoint_utils

from spec_nmt.drafters.cached_drafter import cut_visibility
from spec_nmt.drafters.cached_drafting import CachedDrafter
from spec_nmt.drafters.spec_drafter import MASK_SYMBOL
from spec_nmt.errors import SpecNmtError
from spec_nmt.settings import DEFAULTS
from tests.conftest import (
    BLOCK_SIZE,
    REPO,
    USER_DIR,
    drafter_training,
    fairseq,
    fairseq_error,
    train_losses,
)


def load_pair(toy, drafter_name):
    (drafter,), _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(toy[drafter_name])], arg_overrides={"data": str(toy["bin"])}
    )
    (verifier,), _ = checkpoint_utils.load_model_ensemble([str(toy["verifier"])], task=task)
    return task, drafter.eval(), verifier.eval()


@pytest.fixture(scope="module")
def pair(toy):
    return load_pair(toy, "cached_drafter")


def test_training_freezes_the_verifier_encoder_and_the_loss_falls(toy, pair):
    task, drafter, verifier = pair
    drafter.check_verifier_matches(verifier)  # 300 updates left the copied encoder untouched
    losses = train_losses(toy["cached_drafter_log"])
    assert losses[-1] < 0.75 * losses[0], losses
    weight = verifier.encoder.layers[0].fc1.weight
    kept = weight[0, 0].item()
    with torch.no_grad():
        weight[0, 0] += 0.01 * (1 + weight[0, 0].abs())  # beyond fp16's rounding at any size
    with pytest.raises(SpecNmtError, match="trained on another verifier's"):
        drafter.check_verifier_matches(verifier)
    with torch.no_grad():
        weight[0, 0] = kept
    # a model directory's copy (fp16 weights, export_model.py) of either model is the same encoder
    for exported in (verifier, drafter):
        fp32 = {name: tensor.clone() for name, tensor in exported.encoder.state_dict().items()}
        try:
            with torch.no_grad():
                for tensor in exported.encoder.state_dict().values():
                    tensor.copy_(tensor.half())
            assert any(not torch.equal(fp32[name], tensor)
                       for name, tensor in exported.encoder.state_dict().items())  # fmt: skip
            drafter.check_verifier_matches(verifier)
            # but an fp16 copy with one weight changed beyond fp16's rounding is another encoder
            with torch.no_grad():
                changed = exported.encoder.layers[0].fc1.weight
                changed[0, 0] += 0.01 * (1 + changed[0, 0].abs())
            with pytest.raises(SpecNmtError, match="trained on another verifier's"):
                drafter.check_verifier_matches(verifier)
        finally:
            exported.encoder.load_state_dict(fp32)
    # a final norm, as a pre-norm encoder has
    verifier.encoder.layer_norm = torch.nn.LayerNorm(verifier.encoder.embed_tokens.embedding_dim)
    try:
        with pytest.raises(SpecNmtError, match=r"only the verifier has layer_norm\.(weight|bias)"):
            drafter.check_verifier_matches(verifier)
    finally:
        verifier.encoder.layer_norm = None
    drafter.check_verifier_matches(verifier)


def test_a_mask_block_sees_its_cut_prefix_and_its_own_block_only():
    # 4 prefix entries, blocks of 2 after cuts 1 and 3
    seen = cut_visibility(4, torch.tensor([[1, 3]]), 2)[0].int().tolist()
    assert seen == [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 1, 0, 0],
        [1, 1, 1, 1, 0, 0, 1, 1],
        [1, 1, 1, 1, 0, 0, 1, 1],
    ]


@torch.no_grad()
def test_cached_iterations_equal_full_recomputation(pair):
    """Random accept lengths per row, one row leaving: every iteration's mask distributions on
    the cache equal the training forward over BOS + prefix + masks from scratch."""
    task, drafter, verifier_model = pair
    dictionary = task.target_dictionary
    pad, eos = dictionary.pad(), dictionary.eos()
    adapter = CachedDrafter(drafter, pad=pad, eos=eos)
    mask = task.drafter_dictionaries()[1].index(MASK_SYMBOL)
    src = torch.tensor([[pad, 9, 10, 11, eos], [12, 13, 14, 15, eos], [16, 17, 18, 19, eos]])
    net_input = {"src_tokens": src, "src_lengths": src.ne(pad).sum(1)}
    encoder_out = verifier_model.encoder.forward_torchscript(net_input)
    state = adapter.start(net_input, encoder_out)
    generator = torch.Generator().manual_seed(3)
    tokens = torch.full((3, 200), pad)
    tokens[:, 0] = eos
    lengths = torch.zeros(3, dtype=torch.long)
    rows = torch.arange(3)
    k = BLOCK_SIZE
    for iteration in range(16):
        cached = adapter.position_logits(state, tokens[rows], lengths[rows], k).log_softmax(-1)
        for i, row in enumerate(rows.tolist()):
            length = int(lengths[row])
            decoder_input = torch.cat([tokens[row, : length + 1], torch.full((k,), mask)])
            source = net_input["src_tokens"][row : row + 1], net_input["src_lengths"][row : row + 1]
            logits, _ = drafter(*source, decoder_input.unsqueeze(0), cuts=torch.tensor([[length]]))
            logits = logits[0, :, :mask].float()
            logits[:, pad] = float("-inf")
            torch.testing.assert_close(cached[i], logits.log_softmax(-1), atol=1e-5, rtol=1e-5)
        # each row commits 0 .. k+1 new tokens (accepted drafts plus the verifier's token; 0: a
        # finished row the loop still carries)
        n_new = torch.randint(0, k + 2, (len(rows),), generator=generator)
        for i, row in enumerate(rows.tolist()):
            n = int(n_new[i])
            new = torch.randint(dictionary.nspecial, len(dictionary), (n,), generator=generator)
            tokens[row, lengths[row] + 1 : lengths[row] + 1 + n] = new
            lengths[row] += n
        adapter.commit(state, None, n_new)
        if iteration == 2:
            rows = torch.tensor([0, 2])
            adapter.select_rows(state, torch.tensor([0, 2]))


def test_training_without_the_verifier_is_refused_in_one_line(toy, tmp_path):
    training = drafter_training(toy["bin"], tmp_path / "d", 1, "--arch", "cached_drafter")
    assert "give --init-from-verifier VERIFIER.pt" in fairseq_error("train", *training)


def test_a_decoder_option_block_scoring_cannot_compute_is_refused_before_training(toy, tmp_path):
    training = drafter_training(
        toy["bin"], tmp_path / "d", 1, "--arch", "cached_drafter",
        "--init-from-verifier", toy["verifier"], "--cross-self-attention",
    )  # fmt: skip
    assert "the cached drafter uses --cross-self-attention" in fairseq_error("train", *training)
    assert not (tmp_path / "d" / "checkpoint_last.pt").exists()


def validation_metric(log, name):
    """The metric's value at every validation of a fairseq-train log."""
    lines = [line for line in log.splitlines() if "| valid on" in line]
    return [float(re.search(rf"\| {name} ([0-9.]+)", line).group(1)) for line in lines]


def test_validation_logs_the_acceptance_that_decoding_measures(toy):
    """--eval-acceptance-verifier: every validation decodes the valid set with the drafter of the
    moment; the last one ran on checkpoint_last's weights, so fairseq-generate with that
    checkpoint over the same batches reports the same mean (validation drafts in fp32)."""
    lossless = validation_metric(toy["cached_drafter_log"], "accepted_lossless")
    relaxed = validation_metric(toy["cached_drafter_log"], "accepted_top_beta")
    print(f"accepted per validation: lossless {lossless}, beta 3 tau 1 {relaxed}")
    assert len(lossless) == len(relaxed) >= 5
    assert lossless[-1] > lossless[0] + 0.5, lossless  # training raised the acceptance
    assert max(relaxed) > max(lossless), (relaxed, lossless)  # beta 3, tau 1 accepts more
    result = fairseq(
        "generate", toy["bin"], "--user-dir", USER_DIR, "--task", "spec_translation",
        "--path", toy["verifier"], "--drafter-path", toy["cached_drafter"], "--drafter", "file",
        "--gen-subset", "valid",
        "--block-size", BLOCK_SIZE, "--max-draft-batch", 0, "--max-tokens", 2000,
        "--drafter-precision", "fp32",
        *DEFAULTS.fairseq_flags(["max_len_a", "max_len_b"]), "--cpu",
    )  # fmt: skip
    decoded = re.search(r"mean accepted tokens per iteration ([0-9.]+)", result.stderr).group(1)
    assert float(decoded) == pytest.approx(lossless[-1], abs=0.006)
    # --best-checkpoint-metric accepted_lossless --maximize-best-checkpoint-metric: the best
    # checkpoint is the one saved at the validation with the most accepted drafts (the last of
    # equal ones: fairseq replaces it on an equal value too)
    updates = validation_metric(toy["cached_drafter_log"], "num_updates")
    best_updates = [u for u, value in zip(updates, lossless) if value == max(lossless)]
    best = torch.load(toy["cached_drafter_best"], weights_only=False)
    assert best["optimizer_history"][-1]["num_updates"] == best_updates[-1]


def test_acceptance_can_be_measured_on_the_first_sentences_only(pair):
    """--eval-acceptance-sentences N: a validation batch counts the drafts and iterations of
    its sentences of id below N only, the same counts as decoding those sentences alone."""
    task, drafter, _ = pair
    task.load_dataset("valid")
    dataset = task.dataset("valid")
    everything = dataset.collater([dataset[i] for i in range(len(dataset))])
    first = len(dataset) // 3
    only_first = dataset.collater([dataset[i] for i in range(first)])
    assert task.cfg.eval_acceptance_sentences == 0  # the default: every sentence
    all_counts = task.acceptance.counts(everything, drafter)
    expected = task.acceptance.counts(only_first, drafter)
    try:
        task.cfg.eval_acceptance_sentences = first
        assert task.acceptance.counts(everything, drafter) == expected
        assert task.acceptance.counts(only_first, drafter) == expected
        later = dataset.collater([dataset[i] for i in range(first, len(dataset))])
        # none selected: zeros under the same keys (DDP sums every worker's keys together)
        assert task.acceptance.counts(later, drafter) == {key: 0 for key in expected}
    finally:
        task.cfg.eval_acceptance_sentences = 0
    assert expected["_accepted_lossless_iterations"] < all_counts["_accepted_lossless_iterations"]


def test_acceptance_verifier_must_be_a_verifier(toy, tmp_path):
    training = drafter_training(
        toy["bin"], tmp_path / "d", 1, "--eval-acceptance-verifier", toy["drafter"]
    )
    assert "is a drafter; give the verifier" in fairseq_error("train", *training)


def test_learning_curve_lists_each_validation_once(toy, tmp_path):
    """scripts/learning_curve.py over a log given twice (as a resumed run's logs repeat
    validations): one row per validation, the logged values."""
    log = tmp_path / "train.log"
    log.write_text(toy["cached_drafter_log"])
    script = REPO / "scripts" / "learning_curve.py"
    table = subprocess.run(
        [sys.executable, script, log, log, "--metrics", "accepted_lossless"],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    rows = [line.strip("| ").split(" | ") for line in table[2 : table.index("")]]
    log_text = toy["cached_drafter_log"]
    updates = validation_metric(log_text, "num_updates")
    assert [int(update) for _, update, _ in rows] == sorted(set(int(u) for u in updates))
    assert [float(value) for *_, value in rows] == validation_metric(log_text, "accepted_lossless")
