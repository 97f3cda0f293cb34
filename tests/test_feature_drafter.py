"""The feature drafter (EAGLE): its unrolled training computes exactly what drafting computes,
fairseq-train trains it end to end, the acceptance simulation accounts for every token, the
decoding loop accepts what the simulation accepts (stock fairseq greedy: test_lossless.py), one
scripted call drafts a greedy chain as one call per draft does, each node of a draft tree
is drafted from its own path, and its export is compact."""

import json
import shutil
import sys
from unittest import mock

import pytest
import torch
from fairseq import checkpoint_utils

from spec_nmt.checkpoint_loading import save_checkpoint
from spec_nmt.decoding.block_forward import position_table
from spec_nmt.decoding.loop import SpeculativeGenerator
from spec_nmt.decoding.scorer import BlockScorer
from spec_nmt.drafters import feature_drafting
from spec_nmt.errors import SpecNmtError
from spec_nmt.loading import DRAFT_VOCABULARY_KEY, load_drafter
from spec_nmt.settings import DecodingSettings
from spec_nmt.task import SpecTranslationConfig, SpecTranslationTask
from tests.conftest import REPO, script_module, train_losses

sys.path.insert(0, str(REPO / "benchmarks"))
from feature_drafter import Simulation, greedy_translations  # noqa: E402
from feature_drafter import main as replay_main  # noqa: E402

UNROLL = 3  # as conftest trains it


@pytest.fixture(scope="module")
def trained(toy):
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(toy["feature_drafter"])], arg_overrides={"data": str(toy["bin"])})
    task.load_dataset("valid")
    return models[0].eval(), task, toy["feature_drafter_log"]


def test_training_lowers_the_loss_and_logs_each_step(trained):
    _, _, log = trained
    losses = train_losses(log)
    assert len(losses) >= 3 and losses[-1] < losses[0]
    assert all(f"acc{step}=" in log for step in range(1, UNROLL + 1))


def test_unrolled_steps_equal_drafting_one_step_at_a_time(trained):
    """Pass j at position t must be the drafter's j-th draft after a prefix verified up to
    t - j + 1: fed the true states there, then its own predicted states one by one."""
    model, task, _ = trained
    dataset = task.dataset("valid")
    sample = dataset.collater([dataset[i] for i in range(3)])
    net_input, target = sample["net_input"], sample["target"]
    with torch.no_grad():
        encoder_out, states = model.verifier_states(**net_input)
        positions = model.verifier.decoder.embed_positions(net_input["prev_output_tokens"])
        source = model.source_keys(encoder_out)
        unrolled = model.unrolled(states, target, positions, source)
        for row in range(3):
            length = int(target[row].ne(task.target_dictionary.pad()).sum())
            one = tuple(part[row : row + 1] if part is not None else None for part in source)
            for step in range(1, UNROLL + 1):
                for t in range(step - 1, length):
                    prefix_end = t - step + 1
                    inputs = states[row : row + 1, : t + 1].clone()
                    predicted, cache = model.extend(
                        inputs[:, : prefix_end + 1], target[row : row + 1, : prefix_end + 1],
                        positions[row : row + 1, : prefix_end + 1], one)
                    for position in range(prefix_end + 1, t + 1):
                        inputs = predicted[:, -1:]
                        where = slice(position, position + 1)
                        predicted, cache = model.extend(
                            inputs, target[row : row + 1, where], positions[row : row + 1, where],
                            one, cache)
                    torch.testing.assert_close(predicted[0, -1], unrolled[step - 1][row, t],
                                               rtol=1e-4, atol=1e-5)


def test_the_simulation_accounts_for_every_token(trained):
    model, task, _ = trained
    dataset = task.dataset("valid")
    indices = list(range(8))
    with torch.no_grad():
        translations = greedy_translations(task, model, indices, batch_size=4)
        simulation = Simulation(model, 4, task.target_dictionary.eos())
        for index in indices:
            simulation.sentence(dataset[index]["source"], translations[index])
    tokens = sum(translation.numel() for translation in translations.values())
    assert simulation.tokens == tokens
    assert tokens <= simulation.iterations + simulation.accepted <= tokens + len(indices)
    summary = simulation.summary()
    assert summary["positions_judged"][0] == simulation.iterations - len(indices)
    assert all(later <= earlier for earlier, later in
               zip(summary["positions_judged"], summary["positions_judged"][1:]))


def test_the_replay_script_reports_acceptance_and_times_drafting_when_asked(toy, tmp_path):
    out = tmp_path / "replay.json"
    # (the script sets the thread count: this process's own)
    flags = [str(toy["feature_drafter"]), "--data-bin", str(toy["bin"]), "--blocks", "3",
             "--threads", str(torch.get_num_threads()), "--json", str(out)]  # fmt: skip
    for time_lines in (0, 2):
        with mock.patch.object(sys, "argv", ["feature_drafter.py", *flags, "--lines", "6",
                                             "--time-lines", str(time_lines)]):  # fmt: skip
            replay_main()
        results = json.loads(out.read_text())
        assert results["lines"] == 6 and 0 <= results["k3"]["accepted_per_iteration"] <= 3
        timed = ("fairseq_greedy_ms_per_token" in results,
                 "drafting_greedy_steps_per_iteration" in results["k3"])  # fmt: skip
        assert timed == (bool(time_lines), bool(time_lines))
    for refused in (["--lines", "6", "--time-lines", "-1"], ["--lines", "0"]):
        with mock.patch.object(sys, "argv", ["feature_drafter.py", *flags, *refused]):
            with pytest.raises(SystemExit):
                replay_main()


@pytest.fixture(scope="module")
def spec_task(toy):
    cfg = SpecTranslationConfig(
        data=str(toy["bin"]), source_lang="de", target_lang="en", block_size=4,
        max_draft_batch=0, dataset_impl="mmap", required_seq_len_multiple=1,
    )  # fmt: skip
    task = SpecTranslationTask.setup_task(cfg)
    task.load_dataset("valid")
    return task


def test_a_drafter_of_another_verifier_is_refused(toy, spec_task):
    (other,), _ = checkpoint_utils.load_model_ensemble([str(toy["ar_drafter"])], task=spec_task)
    with pytest.raises(SpecNmtError, match="trained for another verifier"):
        load_drafter(spec_task, str(toy["feature_drafter"]), other)


@pytest.mark.parametrize("loop", ["dynamic", "static"])
@pytest.mark.parametrize("sentences_per_batch", [1, 8])
def test_the_loop_accepts_what_the_simulation_accepts(toy, trained, spec_task,
                                                      sentences_per_batch, loop):
    """Decoding with the drafter's cache (rows of a batch feeding unequal counts, so with gaps)
    accepts, sentence by sentence, what drafting from scratch accepts, and its output is the
    verifier's greedy translation: on the dynamic loop, and on the static one (its static form,
    the verifier's states passed on the device)."""
    model, task, _ = trained
    dataset = spec_task.dataset("valid")
    verifier = model.verifier
    drafter = load_drafter(spec_task, str(toy["feature_drafter"]), verifier)
    generator = SpeculativeGenerator(
        BlockScorer(verifier), drafter, spec_task.target_dictionary,
        DecodingSettings(block_size=4, max_draft_batch=0, max_len_a=0, max_len_b=200,
                         decoding_loop=loop))  # fmt: skip
    assert generator.on_static_loop == (loop == "static")
    indices = list(range(16))
    with torch.no_grad():
        greedy = greedy_translations(task, model, indices, batch_size=16)
        for start in range(0, len(indices), sentences_per_batch):
            batch = indices[start : start + sentences_per_batch]
            sample = dataset.collater([dataset[i] for i in batch])
            decoded = generator.generate([verifier], sample)
            for index, hypotheses in zip(sample["id"].tolist(), decoded):
                assert hypotheses[0]["tokens"].tolist() == greedy[index].tolist()
                simulation = Simulation(model, 4, spec_task.target_dictionary.eos())
                simulation.sentence(dataset[index]["source"], greedy[index])
                assert hypotheses[0]["spec_accepted_tokens"] == simulation.accepted
                assert hypotheses[0]["spec_iterations"] == simulation.iterations
    assert generator.stats.accepted_tokens > 0


def toy_vocabulary(toy, spec_task):
    """Half of the toy's target symbols, the most frequent (export_model's choice)."""
    export_model = script_module("export_model")
    counts = export_model.target_counts(toy["bin"], "de", "en")
    dictionary = spec_task.target_dictionary
    return export_model.draft_vocabulary(counts, dictionary, len(dictionary) // 2)


@pytest.mark.parametrize(
    "sentences_per_batch, restricted, stop",
    [(1, False, 0.0), (8, False, 0.0), (8, True, 0.3)],
    ids=["batch-1", "batch-8", "batch-8-vocabulary-stop"],
)  # fmt: skip
def test_one_scripted_call_drafts_what_one_call_per_draft_drafts(toy, trained, spec_task,
                                                                   monkeypatch, restricted,
                                                                   sentences_per_batch, stop):
    """Greedy chains run as one scripted call (greedy_drafts); each iteration's drafts must be
    those of drafting through the block scorer one call per draft (grow_tree), in batches
    whose rows feed unequal counts too, over a draft vocabulary only its symbols, and with
    --draft-stop ending the chains at the same levels."""
    model, _, _ = trained
    vocabulary = toy_vocabulary(toy, spec_task) if restricted else None
    dictionary = spec_task.target_dictionary
    adapter = model.decoding_adapter(dictionary.pad(), dictionary.eos(), vocabulary)
    generator = SpeculativeGenerator(
        BlockScorer(model.verifier), adapter, dictionary,
        DecodingSettings(block_size=4, max_draft_batch=0, max_len_a=0, max_len_b=200,
                         draft_stop=stop))  # fmt: skip
    dataset = spec_task.dataset("valid")
    samples = [dataset.collater([dataset[i] for i in range(start, start + sentences_per_batch)])
               for start in range(0, 16, sentences_per_batch)]  # fmt: skip
    scripted_calls = []
    scripted = feature_drafting.greedy_drafts_scripted

    def counted(*args):
        scripted_calls.append(1)
        return scripted(*args)

    def decode():
        trees = []
        propose = feature_drafting.FeatureDrafter.propose

        def recorded(self, *args):
            tree = propose(self, *args)
            trees.append((tree.tokens.tolist(), tree.valid.tolist()))
            return tree

        with monkeypatch.context() as patch, torch.no_grad():
            patch.setattr(feature_drafting.FeatureDrafter, "propose", recorded)
            outputs = [[h[0]["tokens"].tolist() for h in generator.generate([model.verifier], s)]
                       for s in samples]  # fmt: skip
        return trees, outputs

    monkeypatch.setattr(feature_drafting, "greedy_drafts_scripted", counted)
    one_call = decode()
    assert scripted_calls
    monkeypatch.setattr(feature_drafting.FeatureDrafter, "_scripted_steps", lambda *_: None)
    assert decode() == one_call
    drafted = {token for tokens, valid in one_call[0] for row_tokens, row_valid in
               zip(tokens, valid) for token, real in zip(row_tokens, row_valid) if real}
    assert drafted and dictionary.pad() not in drafted
    if restricted:
        assert drafted <= set(vocabulary.tolist())
    lengths = {len(tokens[0]) for tokens, _ in one_call[0]}
    if stop:  # some chains end early, some do not
        assert 4 in lengths and lengths & {1, 2, 3}
    else:
        assert lengths == {0, 4}  # (0: the first iteration)


def test_each_node_of_a_draft_tree_is_drafted_from_its_own_path(toy, trained, spec_task,
                                                                 monkeypatch):
    """In a greedy draft tree (rows of a batch feeding unequal counts), each node's children
    are the drafter's best tokens after the verified prefix and the node's path, drafted from
    scratch (FeatureDrafter.extend): a node reads the state its parent predicted and sees its
    ancestors only."""
    model, _, _ = trained
    dictionary = spec_task.target_dictionary
    adapter = model.decoding_adapter(dictionary.pad(), dictionary.eos(), None)
    branching = [2, 2, 1]
    generator = SpeculativeGenerator(
        BlockScorer(model.verifier), adapter, dictionary,
        DecodingSettings(tree_branching=",".join(map(str, branching)), max_draft_batch=0,
                         max_len_a=0, max_len_b=200))  # fmt: skip
    dataset = spec_task.dataset("valid")
    sample = dataset.collater([dataset[i] for i in range(8)])
    proposals = []
    propose = feature_drafting.FeatureDrafter.propose

    def recorded(self, state, tokens, lengths, plan, rng):
        tree = propose(self, state, tokens, lengths, plan, rng)
        proposals.append((tokens.clone(), lengths.clone(), tree))
        return tree

    monkeypatch.setattr(feature_drafting.FeatureDrafter, "propose", recorded)
    with torch.no_grad():
        generator.generate([model.verifier], sample)
        checked = set()
        for tokens, lengths, tree in proposals:
            if not tree.tokens.size(1) or tokens.size(0) != 8:  # the first iteration, or later
                continue  # than every row's
            for row in range(8):
                checked |= children_match_paths(model, sample, row, tokens, lengths, tree,
                                                branching, dictionary)  # fmt: skip
    assert checked == {0, 1, 2}  # the root's children and nodes at both inner depths


def children_match_paths(model, sample, row, tokens, lengths, tree, branching, dictionary):
    """Assert the children of row ``row``'s valid nodes; returns the depths of nodes checked."""
    source = sample["net_input"]["src_tokens"][row]
    source = source[source.ne(dictionary.pad())].unsqueeze(0)
    verified = int(lengths[row])
    prefix = tokens[row, 1 : verified + 1].unsqueeze(0)  # the verified tokens, the pending last
    prev = tokens[row, :verified].unsqueeze(0)
    encoder_out, states = model.verifier_states(source, torch.tensor([source.size(1)]), prev)
    positions = position_table(model.verifier.decoder, verified + len(branching) + 1)[None]
    keys = model.source_keys(encoder_out)
    root_state, root_cache = model.extend(states, prefix, positions[:, :verified], keys)
    parents, valid = tree.parents[row].tolist(), tree.valid[row].tolist()
    depths = set()
    for node in [-1] + list(range(len(parents))):
        if node >= 0 and (not valid[node] or int(tree.depths[node]) == len(branching)):
            continue
        path = []
        ancestor = node
        while ancestor >= 0:
            path.insert(0, int(tree.tokens[row, ancestor]))
            ancestor = parents[ancestor]
        state, cache = root_state[:, -1:], root_cache
        for step, token in enumerate(path):
            where = positions[:, verified + step : verified + step + 1]
            state, cache = model.extend(state, torch.tensor([[token]]), where, keys, cache)
        logits = model.logits(state)[0, -1]
        logits[dictionary.pad()] = float("-inf")
        children = [j for j, parent in enumerate(parents) if parent == node and valid[j]]
        if not children or path[-1:] == [dictionary.eos()]:
            continue
        best = logits.topk(branching[len(path)]).indices.tolist()
        assert [int(tree.tokens[row, j]) for j in children] == best[: len(children)]
        depths.add(len(path))
    return depths


def test_the_export_holds_only_the_drafters_own_weights_and_stays_lossless(toy, trained,
                                                                           spec_task, tmp_path):
    """export_model.py drops the verifier inside a feature drafter (rebuilt from the verifier
    when loaded, refused beside another) and adds the draft vocabulary; decoding with it is
    still the verifier's greedy output."""
    model, task, _ = trained
    vocabulary = toy_vocabulary(toy, spec_task)
    exported = tmp_path / "drafter.pt"
    script_module("export_model").compact_checkpoint(toy["feature_drafter"], exported, vocabulary,
                                                     toy["verifier"])  # fmt: skip
    state = torch.load(exported, weights_only=False)
    assert state["model"] and not any(name.startswith("verifier.") for name in state["model"])
    assert state[DRAFT_VOCABULARY_KEY].tolist() == vocabulary.tolist()
    drafter = load_drafter(spec_task, str(exported), model.verifier)
    assert drafter.vocabulary.tolist() == vocabulary.tolist()
    generator = SpeculativeGenerator(
        BlockScorer(model.verifier), drafter, spec_task.target_dictionary,
        DecodingSettings(block_size=4, max_draft_batch=0, max_len_a=0, max_len_b=200))
    dataset = spec_task.dataset("valid")
    indices = list(range(8))
    sample = dataset.collater([dataset[i] for i in indices])
    with torch.no_grad():
        greedy = greedy_translations(task, model, indices, batch_size=8)
        decoded = generator.generate([model.verifier], sample)
    for index, hypotheses in zip(sample["id"].tolist(), decoded):
        assert hypotheses[0]["tokens"].tolist() == greedy[index].tolist()
    assert generator.stats.accepted_tokens > 0
    (other,), _ = checkpoint_utils.load_model_ensemble([str(toy["ar_drafter"])], task=spec_task)
    with pytest.raises(SpecNmtError, match="trained on another verifier's"):
        load_drafter(spec_task, str(exported), other)

    # unpack_drafter.py makes it a checkpoint fairseq loads (and trains on) again
    for dictionary in toy["bin"].glob("dict.*.txt"):
        shutil.copy(dictionary, tmp_path)
    save_checkpoint(script_module("unpack_drafter").unpacked(tmp_path, toy["verifier"]),
                    tmp_path / "unpacked.pt")  # fmt: skip
    (unpacked,), _ = checkpoint_utils.load_model_ensemble([str(tmp_path / "unpacked.pt")],
                                                          task=task)  # fmt: skip
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(unpacked.state_dict()[name], tensor.half().float())
