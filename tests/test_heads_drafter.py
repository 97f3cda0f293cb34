"""The heads drafter: only its heads train, decoding hands it the verifier state that chose each
pending token (the state its training reads), it drafts nothing before the verifier's first call,
and it refuses other verifiers and blocks deeper than its heads."""

import pytest
import torch
from fairseq import checkpoint_utils

from spec_nmt.decoding.drafters import HeadsDrafter
from spec_nmt.decoding.generator import SpeculativeGenerator
from spec_nmt.decoding.settings import DEFAULTS
from spec_nmt.decoding.verifier import TransformerVerifier
from spec_nmt.errors import SpecNmtError
from tests.conftest import BLOCK_SIZE, assert_refuses_changed_decoder, train_drafter


@pytest.fixture(scope="module")
def pair(toy):
    (drafter,), _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(toy["heads_drafter"])], arg_overrides={"data": str(toy["bin"])}
    )
    (verifier,), _ = checkpoint_utils.load_model_ensemble([str(toy["verifier"])], task=task)
    return task, drafter.eval(), verifier.eval()


def test_only_the_heads_train(pair):
    """300 updates left the verifier copy as it was (the check compares every tensor of the
    encoder and decoder) and moved the heads from their identity start."""
    _, drafter, verifier = pair
    drafter.check_verifier_matches(verifier)
    assert drafter.heads.heads.weight.abs().sum() > 0
    trainable = {name for name, p in drafter.named_parameters() if p.requires_grad}
    assert trainable == {f"heads.{layer}.{name}"
                         for layer in ("mix", "query", "source_out", "fc1", "fc2", "heads")
                         for name in ("weight", "bias")}  # fmt: skip


def test_another_verifier_decoder_is_refused(pair):
    _, drafter, verifier = pair
    assert_refuses_changed_decoder(drafter, verifier)


def generate_with_records(pair, settings, sources):
    """Decode each source alone; per iteration, the drafter's state after its commit and the
    verified length it belongs to."""
    task, drafter, verifier_model = pair
    dictionary = task.target_dictionary
    adapter = HeadsDrafter(drafter, dictionary.pad(), dictionary.eos())
    generator = SpeculativeGenerator(TransformerVerifier(verifier_model), adapter, dictionary,
                                     settings)  # fmt: skip
    commit = adapter.commit
    results = []
    for source in sources:
        choosers = []

        def recording_commit(state, *args, **kwargs):
            commit(state, *args, **kwargs)
            choosers.append(state.chooser.clone())

        adapter.commit = recording_commit
        src = torch.tensor([source])
        sample = {"net_input": {"src_tokens": src, "src_lengths": torch.tensor([len(source)])}}
        trace = []
        output = generator.generate([verifier_model], sample, trace=trace)[0][0]["tokens"]
        results.append((src, output, trace, choosers))
    adapter.commit = commit
    return results


@torch.no_grad()
@pytest.mark.parametrize("verify, branching", [("top_beta", None), ("top_beta", "2,2,1"),
                                               ("rsd", "2,2,1")])  # fmt: skip
def test_decoding_drafts_from_the_state_that_chose_the_pending_token(pair, toy, verify, branching):
    """After every iteration (chains, and trees whose kept entries are not the block's first),
    the drafter holds the verifier state its training forward computes before the pending
    token, and the first iteration drafts nothing."""
    task, drafter, _ = pair
    eos = task.target_dictionary.eos()
    settings = DEFAULTS.replace(block_size=BLOCK_SIZE, verify=verify, tree_branching=branching)
    sources = ([9, 10, 11, 12, eos], [13, 14, 15, eos], [16, 17, 18, 19, 20, 21, eos])
    moved = 0
    for src, output, trace, choosers in generate_with_records(pair, settings, sources):
        assert trace[0].draft_tokens == [] and len(trace) == len(choosers)
        assert all(record.draft_tokens for record in trace[1:])
        decoder_input = torch.cat([torch.tensor([eos]), output]).unsqueeze(0)
        encoder_out = drafter.encoder(src, torch.tensor([src.size(1)]))
        states, _ = drafter.decoder.extract_features(decoder_input, encoder_out)
        for record, chooser in zip(trace, choosers):
            length = len(record.prefix) + len(record.accepted_path) + 1
            if record.ended_by_accepted_eos:
                continue  # no token follows the accepted EOS: nothing drafts from this state
            torch.testing.assert_close(chooser[0], states[0, length - 1], atol=1e-5, rtol=1e-5)
            moved += any(a != i for i, a in enumerate(record.accepted_path))
    if branching:
        assert moved > 0  # some kept paths were not the block's first entries


@torch.no_grad()
def test_drafts_are_what_the_training_forward_predicts(pair):
    """The drafts of an iteration are the training forward's best tokens for a cut at the
    pending token."""
    task, drafter, _ = pair
    eos = task.target_dictionary.eos()
    mask = drafter.decoder.dictionary.index("[MASK]")
    settings = DEFAULTS.replace(block_size=BLOCK_SIZE)
    ((src, output, trace, _),) = generate_with_records(pair, settings, [[9, 10, 11, 12, eos]])
    checked = 0
    for record in trace[1:]:
        cut = len(record.prefix)  # BOS + prefix: entries 0 .. cut, the pending token last
        decoder_input = torch.cat([torch.tensor([eos]), output[:cut]]).unsqueeze(0)
        masks = torch.full((1, BLOCK_SIZE), mask)
        logits, _ = drafter(src, torch.tensor([src.size(1)]), torch.cat([decoder_input, masks], 1),
                            cuts=torch.tensor([[cut]]))  # fmt: skip
        logits[..., task.target_dictionary.pad()] = float("-inf")
        assert record.draft_tokens == logits[0, :, :mask].argmax(-1).tolist()
        checked += 1
    assert checked > 1


def test_deeper_blocks_than_heads_are_refused_in_one_line(pair):
    settings = DEFAULTS.replace(block_size=pair[1].heads.count + 1)
    sources = ([9, 10, 11, 12, pair[0].target_dictionary.eos()],)
    with pytest.raises(SpecNmtError, match="draft heads: it drafts at most"):
        generate_with_records(pair, settings, sources)


def test_training_without_the_verifier_is_refused_in_one_line(toy, tmp_path):
    result = train_drafter(toy["bin"], tmp_path / "d", 1, "--arch", "heads_drafter", check=False)
    errors = [line for line in result.stderr.splitlines() if "spec_nmt error" in line]
    assert errors and "give --init-from-verifier VERIFIER.pt" in errors[0], result.stderr[-2000:]


def test_adaptive_blocks_start_from_block_size_after_the_empty_first_iteration(pair):
    """The first iteration drafts nothing: that is no rejection, so the next one drafts
    --block-size tokens (not 1)."""
    task, _, _ = pair
    settings = DEFAULTS.replace(block_size=4, adaptive_block=True)
    ((_, _, trace, _),) = generate_with_records(pair, settings, [[9, 10, 11, 12,
                                                                   task.target_dictionary.eos()]])
    assert trace[0].draft_tokens == [] and len(trace[1].draft_tokens) == 4


def test_a_verifier_with_its_own_output_projection_is_refused_before_training(toy, tmp_path):
    """A heads drafter ties its verifier copy's output projection to its embeddings: a verifier
    with an untied one could never be matched, so training refuses it at once."""
    state = torch.load(toy["verifier"], weights_only=False)
    weights = state["model"]
    weights["decoder.output_projection.weight"] = weights["decoder.embed_tokens.weight"] + 0.5
    untied = tmp_path / "untied.pt"
    torch.save(state, untied)
    result = train_drafter(toy["bin"], tmp_path / "d", 1, "--arch", "heads_drafter",
                           "--init-from-verifier", untied, check=False)  # fmt: skip
    errors = [line for line in result.stderr.splitlines() if "spec_nmt error" in line]
    assert errors and "has an output projection of its own" in errors[0], result.stderr[-2000:]
