"""Training the Spec-Drafter with fairseq-train: the block batches, falling loss, resuming."""

import argparse
import re
import shutil

import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss
from fairseq.data import Dictionary
from omegaconf import OmegaConf

from spec_nmt.criterions.spec_drafter_loss import SpecDrafterLoss
from spec_nmt.drafters.spec_drafter import MASK_SYMBOL
from spec_nmt.drafters.verifier_layout import adopt_verifier_layout
from spec_nmt.errors import SpecNmtError
from spec_nmt.task import SpecTranslationConfig, SpecTranslationTask
from tests.conftest import BLOCK_SIZE, drafter_training, fairseq, train_drafter, train_losses
from tests.test_errors import assert_one_line_error


def load_toy_drafter(toy):
    (drafter,), _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(toy["drafter"])], arg_overrides={"data": str(toy["bin"])}
    )
    return task, drafter.eval()


@pytest.mark.parametrize("cuts_per_sentence", [1, 3])
def test_drafter_batches_are_prefix_plus_masks_with_next_k_labels(cuts_per_sentence):
    dictionary = Dictionary()
    for i in range(20):
        dictionary.add_symbol(f"w{i}")
    k, m = 3, cuts_per_sentence
    config = SpecTranslationConfig(block_size=k, cuts_per_sentence=m)
    task = SpecTranslationTask(config, dictionary, dictionary)
    pad, eos = dictionary.pad(), dictionary.eos()
    mask = task.drafter_dictionaries()[1].index(MASK_SYMBOL)
    assert mask == len(dictionary)  # appended: every other index is unchanged
    target = torch.tensor([[5, 6, 7, 8, 9, eos], [10, 11, eos, pad, pad, pad]])
    sample = {"id": torch.tensor([0, 1]), "target": target, "net_input": {}}
    cuts_seen = [set(), set()]
    for seed in range(200):
        out = task.drafter_sample(sample, None, torch.Generator().manual_seed(seed))
        assert out["net_input"]["prev_output_tokens"].size(0) == 2 * m
        for row in range(2 * m):
            sentence, stratum = divmod(row, m)  # a sentence's cuts are consecutive rows
            decoder_input = out["net_input"]["prev_output_tokens"][row].tolist()
            cut = decoder_input.index(mask) - 1
            cuts_seen[sentence].add(cut)
            real = [t for t in target[sentence].tolist() if t != pad]
            assert stratum * len(real) // m <= cut < -(-(stratum + 1) * len(real) // m)
            expected_input = [eos] + real[:cut] + [mask] * k
            assert decoder_input[: len(expected_input)] == expected_input
            assert set(decoder_input[len(expected_input) :]) <= {pad}
            labels = real[cut : cut + k]
            assert out["target"][row].tolist() == labels + [pad] * (k - len(labels))
        assert out["ntokens"] == int(out["target"].ne(pad).sum())
    assert cuts_seen == [set(range(6)), set(range(3))]  # every cut point, EOS block included


def test_several_cuts_share_one_encoder_pass(toy):
    """Rows for several cuts of one sentence score as if each had its own copy of the source."""
    task, drafter = load_toy_drafter(toy)
    src = torch.tensor([[4, 5, 6, 2], [7, 8, 9, 2]])
    mask = task.drafter_dictionaries()[1].index(MASK_SYMBOL)
    masks, pad = [mask] * BLOCK_SIZE, task.target_dictionary.pad()
    prev = torch.tensor([[2, *masks, pad], [2, 10, *masks], [2, *masks, pad], [2, 11, *masks]])
    with torch.no_grad():
        shared, _ = drafter(src, torch.tensor([4, 4]), prev)
        copied, _ = drafter(src.repeat_interleave(2, dim=0), torch.full((4,), 4), prev)
    torch.testing.assert_close(shared, copied)


@pytest.mark.parametrize(
    "flags, message",
    [({"cuts_per_sentence": 0}, "--cuts-per-sentence must be >= 1, got 0"),
     ({"eval_acceptance_sentences": -1}, "--eval-acceptance-sentences must be >= 0, got -1"),
     ({"eval_acceptance_sentences": 100}, "give that too")],
)  # fmt: skip
def test_bad_drafter_training_flags_are_refused_in_one_line(flags, message):
    dictionary = Dictionary()
    with pytest.raises(SpecNmtError, match=message):
        SpecTranslationTask(SpecTranslationConfig(**flags), dictionary, dictionary)
    with_verifier = SpecTranslationConfig(eval_acceptance_sentences=100,
                                          eval_acceptance_verifier="verifier.pt")  # fmt: skip
    SpecTranslationTask(with_verifier, dictionary, dictionary)


def test_training_a_drafter_without_masks_is_refused_in_one_line(toy, tmp_path):
    # the console script itself: a refused training prints one line, no traceback
    training = drafter_training(toy["bin"], tmp_path / "d", 1, "--block-size", 0)
    refused = fairseq("train", *training, check=False)
    assert_one_line_error(refused, "a drafter trains on k >= 1 masks")
    assert not (tmp_path / "d" / "checkpoint_last.pt").exists()


def test_drafter_loss_falls_and_reports_block_accuracy(toy):
    losses = train_losses(toy["drafter_log"])
    assert len(losses) >= 10
    assert losses[-1] < 0.75 * losses[0], losses
    valid_lines = [line for line in toy["drafter_log"].splitlines() if "| valid on" in line]
    for metric in ("acc", "lead", "first1", "first5"):
        assert f"| {metric} " in valid_lines[-1]


def test_training_resumes_from_checkpoint_last(toy, tmp_path):
    save_dir = tmp_path / "drafter"
    shutil.copytree(toy["drafter_dir"], save_dir)
    output = train_drafter(toy["bin"], save_dir, 350)
    assert re.search(r"Loaded checkpoint .*checkpoint_last\.pt \(epoch \d+ @ 300 updates\)", output)
    assert "num_updates 350" in output
    assert len(train_losses(output)) >= 1


def test_verifier_layout_is_adopted_for_the_copied_parts_in_namespace_and_hydra_configs():
    verifier = argparse.Namespace(encoder_normalize_before=True, decoder_normalize_before=True,
                                  activation_fn="gelu")  # fmt: skip
    hydra = OmegaConf.create({"encoder_normalize_before": False, "dropout": 0.1})
    OmegaConf.set_struct(hydra, True)  # as fairseq's: new keys need open_dict
    for drafter in (argparse.Namespace(encoder_normalize_before=False, dropout=0.1), hydra):
        adopt_verifier_layout(drafter, verifier, "verifier.pt", ("encoder.",))
        assert drafter.encoder_normalize_before is True and drafter.activation_fn == "gelu"
        assert drafter.dropout == 0.1
        assert getattr(drafter, "decoder_normalize_before", None) is None  # not copied
    adopt_verifier_layout(hydra, verifier, "verifier.pt", ("encoder.", "decoder."))
    assert hydra.decoder_normalize_before is True


@pytest.mark.parametrize("drafter_name", ["drafter", "cached_drafter"])
def test_the_loss_scores_only_the_labelled_masks_and_equals_scoring_all(toy, drafter_name):
    """The criterion has the model score only masks with a label; its loss, the loss's gradient,
    accuracy and leading-run counts equal those from every mask's logits."""
    (drafter,), _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(toy[drafter_name])], arg_overrides={"data": str(toy["bin"])}
    )
    drafter.eval()
    task.load_dataset("valid")
    dataset = task.dataset("valid")
    sample = dataset.collater([dataset[i] for i in range(16)])
    batch = task.drafter_sample(sample, drafter, torch.Generator().manual_seed(0))
    pad = task.target_dictionary.pad()
    target = batch["target"]
    assert target.eq(pad).any() and target.ne(pad).any()  # masks past an EOS: some are skipped
    criterion = SpecDrafterLoss(task, label_smoothing=0.1, report_first_n=BLOCK_SIZE)
    output_weight = drafter.decoder.output_projection.weight
    loss, sample_size, logged = criterion(drafter, batch)
    (gradient,) = torch.autograd.grad(loss, output_weight)
    with torch.no_grad():
        scored, _ = drafter(**batch["net_input"], scored=target.ne(pad))
    assert scored.shape == (int(target.ne(pad).sum()), output_weight.size(0))
    every, _ = drafter(**batch["net_input"])  # [rows, k, V]
    lprobs = torch.log_softmax(every.float(), dim=-1)
    expected, _ = label_smoothed_nll_loss(lprobs.view(-1, lprobs.size(-1)), target.view(-1), 0.1,
                                          ignore_index=pad)  # fmt: skip
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(gradient, torch.autograd.grad(expected, output_weight)[0])
    assert sample_size == batch["ntokens"] == int(target.ne(pad).sum())
    right = lprobs.argmax(dim=-1).eq(target)
    assert logged["n_correct"] == int((right & target.ne(pad)).sum())
    leading = (right | target.eq(pad)).long().cumprod(dim=1)
    for n in range(1, BLOCK_SIZE + 1):
        assert logged[f"first{n}_count"] == int(leading[:, n - 1].sum())


class FixedDrafter(torch.nn.Module):
    """Hands the criterion fixed logits [rows, k, V] for the masks it asks to score."""

    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, scored):
        return self.logits[scored], None

    def get_normalized_probs(self, net_output, log_probs):
        return torch.log_softmax(net_output[0], dim=-1)


@pytest.mark.parametrize("on_policy_weight", [0.0, 0.5, 1.0])
def test_on_policy_weight_discounts_positions_after_a_wrong_draft(on_policy_weight):
    """Row 0 drafts its first label wrong, so the verifier never reaches positions 2 and 3; row 1
    drafts its first right and its second wrong. Each position's smoothed loss is weighted by
    1 - w, plus w where every earlier draft of its row is right."""
    dictionary = Dictionary()
    for i in range(4):
        dictionary.add_symbol(f"w{i}")
    task = argparse.Namespace(target_dictionary=dictionary)
    pad, v = dictionary.pad(), len(dictionary)
    a, b, c = dictionary.index("w0"), dictionary.index("w1"), dictionary.index("w2")
    target = torch.tensor([[a, b, c], [b, c, pad]])
    drafts = torch.tensor([[c, b, c], [b, a, a]])  # argmax per mask
    logits = torch.nn.functional.one_hot(drafts, v).float() * 2.0 + 0.1 * torch.arange(v)
    criterion = SpecDrafterLoss(task, label_smoothing=0.1, report_first_n=3,
                                on_policy_weight=on_policy_weight)  # fmt: skip
    sample = {"target": target, "net_input": {}, "ntokens": 5}
    loss, sample_size, logged = criterion(FixedDrafter(logits), sample)
    lprobs = torch.log_softmax(logits, dim=-1)
    eps_i = 0.1 / (v - 1)
    reached = {(0, 0): 1, (0, 1): 0, (0, 2): 0, (1, 0): 1, (1, 1): 1}
    expected = sum(
        (1 - on_policy_weight + on_policy_weight * hit)
        * (-(0.9 - eps_i) * lprobs[row, i, target[row, i]] - eps_i * lprobs[row, i].sum())
        for (row, i), hit in reached.items()
    )
    torch.testing.assert_close(loss, expected)
    nll = -sum(lprobs[row, i, target[row, i]] for row, i in reached)
    torch.testing.assert_close(logged["nll_loss"], nll)  # reported unweighted
    assert sample_size == 5 and logged["n_correct"] == 3
    assert [logged[f"first{n}_count"] for n in (1, 2, 3)] == [1, 0, 0]


def test_an_on_policy_weight_outside_zero_to_one_is_refused_in_one_line():
    task = argparse.Namespace(target_dictionary=Dictionary())
    with pytest.raises(SpecNmtError, match=r"--on-policy-weight must lie in \[0, 1\], got 1.5"):
        SpecDrafterLoss(task, label_smoothing=0.1, report_first_n=3, on_policy_weight=1.5)
