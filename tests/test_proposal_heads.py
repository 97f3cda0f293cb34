"""Proposal heads trained with the verifier (``transformer_proposal_heads``, ``proposal_heads_loss``)
and the replay that measures their lossless acceptance."""

import math

import torch
from fairseq import checkpoint_utils
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss

from spec_nmt.checkpoint_loading import save_checkpoint
from spec_nmt.criterions.proposal_heads_loss import ProposalHeadsLoss
from tests.conftest import OPTIMIZATION, TINY_TRANSFORMER, USER_DIR, fairseq, script_module

HEADS = ["--arch", "transformer_proposal_heads", "--proposal-heads", 3,
         "--criterion", "proposal_heads_loss", "--label-smoothing", 0.1]  # fmt: skip


def train_heads(toy, save_dir, max_update, *extra):
    return fairseq(
        "train", toy["bin"], "--user-dir", USER_DIR, "--task", "translation_frozen_encoder",
        *TINY_TRANSFORMER, *OPTIMIZATION, *HEADS, "--max-update", max_update,
        "--finetune-from-model", toy["verifier"], "--save-dir", save_dir, *extra,
    )  # fmt: skip


def load(path, toy):
    (model,), _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(path)], arg_overrides={"data": str(toy["bin"])}
    )
    return model.eval(), task


def untrained_heads(toy, path, count=3):
    """The toy verifier's checkpoint as a ``transformer_proposal_heads`` one: no heads in it."""
    state = checkpoint_utils.load_checkpoint_to_cpu(str(toy["verifier"]))
    state["cfg"]["model"].arch = state["cfg"]["model"]._name = "transformer_proposal_heads"
    state["cfg"]["model"].proposal_heads = count
    save_checkpoint(state, path)
    return load(path, toy)


def first_batch(task, sentences):
    task.load_dataset("valid")
    iterator = task.get_batch_iterator(task.dataset("valid"), max_sentences=sentences)
    return next(iter(iterator.next_epoch_itr(shuffle=False)))


def test_untrained_heads_start_from_the_verifiers_own_prediction(toy, tmp_path):
    """A stock verifier's checkpoint loads with the heads at zero residuals: every head proposes
    what the verifier's output layer proposes from the same state, and the verifier's logits
    are stock."""
    model, task = untrained_heads(toy, tmp_path / "heads.pt")
    stock = checkpoint_utils.load_model_ensemble([str(toy["verifier"])], task=task)[0][0].eval()
    sample = first_batch(task, 4)
    with torch.no_grad():
        logits, extra = model(**sample["net_input"])
        stock_logits = stock(**sample["net_input"])[0]
        proposals = model.proposal_logits(extra["states"], sample["target"])
    assert torch.equal(logits, stock_logits)
    assert torch.allclose(proposals, logits.unsqueeze(2).expand_as(proposals), atol=1e-5)


def test_the_frozen_stage_trains_only_the_heads_and_the_joint_stage_the_decoder(toy, tmp_path):
    train_heads(toy, tmp_path / "heads", 20, "--freeze-verifier")
    model, task = load(tmp_path / "heads" / "checkpoint_last.pt", toy)
    stock = checkpoint_utils.load_model_ensemble([str(toy["verifier"])], task=task)[0][0]
    before, after = stock.state_dict(), model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert not torch.equal(model.proposal_heads.heads.weight,
                           torch.zeros_like(model.proposal_heads.heads.weight))  # fmt: skip

    fairseq(
        "train", toy["bin"], "--user-dir", USER_DIR, "--task", "translation_frozen_encoder",
        *TINY_TRANSFORMER, *OPTIMIZATION, *HEADS, "--max-update", 20,
        "--finetune-from-model", tmp_path / "heads" / "checkpoint_last.pt",
        "--save-dir", tmp_path / "joint",
    )  # fmt: skip
    joint, _ = load(tmp_path / "joint" / "checkpoint_last.pt", toy)
    after = joint.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before
               if name.startswith("encoder."))  # fmt: skip
    assert any(not torch.equal(before[name], after[name]) for name in before
               if name.startswith("decoder.layers."))  # fmt: skip


def test_the_loss_is_the_verifiers_plus_the_weighted_heads(toy, tmp_path):
    model, task = untrained_heads(toy, tmp_path / "heads.pt")
    torch.manual_seed(0)
    for parameter in model.proposal_heads.parameters():  # heads that propose something else
        parameter.data.normal_(0, 0.1)
    vocabulary = 20
    criterion = ProposalHeadsLoss(task, 0.1, 0.5, 0.8, vocabulary)
    sample = first_batch(task, 3)
    with torch.no_grad():
        loss, _, logged = criterion(model, sample)
        logits, extra = model(**sample["net_input"])
    target, pad = sample["target"], task.target_dictionary.pad()
    lprobs = torch.log_softmax(logits, dim=-1)
    expected, _ = label_smoothed_nll_loss(lprobs.view(-1, lprobs.size(-1)), target.view(-1), 0.1,
                                          ignore_index=pad)  # fmt: skip
    unscored = 0
    for row in range(target.size(0)):
        length = int(target[row].ne(pad).sum())
        for t in range(length):
            heads = torch.log_softmax(model.proposal_logits(
                extra["states"][row, t], target[row, t], vocabulary), dim=-1)  # fmt: skip
            for head in range(3):
                if t + head + 1 >= length:
                    continue
                label = int(target[row, t + head + 1])
                if label >= vocabulary:
                    unscored += 1
                    continue
                expected = expected - 0.5 * 0.8**head * heads[head, label]
    assert unscored > 0  # the test data has labels past the heads' vocabulary
    assert math.isclose(float(loss), float(expected), rel_tol=1e-4)
    assert logged["head1_labels"] >= logged["head3_labels"] > 0


def test_replay_accepts_the_leading_matches_and_moves_past_the_verifiers_token():
    replay = script_module("proposal_heads_acceptance", "benchmarks").replay
    targets = torch.tensor([5, 6, 7, 8, 9, 2])  # 2: EOS
    proposals = torch.tensor([
        [6, 7, 0],  # from y0: y1, y2 right, y3 wrong -> accept 2, the verifier adds y3
        [0, 0, 0], [0, 0, 0],
        [9, 0, 0],  # from y3: y4 right -> accept 1, the verifier adds y5 (EOS)
        [0, 0, 0], [0, 0, 0],
    ])  # fmt: skip
    assert replay(targets, proposals, 3) == (3, 2, [2, 2, 1], [2, 1, 0])
    assert replay(targets, proposals, 1) == (2, 3, [3], [2])
