"""The cached drafter's CTC form (--ctc-upsample, drafters/ctc.py): the collapse of slots into
drafts, the loss on a hand-built distribution, and a toy CTC drafter that trains and decodes
fairseq greedy's translations with its drafts accepted, on the dynamic loop and the static one
alike."""

import argparse

import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.data import Dictionary

from spec_nmt.criterions.spec_drafter_loss import SpecDrafterLoss
from spec_nmt.decoding.loop import SpeculativeGenerator
from spec_nmt.decoding.scorer import BlockScorer
from spec_nmt.drafters.ctc import collapse
from spec_nmt.errors import SpecNmtError
from spec_nmt.loading import load_drafter
from spec_nmt.settings import DecodingSettings
from spec_nmt.task import SpecTranslationConfig, SpecTranslationTask
from tests.conftest import drafter_training, fairseq_error, fairseq_in_process, train_drafter
from tests.test_lossless import DRAFT_IN_BATCHES, generate_flags, hypotheses, mean_accepted

BLANK = 9


def test_collapse_merges_repeats_drops_blanks_and_keeps_the_first_k():
    best = torch.tensor([
        [BLANK, 5, 5, BLANK, 5, 6, 6, 7, BLANK, 8],  # a blank between two 5s keeps both
        [BLANK] * 10,  # nothing drafted
        [1, 2, 3, 4, 5, 6, 7, 8, 1, 2],  # more tokens than k
        [3, 3, 3, BLANK, BLANK, BLANK, BLANK, BLANK, BLANK, 4],  # fewer than k
    ])  # fmt: skip
    drafts, filled = collapse(best, BLANK, 4)
    assert drafts.tolist() == [[5, 5, 6, 7], [BLANK] * 4, [1, 2, 3, 4], [3, 4, BLANK, BLANK]]
    assert filled.tolist() == [[True] * 4, [False] * 4, [True] * 4, [True, True, False, False]]


class SlotDrafter(torch.nn.Module):
    """Hands the criterion fixed logits [rows, slots, V] for every slot, as a CTC drafter's
    forward does."""

    def __init__(self, logits, blank):
        super().__init__()
        self.logits = logits
        self.ctc_upsample = 2
        self.decoder = argparse.Namespace(mask_idx=blank)

    def forward(self, **unused):
        return self.logits, None

    def get_normalized_probs(self, net_output, log_probs):
        return torch.log_softmax(net_output[0], dim=-1)


def ctc_criterion(**options):
    dictionary = Dictionary()
    for i in range(3):
        dictionary.add_symbol(f"w{i}")
    task = argparse.Namespace(target_dictionary=dictionary)
    return dictionary, SpecDrafterLoss(task, label_smoothing=0.1, report_first_n=2, **options)


def test_ctc_loss_sums_every_alignment_of_the_labels_to_the_slots():
    """Two slots for one label a (k = 2, the second place past the EOS): the alignments are
    a a, a _ and _ a. Row 1's slots draft b a, which collapses to b a: its first draft is
    wrong."""
    dictionary, criterion = ctc_criterion()
    blank = len(dictionary)
    pad, a, b = dictionary.pad(), dictionary.index("w0"), dictionary.index("w1")
    probs = torch.full((2, 2, blank + 1), 0.01)
    probs[0, 0, a], probs[0, 0, blank] = 0.6, 0.3
    probs[0, 1, a], probs[0, 1, blank] = 0.2, 0.7
    probs[1, 0, b], probs[1, 0, a] = 0.5, 0.4
    probs[1, 1, a] = 0.9
    probs /= probs.sum(dim=-1, keepdim=True)
    target = torch.tensor([[a, pad], [a, b]])
    sample = {"target": target, "net_input": {}, "ntokens": 3}
    loss, sample_size, logged = criterion(SlotDrafter(probs.log(), blank), sample)
    p = probs
    row0 = p[0, 0, a] * p[0, 1, a] + p[0, 0, a] * p[0, 1, blank] + p[0, 0, blank] * p[0, 1, a]
    row1 = p[1, 0, a] * p[1, 1, b]  # two labels in two slots: one alignment
    torch.testing.assert_close(loss, -(row0.log() + row1.log()))
    assert sample_size == 3
    assert logged["n_correct"] == 1  # row 0's a (row 1 drafts b a against a b)
    assert [logged["first1_count"], logged["first2_count"]] == [1, 1]  # row 0 (its pad counts)


def test_ctc_with_an_on_policy_weight_is_refused_in_one_line():
    dictionary, criterion = ctc_criterion(on_policy_weight=0.5)
    logits = torch.zeros(1, 2, len(dictionary) + 1)
    sample = {"target": torch.tensor([[dictionary.eos(), dictionary.pad()]]), "net_input": {},
              "ntokens": 1}  # fmt: skip
    with pytest.raises(SpecNmtError, match="one loss per block"):
        criterion(SlotDrafter(logits, len(dictionary)), sample)


@pytest.fixture(scope="module")
def ctc_drafter(toy, tmp_path_factory):
    """The toy cached drafter trained on with CTC over two slots per draft."""
    save_dir = tmp_path_factory.mktemp("ctc_drafter")
    log = train_drafter(
        toy["bin"], save_dir, 120, "--arch", "cached_drafter", "--cuts-per-sentence", 3,
        "--init-from-verifier", toy["verifier"], "--ctc-upsample", 2,
        "--finetune-from-model", toy["cached_drafter"],
    )  # fmt: skip
    return save_dir / "checkpoint_last.pt", log


def test_a_ctc_drafter_trains_and_decodes_greedy_output_with_drafts_accepted(toy, ctc_drafter):
    path, log = ctc_drafter
    assert "loss=nan" not in log and "loss=inf" not in log
    for batch_size in (1, 16):
        greedy = hypotheses(fairseq_in_process("generate", *generate_flags(toy, batch_size)))
        flags = generate_flags(toy, batch_size, "cached_drafter", *DRAFT_IN_BATCHES)
        flags[flags.index(toy["cached_drafter"])] = path
        output = fairseq_in_process("generate", *flags)
        assert hypotheses(output) == greedy
        assert mean_accepted(output) > 0.3  # drafting was on


def test_a_ctc_drafter_refuses_sampling_in_one_line(toy, ctc_drafter):
    flags = generate_flags(toy, 1, "cached_drafter", "--verify", "sampling")
    flags[flags.index(toy["cached_drafter"])] = ctc_drafter[0]
    assert "drafts greedy chains only" in fairseq_error("generate", *flags)


def test_one_slot_per_draft_is_not_ctc_and_is_refused_in_one_line(toy, tmp_path):
    training = drafter_training(
        toy["bin"], tmp_path / "d", 1, "--arch", "cached_drafter",
        "--init-from-verifier", toy["verifier"], "--ctc-upsample", 1,
    )  # fmt: skip
    assert "--ctc-upsample must be 0 (no CTC) or at least 2" in fairseq_error("train", *training)


@pytest.mark.parametrize("sentences_per_batch", [1, 8])
def test_the_static_loop_drafts_and_accepts_what_the_dynamic_loop_does(toy, ctc_drafter,
                                                                       sentences_per_batch):
    """The CTC drafter's static form (its slots collapsed on the device, empty places drafting
    PAD) accepts, sentence by sentence, the drafts the dynamic loop accepts, and both count
    the same drafts proposed (an empty place is none)."""
    # fp32 drafts: bf16 ones round by kernel shape, and the two loops' blocks differ in shape
    cfg = SpecTranslationConfig(data=str(toy["bin"]), source_lang="de", target_lang="en",
                                dataset_impl="mmap", required_seq_len_multiple=1,
                                drafter_precision="fp32")  # fmt: skip
    task = SpecTranslationTask.setup_task(cfg)
    task.load_dataset("valid")
    dataset = task.dataset("valid")
    (verifier,), _ = checkpoint_utils.load_model_ensemble([str(toy["verifier"])], task=task)
    verifier.eval()
    drafter = load_drafter(task, str(ctc_drafter[0]), verifier)
    found, drafted = {}, {}
    for loop in ("dynamic", "static"):
        generator = SpeculativeGenerator(
            BlockScorer(verifier), drafter, task.target_dictionary,
            DecodingSettings(block_size=4, max_draft_batch=0, max_len_a=0, max_len_b=200,
                             decoding_loop=loop))  # fmt: skip
        assert generator.on_static_loop == (loop == "static")
        found[loop] = {}
        with torch.no_grad():
            for start in range(0, 16, sentences_per_batch):
                sample = dataset.collater([dataset[i] for i in range(start, start +
                                                                       sentences_per_batch)])
                for index, hypotheses in zip(sample["id"].tolist(),
                                             generator.generate([verifier], sample)):
                    best = hypotheses[0]
                    found[loop][index] = (best["tokens"].tolist(), best["spec_accepted_tokens"],
                                          best["spec_iterations"])  # fmt: skip
        assert generator.stats.accepted_tokens > 0
        drafted[loop] = generator.stats.drafted_tokens
    assert found["static"] == found["dynamic"]
    assert drafted["static"] == drafted["dynamic"]
