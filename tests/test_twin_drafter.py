"""The verifier's CTranslate2 twin as drafter (spec_nmt/drafters/twin_drafter.py): lossless output
token for token equal to stock fairseq greedy on the toy and the bundled pair, alone and in
batches, also when a perturbed twin disagrees often; the relaxed rule on twin drafts as on the
same drafts made by hand; exact samples (chi-square, drafting on); the twin cache; and what
happens without ctranslate2 or with a verifier it cannot convert."""

import copy
import logging
import os
import subprocess

import ctranslate2
import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.sequence_generator import SequenceGenerator

from spec_nmt.decoding.loop import SpeculativeGenerator
from spec_nmt.decoding.scorer import BlockScorer
from spec_nmt.decoding.tree import chain
from spec_nmt.drafters import twin_drafter
from spec_nmt.drafters.twin_drafter import TwinUnavailable, intact, load_twin, twin_directory
from spec_nmt.loading import load_decoding_drafter
from spec_nmt.settings import DecodingSettings
from spec_nmt.task import SpecTranslationConfig, SpecTranslationTask
from spec_nmt.translator import SpecTranslator
from tests import test_sampling_exact as sampling
from tests.conftest import BIN, BUNDLED_MODEL_DIR
from tests.stats import chi_square_pvalue

MAX_LEN_B = 40


@pytest.fixture(scope="module")
def toy_pair(toy):
    cfg = SpecTranslationConfig(data=str(toy["bin"]), source_lang="de", target_lang="en",
                                dataset_impl="mmap", required_seq_len_multiple=1)  # fmt: skip
    task = SpecTranslationTask.setup_task(cfg)
    task.load_dataset("test")
    (verifier,), _ = checkpoint_utils.load_model_ensemble([str(toy["verifier"])], task=task)
    return task, verifier.eval()


def batches(task, batch_size):
    # (fairseq keeps a dataset's first batch iterator and returns it whatever max_sentences
    # asks after: without disable_iterator_cache every test here got the first test's batches)
    return list(task.get_batch_iterator(task.dataset("test"), max_sentences=batch_size,
                                        max_positions=(1024, 1024), disable_iterator_cache=True)
                .next_epoch_itr(shuffle=False))  # fmt: skip


def twin_of(model, task, twins):
    return load_twin(model, task.source_dictionary, task.target_dictionary,
                     model.decoder.max_positions(), twins)  # fmt: skip


def perturbed(model, scale=0.05, seed=0):
    """A copy of ``model`` with noise on its decoder's weights: its twin often disagrees."""
    noisy = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in noisy.decoder.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator) * scale * weight.std())
    return noisy


@torch.no_grad()
def decode_with(task, verifier, drafter, batch_size, look_ahead=False, **settings):
    """(tokens per sentence id, the generator's stats) of speculative decoding; ``look_ahead``:
    the generator is told the batches to come first, as the translator tells it."""
    settings = DecodingSettings(max_len_a=0, max_len_b=MAX_LEN_B, **settings)
    generator = SpeculativeGenerator(BlockScorer(verifier), drafter, task.target_dictionary,
                                     settings)  # fmt: skip
    found = {}
    samples = batches(task, batch_size)
    if look_ahead:
        generator.look_ahead(samples)
    for sample in samples:
        for sentence, hypos in zip(sample["id"].tolist(), generator.generate(None, sample)):
            found[sentence] = hypos[0]["tokens"].tolist()
    return found, generator.stats


@torch.no_grad()
def stock_greedy(task, verifier, batch_size):
    stock = SequenceGenerator([verifier], task.target_dictionary, beam_size=1,
                              max_len_b=MAX_LEN_B)  # fmt: skip
    found = {}
    for sample in batches(task, batch_size):
        for sentence, hypos in zip(sample["id"].tolist(), stock.generate([verifier], sample)):
            found[sentence] = hypos[0]["tokens"].tolist()
    return found


@pytest.mark.parametrize("batch_size", [1, 16])
@pytest.mark.parametrize("twin_kind", ["own", "perturbed"])
def test_twin_drafts_give_stock_greedy_output(toy_pair, tmp_path, batch_size, twin_kind):
    """The verifier's own twin gets whole continuations accepted; a perturbed verifier's twin
    disagrees in many sentences, and the output stays the verifier's greedy translation."""
    task, verifier = toy_pair
    source = verifier if twin_kind == "own" else perturbed(verifier, scale=0.5)
    twin = twin_of(source, task, tmp_path)
    found, stats = decode_with(task, verifier, twin, batch_size, max_draft_batch=0)
    assert found == stock_greedy(task, verifier, batch_size)
    disagreements = stats.iterations - stats.sentences  # each round after a sentence's first
    print(f"{twin_kind} twin, batch {batch_size}: {stats.summary()}")
    assert stats.drafted_tokens > stats.output_tokens / 2
    if twin_kind == "own":  # (int8 weights: the toy's tiny verifier disagrees now and then)
        assert stats.accepted_tokens > 0.6 * stats.output_tokens
        assert disagreements < 1.5 * stats.sentences
    else:
        assert disagreements > 2 * stats.sentences


class CountedCalls:
    """A twin engine that records each call: (rows, whether any row had a prefix)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def continuations(self, sources, prefixes, max_length):
        self.calls.append((len(sources), any(prefixes)))
        return self.engine.continuations(sources, prefixes, max_length)


@pytest.mark.parametrize("twin_kind", ["own", "perturbed"])
def test_first_drafts_for_sentences_to_come_are_made_several_at_a_time(toy_pair, tmp_path,
                                                                       twin_kind):  # fmt: skip
    """Told the batches to come, the twin drafts the first continuation of DRAFT_AHEAD_ROWS
    sentences in one call at batch 1 (cheaper per token), and the output stays stock greedy."""
    task, verifier = toy_pair
    twin = twin_of(verifier if twin_kind == "own" else perturbed(verifier, scale=0.5), task,
                   tmp_path)  # fmt: skip
    twin.engine = CountedCalls(twin.engine)
    found, stats = decode_with(task, verifier, twin, 1, look_ahead=True, max_draft_batch=0)
    assert found == stock_greedy(task, verifier, 1)
    first = [rows for rows, prefixed in twin.engine.calls if not prefixed]
    full, rest = divmod(stats.sentences, twin_drafter.DRAFT_AHEAD_ROWS)
    assert first == [twin_drafter.DRAFT_AHEAD_ROWS] * full + ([rest] if rest else [])
    assert len(twin.engine.calls) - len(first) == stats.iterations - stats.sentences
    # what the relaxed rule decodes, and which sample a seed draws, depend on the drafts: never
    # on the sentences after it
    for rule in ({"beta": 3, "tau": 1.0}, {"verify": "sampling", "seed": 1}):
        twin.engine.calls.clear()
        decoded, _ = decode_with(task, verifier, twin, 1, look_ahead=True, max_draft_batch=0,
                                 **rule)  # fmt: skip
        assert [rows for rows, prefixed in twin.engine.calls if not prefixed] == [1] * len(
            decoded)


def with_an_empty_line(sample, pad, eos):
    """``sample`` with one more row: an empty line (its EOS alone, padded on the left)."""
    net_input = sample["net_input"]
    empty = net_input["src_tokens"].new_full((1, net_input["src_tokens"].size(1)), pad)
    empty[0, -1] = eos
    return {**sample, "net_input": {
        "src_tokens": torch.cat([net_input["src_tokens"], empty]),
        "src_lengths": torch.cat([net_input["src_lengths"], torch.ones_like(
            net_input["src_lengths"][:1])])}}  # fmt: skip


def test_an_empty_line_does_not_count_against_the_drafting_limit_of_drafts_ahead(toy_pair,
                                                                                 tmp_path):
    """A batch of two sentences and an empty line drafts (the limit counts sentences), so its
    sentences are among those drafted ahead, and the batches after it keep their drafts
    ahead: DRAFT_AHEAD_ROWS sentences per call of the twin."""
    task, verifier = toy_pair
    twin = twin_of(verifier, task, tmp_path)
    twin.engine = CountedCalls(twin.engine)
    dictionary = task.source_dictionary
    samples = batches(task, 2)
    samples[0] = with_an_empty_line(samples[0], dictionary.pad(), dictionary.eos())
    settings = DecodingSettings(max_len_a=0, max_len_b=MAX_LEN_B, max_draft_batch=2)
    generator = SpeculativeGenerator(BlockScorer(verifier), twin, task.target_dictionary,
                                     settings)  # fmt: skip
    generator.look_ahead(samples)
    with torch.no_grad():
        for sample in samples:
            generator.generate(None, sample)
    assert generator.stats.batches_without_drafts == 0
    first = [rows for rows, prefixed in twin.engine.calls if not prefixed]
    sentences = sum(int((s["net_input"]["src_lengths"] > 1).sum()) for s in samples)
    full, rest = divmod(sentences, twin_drafter.DRAFT_AHEAD_ROWS)
    assert first == [twin_drafter.DRAFT_AHEAD_ROWS] * full + ([rest] if rest else [])


def test_sentences_other_than_those_announced_are_drafted_as_they_come(toy_pair, tmp_path):
    """Drafts ahead for sentences that are not decoded next are dropped, not trusted: another
    batch gets its own drafts, and the queue of sentences to come is emptied."""
    task, verifier = toy_pair
    twin = twin_of(perturbed(verifier, scale=0.5), task, tmp_path)
    samples = batches(task, 1)
    settings = DecodingSettings(max_len_a=0, max_len_b=MAX_LEN_B, max_draft_batch=0)
    generator = SpeculativeGenerator(BlockScorer(verifier), twin, task.target_dictionary,
                                     settings)  # fmt: skip
    generator.look_ahead(samples[5:])
    with torch.no_grad():
        for sample in samples[:3] + samples[5:7]:
            (hypos,) = generator.generate(None, sample)
            assert hypos[0]["tokens"].tolist() == stock_greedy_of(task, verifier, sample)
    assert not twin._upcoming


def stock_greedy_of(task, verifier, sample):
    stock = SequenceGenerator([verifier], task.target_dictionary, beam_size=1,
                              max_len_b=MAX_LEN_B)  # fmt: skip
    with torch.no_grad():
        return stock.generate([verifier], sample)[0][0]["tokens"].tolist()


def test_a_prefix_read_in_one_pass_gives_the_continuation_of_plain_greedy_decoding(toy_pair,
                                                                                   tmp_path):
    """The twin reads a verified prefix in one decoder pass (CTranslate2's alternatives mode):
    the continuation is the one that forcing the prefix step by step gives, also after a
    token the twin would not have chosen (a correction), except where that one ends at once:
    then the first draft is one the verifier rejects, and the round ends with its EOS."""
    task, verifier = toy_pair
    twin = twin_of(perturbed(verifier, scale=0.5), task, tmp_path)
    translator = ctranslate2.Translator(str(twin.directory), compute_type="int8")
    sources = [twin._pieces(sample["net_input"]["src_tokens"][0].tolist())
               for sample in batches(task, 1)[:20]]  # fmt: skip
    own = [r.hypotheses[0] for r in translator.translate_batch(sources, beam_size=1)]
    symbols = task.target_dictionary.symbols[task.target_dictionary.nspecial :]
    prefixes = [hypothesis[: len(hypothesis) // 2] + [symbols[i % len(symbols)]]
                for i, hypothesis in enumerate(own)]  # fmt: skip
    stepwise = [r.hypotheses[0] for r in translator.translate_batch(
        sources, target_prefix=prefixes, beam_size=1, max_decoding_length=MAX_LEN_B)]
    found = twin_drafter.greedy_continuations(translator, sources, prefixes, MAX_LEN_B)
    ends_at_once = [len(hypothesis) == len(prefix) for hypothesis, prefix in zip(stepwise,
                                                                               prefixes)]
    assert 0 < sum(ends_at_once) < len(prefixes)
    for one_pass, hypothesis, prefix, ends in zip(found, stepwise, prefixes, ends_at_once):
        if ends:  # the alternatives mode never ends at its first position: a draft to reject
            assert one_pass[: len(prefix)] == prefix and len(one_pass) > len(prefix)
        else:
            assert one_pass == hypothesis


class DraftsByHand:
    """Greedy continuations asked of CTranslate2 here, outside the twin drafter, one sentence
    and one call at a time: what the twin should draft, for comparison."""

    drafts_continuations = True

    def __init__(self, twin, task):
        self.twin = twin
        self.translator = ctranslate2.Translator(str(twin.directory), compute_type="int8",
                                                 intra_threads=torch.get_num_threads())
        self.dictionary = task.target_dictionary
        for name in ("max_positions", "max_source_positions", "start", "commit", "select_rows",
                     "check_depth"):  # (as the twin)
            setattr(self, name, getattr(twin, name))

    def propose(self, state, tokens, lengths, plan, generator):
        drafts = []
        for row, source in enumerate(state.sources):
            prefix = [self.dictionary[t] for t in tokens[row, 1 : int(lengths[row]) + 1]]
            if prefix and prefix[-1] == self.dictionary.eos_word:  # finished
                drafts.append([])
                continue
            (hypothesis,) = twin_drafter.greedy_continuations(self.translator, [source],
                                                              [prefix], 200)  # fmt: skip
            continuation = hypothesis[len(prefix) :][: plan.depth]
            drafts.append([self.dictionary.index(piece) for piece in continuation])
        width = max(map(len, drafts))
        block = torch.full((len(drafts), width), self.dictionary.pad())
        for row, row_drafts in enumerate(drafts):
            block[row, : len(row_drafts)] = torch.tensor(row_drafts, dtype=torch.long)
        return chain(block, valid=block.ne(self.dictionary.pad()))


def test_the_relaxed_rule_judges_twin_drafts_as_the_same_drafts_made_by_hand(toy_pair, tmp_path):
    task, verifier = toy_pair
    twin = twin_of(perturbed(verifier), task, tmp_path)
    by_hand = DraftsByHand(twin, task)
    relaxed = dict(beta=3, tau=1.0)
    drafted, stats = decode_with(task, verifier, twin, 1, **relaxed)
    assert drafted == decode_with(task, verifier, by_hand, 1, **relaxed)[0]
    assert drafted != stock_greedy(task, verifier, 1)  # the relaxed rule took other tokens
    assert stats.iterations > stats.sentences  # with rejections


def test_sampling_with_twin_drafts_is_exact(tmp_path):
    """Speculative sampling over the twin's greedy continuations (a one-hot draft
    distribution): the first two tokens follow the verifier's distribution, and drafts are
    both accepted and rejected."""
    models = sampling.build_models()
    verifier, dictionary = models["verifier"], models["dictionary"]
    verifier.args.arch = "transformer"  # (what CTranslate2 reads; a checkpoint's options have it)
    task = SpecTranslationTask(SpecTranslationConfig(), dictionary, dictionary)
    twin = twin_of(verifier, task, tmp_path)
    settings = DecodingSettings(verify="sampling", temperature=sampling.TEMPERATURE, seed=0,
                                max_len_a=0, max_len_b=2, max_draft_batch=0)  # fmt: skip
    generator = SpeculativeGenerator(BlockScorer(verifier, temperature=sampling.TEMPERATURE),
                                     twin, dictionary, settings)  # fmt: skip
    counts = sampling.first_two_counts(lambda s: generator.generate(None, s), dictionary)
    pvalue = chi_square_pvalue(counts, sampling.exact_joint(models).flatten())
    print(f"twin sampling: {generator.stats.summary()}; p = {pvalue:.3g}")
    assert generator.stats.accepted_tokens > 0.2 * sampling.SAMPLES
    assert generator.stats.iterations > 1.1 * sampling.SAMPLES  # rejections too
    assert pvalue > 1e-3


def test_the_twin_is_made_once_and_made_again_when_the_verifier_changes(toy_pair, tmp_path,
                                                                        monkeypatch):  # fmt: skip
    task, verifier = toy_pair
    conversions = []
    converter = twin_drafter._converter
    monkeypatch.setattr(twin_drafter, "_converter",
                        lambda *a: conversions.append(1) or converter(*a))  # fmt: skip
    first = twin_directory(verifier, task.source_dictionary, task.target_dictionary, tmp_path)
    again = twin_directory(verifier, task.source_dictionary, task.target_dictionary, tmp_path)
    assert first == again and len(conversions) == 1
    changed = perturbed(verifier, scale=1e-3)
    other = twin_directory(changed, task.source_dictionary, task.target_dictionary, tmp_path)
    assert other != first and len(conversions) == 2
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted([first.name, other.name])


@pytest.mark.parametrize("damage", ["truncated", "half-written"])
def test_a_corrupt_twin_is_made_again(toy_pair, tmp_path, damage):
    task, verifier = toy_pair
    directory = twin_directory(verifier, task.source_dictionary, task.target_dictionary, tmp_path)
    whole = (directory / "model.bin").read_bytes()
    if damage == "truncated":
        (directory / "model.bin").write_bytes(whole[: len(whole) // 2])
    else:  # stopped before its manifest was written
        (directory / twin_drafter.MANIFEST).unlink()
    assert not intact(directory, directory.name)
    twin = twin_of(verifier, task, tmp_path)
    assert twin.directory == directory and intact(directory, directory.name)
    assert (directory / "model.bin").read_bytes() == whole


def test_conversion_leaves_the_verifier_as_it_was(toy_pair, tmp_path):
    """CTranslate2 quantizes the tensors it is given in place: the twin is made from a copy."""
    task, verifier = toy_pair
    before = {name: tensor.clone() for name, tensor in verifier.state_dict().items()}
    twin_directory(verifier, task.source_dictionary, task.target_dictionary, tmp_path)
    after = verifier.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_a_verifier_ctranslate2_cannot_convert_drafts_with_the_drafter_file(toy, toy_pair,
                                                                           caplog, monkeypatch):
    task, verifier = toy_pair
    unconvertible = copy.deepcopy(verifier)
    unconvertible.args.encoder_normalize_before = not verifier.args.decoder_normalize_before
    # (a twins directory of its own: the weights are the verifier's, whose twin may be made)
    monkeypatch.setattr(twin_drafter, "TWINS_DIR", toy["root"] / "unconvertible-twins")
    with caplog.at_level(logging.WARNING, logger="spec_nmt"):
        drafter = load_decoding_drafter(task, "auto", str(toy["cached_drafter"]), unconvertible)
    assert getattr(drafter, "twin", None) is None and type(drafter).__name__ == "CachedDrafter"
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "CTranslate2 cannot convert this verifier" in warning and "\n" not in warning
    assert str(toy["cached_drafter"]) in warning
    with pytest.raises(TwinUnavailable):
        twin_of(unconvertible, task, toy["root"] / "no-twins")


def test_without_ctranslate2_one_line_says_so_and_the_drafter_file_drafts(tmp_path):
    """spec-nmt-translate where ctranslate2 cannot be imported: one warning line, then the
    model directory's drafter; N lines in, N lines out."""
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "ctranslate2.py").write_text("raise ImportError('blocked for the test')\n")
    lines = ["Guten Morgen.", "", "Der Hund schläft im Garten.", "Wie geht es dir?"]
    result = subprocess.run(
        [str(BIN / "spec-nmt-translate"), str(BUNDLED_MODEL_DIR), "--cpu", "--stats"],
        input="\n".join(lines) + "\n", capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(blocked)}, check=True,
    )  # fmt: skip
    assert len(result.stdout.splitlines()) == len(lines)
    warnings = [line for line in result.stderr.splitlines() if "no twin drafter" in line]
    assert len(warnings) == 1 and "ctranslate2 is not installed" in warnings[0]
    assert "drafter: " + str(BUNDLED_MODEL_DIR / "drafter.pt") in result.stderr


@pytest.fixture(scope="module")
def bundled():
    return SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, device="cpu")


@pytest.mark.parametrize("batch_size", [1, 8])
def test_the_bundled_pair_with_its_twin_gives_stock_greedy_output(bundled, batch_size):
    lines = (BUNDLED_MODEL_DIR.parent.parent / "examples.de").read_text().splitlines()[:12]
    pieces = [bundled.spm.encode(line, out_type=str) for line in lines]
    dictionary = bundled.src_dict
    stock = SequenceGenerator([bundled.verifier], bundled.tgt_dict, beam_size=1, max_len_a=1.2,
                              max_len_b=10)  # fmt: skip
    generator = bundled.generator(max_draft_batch=0)  # (by default the twin drafts up to 8 or 4)
    assert generator.drafter is bundled.drafter.twin
    samples = []
    for start in range(0, len(lines), batch_size):
        rows = [torch.tensor([dictionary.index(p) for p in line] + [dictionary.eos()])
                for line in pieces[start : start + batch_size]]
        src = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True,
                                              padding_value=dictionary.pad())  # fmt: skip
        sample = {"net_input": {"src_tokens": src,
                                "src_lengths": torch.tensor([len(r) for r in rows])}}
        if batch_size > 1:  # fairseq pads sources on the left
            sample["net_input"]["src_tokens"] = torch.stack([
                torch.cat([r.new_full((src.size(1) - len(r),), dictionary.pad()), r])
                for r in rows])  # fmt: skip
        samples.append(sample)
    generator.look_ahead(samples)  # (as the translator does: first drafts made ahead)
    for sample in samples:
        with torch.no_grad():
            expected = [h[0]["tokens"].tolist() for h in stock.generate([bundled.verifier],
                                                                         sample)]
            found = [h[0]["tokens"].tolist() for h in generator.generate(None, sample)]
        assert found == expected
    assert generator.stats.accepted_tokens > 0.7 * generator.stats.output_tokens


def test_the_twin_in_a_worker_process_drafts_as_in_this_one(toy_pair, tmp_path):
    """The worker process (twin_worker.py, for runs of several threads) gives the same drafts."""
    task, verifier = toy_pair
    here = decode_with(task, verifier, twin_of(perturbed(verifier), task, tmp_path), 16)
    worker = load_twin(perturbed(verifier), task.source_dictionary, task.target_dictionary,
                       verifier.decoder.max_positions(), tmp_path, engine="worker")
    assert type(worker.engine).__name__ == "WorkerProcess"
    there = decode_with(task, verifier, worker, 16)
    assert there[0] == here[0]
    assert (there[1].iterations, there[1].accepted_tokens) == (here[1].iterations,
                                                                here[1].accepted_tokens)
