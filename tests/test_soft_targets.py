"""The drafter's soft targets (``--teacher-verifier``): the verifier's distribution read for each
label, the mixed loss, and fairseq-train with it end to end."""

import re

import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss

from spec_nmt.criterions.spec_drafter_loss import SpecDrafterLoss
from spec_nmt.errors import SpecNmtError
from tests.conftest import BLOCK_SIZE, train_drafter


def cached_drafter_batch(toy, sentences=12, cuts=3):
    (drafter,), _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(toy["cached_drafter"])], arg_overrides={"data": str(toy["bin"])}
    )
    task.cfg.cuts_per_sentence = cuts
    task.load_dataset("valid")
    dataset = task.dataset("valid")
    sample = dataset.collater([dataset[i] for i in range(sentences)])
    batch = task.drafter_sample(sample, drafter.eval(), torch.Generator().manual_seed(0))
    return task, drafter, sample, batch


def criterion_for(task, toy, weight, on_policy_weight=0.0):
    return SpecDrafterLoss(task, label_smoothing=0.1, report_first_n=BLOCK_SIZE,
                           on_policy_weight=on_policy_weight,
                           teacher_verifier=str(toy["verifier"]),
                           soft_target_weight=weight)  # fmt: skip


def test_each_label_gets_the_verifiers_distribution_after_its_own_prefix(toy):
    """Row r, block position j (cut c) must read the verifier's next-token distribution after
    BOS + y[:c + j], as a verifier pass over that prefix alone computes it."""
    task, drafter, sample, batch = cached_drafter_batch(toy)
    pad = task.target_dictionary.pad()
    is_label = batch["target"].ne(pad)
    criterion = criterion_for(task, toy, 0.5)
    teacher = criterion.teacher_lprobs(drafter, batch, is_label)
    (verifier,), _ = checkpoint_utils.load_model_ensemble([str(toy["verifier"])], task=task)
    verifier.eval()
    rows_per_sentence = batch["target"].size(0) // sample["target"].size(0)
    expected = []
    for row, cut in enumerate(batch["cuts"].tolist()):
        sentence = row // rows_per_sentence
        src_tokens = sample["net_input"]["src_tokens"][sentence : sentence + 1]
        src_lengths = sample["net_input"]["src_lengths"][sentence : sentence + 1]
        for j in range(BLOCK_SIZE):
            if not is_label[row, j]:
                continue
            eos = task.target_dictionary.eos()
            prefix = torch.tensor([[eos] + sample["target"][sentence, : cut + j].tolist()])
            with torch.no_grad():
                out = verifier(src_tokens, src_lengths, prefix)
            expected.append(verifier.get_normalized_probs(out, log_probs=True)[0, -1])
            # the label itself is the next target token after that prefix
            assert batch["target"][row, j] == sample["target"][sentence, cut + j]
    torch.testing.assert_close(teacher, torch.stack(expected), atol=1e-4, rtol=1e-4)
    # the teacher is none of the criterion's parameters, and stays in eval mode
    assert list(criterion.parameters()) == []
    criterion.train()
    assert not criterion._teacher.training


@pytest.mark.parametrize("weight", [0.0, 0.3, 1.0])
def test_the_loss_mixes_cross_entropy_and_kl_to_the_verifier(toy, weight):
    task, drafter, _, batch = cached_drafter_batch(toy)
    pad = task.target_dictionary.pad()
    target = batch["target"]
    is_label = target.ne(pad)
    criterion = criterion_for(task, toy, weight)
    loss, _, logged = criterion(drafter, batch)

    every, _ = drafter(**batch["net_input"])  # [rows, k, V + 1]: [MASK] is the last column
    lprobs = torch.log_softmax(every.float(), dim=-1)[is_label]
    cross_entropy, _ = label_smoothed_nll_loss(lprobs, target[is_label], 0.1, ignore_index=pad)
    teacher = criterion.teacher_lprobs(drafter, batch, is_label)
    assert teacher.size(1) == lprobs.size(1) - 1
    kl = (teacher.exp() * (teacher - lprobs[:, :-1])).sum()
    assert kl > 0
    torch.testing.assert_close(logged["kl"], kl.detach())
    torch.testing.assert_close(loss, (1 - weight) * cross_entropy + weight * kl)
    if weight == 1.0:  # the labels no longer count: only the teacher's distribution does
        (gradient,) = torch.autograd.grad(loss, drafter.decoder.output_projection.weight)
        assert gradient.abs().sum() > 0


def test_the_on_policy_weight_scales_each_positions_mixed_loss(toy):
    """With both terms, a position the verifier would not reach (a wrong draft before it in its
    block) drops out of the cross-entropy and the KL alike at w = 1."""
    task, drafter, _, batch = cached_drafter_batch(toy)
    pad = task.target_dictionary.pad()
    target = batch["target"]
    is_label = target.ne(pad)
    criterion = criterion_for(task, toy, 0.4, on_policy_weight=1.0)
    loss, _, _ = criterion(drafter, batch)

    every, _ = drafter(**batch["net_input"])
    lprobs = torch.log_softmax(every.float(), dim=-1)
    right = lprobs.argmax(dim=-1).eq(target) | ~is_label
    reached = torch.cat([torch.ones_like(right[:, :1]), right[:, :-1].cumprod(dim=1)], dim=1)
    reached = reached[is_label]
    assert reached.any() and not reached.all()  # both kinds of position occur
    cross_entropy, _ = label_smoothed_nll_loss(lprobs[is_label], target[is_label], 0.1,
                                               ignore_index=pad, reduce=False)  # fmt: skip
    teacher = criterion.teacher_lprobs(drafter, batch, is_label)
    kl = (teacher.exp() * (teacher - lprobs[is_label][:, :-1])).sum(dim=1)
    expected = ((0.6 * cross_entropy.squeeze(-1) + 0.4 * kl) * reached).sum()
    torch.testing.assert_close(loss, expected)


def test_the_kl_vanishes_when_the_drafter_predicts_the_teachers_distribution(toy):
    task, drafter, _, batch = cached_drafter_batch(toy, sentences=4)
    is_label = batch["target"].ne(task.target_dictionary.pad())
    criterion = criterion_for(task, toy, 1.0)
    teacher = criterion.teacher_lprobs(drafter, batch, is_label)
    with_mask_column = torch.cat([teacher, torch.full_like(teacher[:, :1], -torch.inf)], dim=1)
    divergence = criterion.teacher_divergence(drafter, batch, is_label, with_mask_column)
    torch.testing.assert_close(divergence, torch.zeros_like(divergence), atol=1e-6, rtol=0)


def test_training_with_a_teacher_logs_kl_and_the_teacher_is_no_parameter(toy, tmp_path):
    result = train_drafter(
        toy["bin"], tmp_path / "d", 30, "--arch", "cached_drafter", "--cuts-per-sentence", 2,
        "--init-from-verifier", toy["verifier"], "--teacher-verifier", toy["verifier"],
        "--soft-target-weight", 0.7,
    )  # fmt: skip
    log = result.stdout + result.stderr
    valid = [line for line in log.splitlines() if "| valid on" in line]
    assert valid and "| kl " in valid[-1], log[-3000:]
    state = checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "d" / "checkpoint_last.pt"))
    assert state["cfg"]["criterion"]["soft_target_weight"] == 0.7
    assert not any(name.startswith("_teacher") for name in state["model"])
    assert not state.get("criterion")  # where a registered teacher would have been saved


@pytest.mark.parametrize(
    "options, message",
    [({"soft_target_weight": 1.5}, "--soft-target-weight must lie in [0, 1], got 1.5"),
     ({"teacher_verifier": "missing.pt"}, "--teacher-verifier missing.pt: no such file")],
)  # fmt: skip
def test_bad_soft_target_options_are_refused_before_training(toy, options, message):
    task = cached_drafter_batch(toy, sentences=1)[0]
    with pytest.raises(SpecNmtError, match=re.escape(message)):
        SpecDrafterLoss(task, 0.1, BLOCK_SIZE, **options)


def test_a_drafter_as_teacher_is_refused(toy):
    task, drafter, _, batch = cached_drafter_batch(toy, sentences=2)
    criterion = SpecDrafterLoss(task, 0.1, BLOCK_SIZE, teacher_verifier=str(toy["drafter"]))
    with pytest.raises(SpecNmtError, match="is a drafter; give the verifier"):
        criterion(drafter, batch)


def test_a_teacher_the_cached_drafter_was_not_trained_with_is_refused(toy):
    task, drafter, _, batch = cached_drafter_batch(toy, sentences=2)
    criterion = SpecDrafterLoss(task, 0.1, BLOCK_SIZE, teacher_verifier=str(toy["ar_drafter"]))
    with pytest.raises(SpecNmtError, match="trained on another verifier's encoder"):
        criterion(drafter, batch)
