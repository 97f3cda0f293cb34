"""The draft vocabulary (scripts/export_model.py --draft-vocab-size): a NAR drafter that drafts
only the target symbols its training data uses most. Its drafts are the whole projection's best
tokens among those symbols, lossless decoding stays the verifier's greedy output, and a bad
vocabulary in a checkpoint is refused in one line."""

import copy

import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.data import Dictionary

from spec_nmt.checkpoint_loading import save_checkpoint
from spec_nmt.decoding import tree as trees
from spec_nmt.drafters.cached_drafting import CachedDrafter
from spec_nmt.drafters.spec_drafter import NarDrafter, output_size, restrict_output
from spec_nmt.errors import SpecNmtError
from spec_nmt.loading import DRAFT_VOCABULARY_KEY, read_draft_vocabulary
from spec_nmt.settings import DraftPlan
from tests.conftest import BLOCK_SIZE, USER_DIR, fairseq_error, script_module
from tests.test_cached_drafter import load_pair
from tests.test_lossless import generate, hypotheses, mean_accepted

export_model = script_module("export_model")


def test_the_vocabulary_is_the_most_frequent_symbols_with_eos_and_without_specials():
    dictionary = Dictionary()  # <s> 0, <pad> 1, </s> 2, <unk> 3, then a .. f
    for symbol in "abcdef":
        dictionary.add_symbol(symbol)
    dictionary.add_symbol("[MASK]")  # 10
    #                      <s> <pad> </s> <unk>  a  b  c  d  e  f  [MASK]
    counts = torch.tensor([50, 50, 1, 7, 9, 0, 7, 30, 2, 7, 99])
    pick = export_model.draft_vocabulary
    assert pick(counts, dictionary, 1).tolist() == [2]  # EOS first, whatever its count
    assert pick(counts, dictionary, 3).tolist() == [2, 4, 7]  # then d (30), a (9)
    assert pick(counts, dictionary, 4).tolist() == [2, 3, 4, 7]  # ties (7): the lower id
    # never BOS, PAD, [MASK] or an unseen symbol (b), however many are asked for
    assert pick(counts, dictionary, 100).tolist() == [2, 3, 4, 6, 7, 8, 9]


def test_the_counts_are_the_training_targets(toy):
    counts = export_model.target_counts(toy["bin"], "de", "en")
    targets = (toy["raw"] / "train.en").read_text().splitlines()
    dictionary = Dictionary.load(str(toy["bin"] / "dict.en.txt"))
    assert int(counts[dictionary.eos()]) == len(targets)
    word = targets[0].split()[0]
    assert int(counts[dictionary.index(word)]) == sum(line.split().count(word) for line in targets)
    assert int(counts.sum()) == sum(len(line.split()) + 1 for line in targets)


def restricted(adapter_class, drafter, dictionary, vocabulary):
    model = copy.deepcopy(drafter)
    restrict_output(model.decoder, vocabulary)
    assert output_size(model.decoder) == vocabulary.numel()
    return adapter_class(model, dictionary.pad(), dictionary.eos(), vocabulary)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["cached", "spec"])
def test_drafts_are_the_whole_projections_best_among_the_vocabulary(toy, kind):
    """Same prefixes, same model: the restricted drafter's logits are the whole projection's
    columns of its vocabulary, its greedy drafts their best tokens, and its sampled drafts'
    distributions put nothing outside it."""
    task, drafter, verifier = load_pair(toy, "cached_drafter" if kind == "cached" else "drafter")
    dictionary = task.target_dictionary
    adapter_class = CachedDrafter if kind == "cached" else NarDrafter
    # every other symbol: many best tokens of the whole projection fall outside
    vocabulary = torch.cat([torch.tensor([dictionary.eos()]),
                            torch.arange(dictionary.nspecial, len(dictionary), 2)])  # fmt: skip
    vocabulary = vocabulary.sort().values
    whole = adapter_class(drafter, dictionary.pad(), dictionary.eos())
    part = restricted(adapter_class, drafter, dictionary, vocabulary)
    pad, eos = dictionary.pad(), dictionary.eos()
    src = torch.tensor([[pad, 9, 10, 11, eos], [12, 13, 14, 15, eos]])
    net_input = {"src_tokens": src, "src_lengths": src.ne(pad).sum(1)}
    encoder_out = verifier.encoder.forward_torchscript(net_input)
    tokens = torch.full((2, 30), pad)
    tokens[:, 0] = eos
    tokens[:, 1:4] = torch.tensor([[20, 21, 22], [23, 24, 25]])
    lengths = torch.tensor([3, 2])
    k = BLOCK_SIZE
    full_logits = whole.position_logits(whole.start(net_input, encoder_out), tokens, lengths, k)
    logits = part.position_logits(part.start(net_input, encoder_out), tokens, lengths, k)
    torch.testing.assert_close(logits, full_logits[:, :, vocabulary])
    outside = full_logits.max(-1).indices != vocabulary[logits.max(-1).indices]
    assert outside.any()  # the test would notice drafts from outside

    chain = part.propose(part.start(net_input, encoder_out), tokens, lengths,
                         DraftPlan.chain(k, sample=False), None)  # fmt: skip
    best = vocabulary[full_logits[:, :, vocabulary].max(-1).indices]
    valid = chain.valid
    assert torch.equal(chain.tokens[valid], best[valid])

    beam = part.propose(part.start(net_input, encoder_out), tokens, lengths,
                        DraftPlan(beam_width=2, beam_depth=k), None)  # fmt: skip
    restricted_logprobs = full_logits[:, :, vocabulary].log_softmax(-1)
    best_logprobs, best_columns = restricted_logprobs.topk(2, dim=-1)
    expected = trees.beam_tree(best_logprobs, vocabulary[best_columns], 2, eos)
    for field in ("tokens", "parents", "valid"):
        assert torch.equal(getattr(beam, field), getattr(expected, field)), field

    sampled = part.propose(part.start(net_input, encoder_out), tokens, lengths,
                           DraftPlan.chain(k, sample=True), torch.Generator().manual_seed(0))
    excluded = torch.ones(len(dictionary), dtype=torch.bool)
    excluded[vocabulary] = False
    assert sampled.draft_probs[:, :, excluded].max() == 0
    torch.testing.assert_close(sampled.draft_probs.sum(-1), torch.ones(2, k + 1))
    assert bool(torch.isin(sampled.tokens[sampled.valid], vocabulary).all())


def with_vocabulary(toy, drafter_name, tmp_path, vocabulary):
    """A copy of a toy drafter checkpoint that carries ``vocabulary``."""
    state = checkpoint_utils.load_checkpoint_to_cpu(str(toy[drafter_name]))
    state[DRAFT_VOCABULARY_KEY] = vocabulary
    path = tmp_path / f"{drafter_name}-vocabulary.pt"
    save_checkpoint(state, path)
    return path


def test_exporting_without_a_vocabulary_drops_one_the_drafter_had(toy, tmp_path):
    source = with_vocabulary(toy, "cached_drafter", tmp_path, torch.tensor([2, 4, 5]))
    export_model.compact_checkpoint(source, tmp_path / "again.pt")
    again = checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "again.pt"))
    assert DRAFT_VOCABULARY_KEY not in again and "model" in again


@pytest.mark.parametrize("drafter", ["cached_drafter", "drafter"])
def test_lossless_decoding_with_a_vocabulary_is_stock_greedy(toy, tmp_path, drafter):
    """Drafts from the 20 most frequent target symbols only: fairseq-generate still outputs
    stock greedy's translations, and enough drafts are accepted to matter."""
    dictionary = Dictionary.load(str(toy["bin"] / "dict.en.txt"))
    counts = export_model.target_counts(toy["bin"], "de", "en")
    vocabulary = export_model.draft_vocabulary(counts, dictionary, 20)
    paths = {**toy, "restricted": with_vocabulary(toy, drafter, tmp_path, vocabulary)}
    output = generate(paths, 16, "restricted")
    stock = hypotheses(generate(toy, 16))
    assert hypotheses(output) == stock
    assert mean_accepted(output) > 0.3


BAD_VOCABULARIES = [
    (torch.tensor([2.0, 4.0]), "non-empty 1-d tensor of symbol ids"),
    (torch.tensor([], dtype=torch.long), "non-empty 1-d tensor of symbol ids"),
    (torch.tensor([[2, 4]]), "non-empty 1-d tensor of symbol ids"),
    ([2, 4], "non-empty 1-d tensor of symbol ids"),
    (torch.tensor([4, 2]), "ascending and distinct"),
    (torch.tensor([2, 4, 4]), "ascending and distinct"),
    (torch.tensor([2, 100000]), "symbols of the"),
    (torch.tensor([-1, 2]), "symbols of the"),
    (torch.tensor([1, 2, 4]), "hold EOS and not PAD"),
    (torch.tensor([4, 5]), "hold EOS and not PAD"),
]


@pytest.mark.parametrize("vocabulary,message", BAD_VOCABULARIES)
def test_a_bad_vocabulary_is_refused_in_one_line(toy, vocabulary, message):
    dictionary = Dictionary.load(str(toy["bin"] / "dict.en.txt"))
    state = {DRAFT_VOCABULARY_KEY: vocabulary}
    with pytest.raises(SpecNmtError, match=message) as error:
        read_draft_vocabulary(state, "d.pt", dictionary, autoregressive=False)
    assert "\n" not in str(error.value) and "d.pt" in str(error.value)
    assert read_draft_vocabulary({}, "d.pt", dictionary, autoregressive=False) is None


def test_an_autoregressive_drafter_with_a_vocabulary_is_refused_in_one_line(toy, tmp_path):
    path = with_vocabulary(toy, "ar_drafter", tmp_path, torch.tensor([2, 4, 5]))
    message = fairseq_error(
        "generate", toy["bin"], "--path", toy["verifier"], "--task", "spec_translation",
        "--drafter-path", path, "--user-dir", USER_DIR, "--cpu",
    )  # fmt: skip
    assert "only the NAR drafters (Spec-Drafter, cached) and the feature drafter draft over a " \
        "vocabulary" in message
