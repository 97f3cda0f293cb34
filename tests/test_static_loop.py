"""The static loop (spec_nmt/decoding/static_loop.py) with the bundled pair on the CPU: token for
token fairseq's greedy search, alone and in batches of mixed lengths (an empty line among them),
without drafts and with the cached drafter; its per-token scores are fairseq's (so its caches
hold what a full recomputation gives); its drafts and acceptance are the dynamic loop's; it reads
the host once per iteration; and what it does not serve goes to the dynamic loop. (The CPU's
default loop is the dynamic one: these tests ask for the static loop.)"""

import copy

import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

from spec_nmt.decoding import host, static_loop
from spec_nmt.decoding.static_loop import StaticLoop
from spec_nmt.errors import SpecNmtError
from spec_nmt.settings import DEFAULTS
from spec_nmt.translator import SpecTranslator
from tests.conftest import BUNDLED_MODEL_DIR, REPO

LINES = 12
MAX_LEN_B = 60
EMPTY = 5  # the empty line's index


@pytest.fixture(scope="module")
def pair():
    return SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, device="cpu", drafter="file",
                                          max_len_a=0, max_len_b=MAX_LEN_B,
                                          decoding_loop="static")  # fmt: skip


@pytest.fixture(scope="module")
def sources(pair):
    lines = (REPO / "data" / "examples.de").read_text(encoding="utf-8").splitlines()[:LINES]
    return pair.encode(lines[:EMPTY] + [""] + lines[EMPTY:])


def decode(pair, generator, sources, batch_size):
    """Each line's hypothesis, in line order."""
    found = [None] * len(sources)
    with torch.inference_mode():
        for lines, sample in pair.batches(sources, batch_size):
            for row, hypotheses in zip(lines, generator.generate([pair.verifier], sample)):
                found[row] = hypotheses[0]
    return found


@pytest.fixture(scope="module")
def greedy(pair, sources):
    fairseq = SequenceGenerator([pair.verifier], pair.tgt_dict, beam_size=1, max_len_a=0,
                                max_len_b=MAX_LEN_B)  # fmt: skip
    return decode(pair, fairseq, sources, 1)


@pytest.mark.parametrize("batch_size", [1, 5])
@pytest.mark.parametrize("block_size", [0, 3, 10])
def test_static_loop_is_fairseq_greedy_with_its_scores(pair, sources, greedy, batch_size,
                                                       block_size):  # fmt: skip
    generator = pair.generator(block_size=block_size, max_draft_batch=0)
    found = decode(pair, generator, sources, batch_size)
    assert generator.stats.batched_verifier_calls > 0
    # an empty line gets EOS alone without decoding, as on the dynamic loop (fairseq decodes it)
    assert found[EMPTY]["tokens"].tolist() == [pair.tgt_dict.eos()]
    for line, (ours, theirs) in enumerate(zip(found, greedy)):
        if line == EMPTY:
            continue
        assert ours["tokens"].tolist() == theirs["tokens"].tolist(), f"line {line}"
        torch.testing.assert_close(ours["positional_scores"], theirs["positional_scores"],
                                   atol=1e-4, rtol=0)  # fmt: skip
        torch.testing.assert_close(ours["score"], theirs["score"], atol=1e-4, rtol=0)
    if block_size:
        assert generator.stats.accepted_tokens > 0, "the drafts were never used"


@pytest.mark.parametrize("batch_size", [1, 5])
def test_the_shapes_of_captured_graphs_give_fairseq_greedy(pair, sources, greedy, batch_size):
    """As on CUDA: source lengths padded to their bucket, the encoder run over the padding
    under its mask without asking the device whether there is any."""
    generator = pair.generator(block_size=3, max_draft_batch=0)
    # a loop of its own: the translator's generators of equal settings share theirs
    generator.own_static_loop().graph_shapes = True
    found = decode(pair, generator, sources, batch_size)
    for line, (ours, theirs) in enumerate(zip(found, greedy)):
        if line != EMPTY:
            assert ours["tokens"].tolist() == theirs["tokens"].tolist(), f"line {line}"
            torch.testing.assert_close(ours["positional_scores"], theirs["positional_scores"],
                                       atol=1e-4, rtol=0)  # fmt: skip
    assert generator.stats.accepted_tokens > 0


def test_static_and_dynamic_loops_draft_and_accept_alike(sources):
    """The same drafts accepted per sentence at batch 1, also under a relaxed rule, whose
    translations the drafts decide (the drafter in fp32: bf16 rounds by kernel shape, and the
    loops' blocks differ in shape)."""
    pair = SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, device="cpu", drafter="file",
                                          max_len_a=0, max_len_b=MAX_LEN_B,
                                          drafter_precision="fp32")  # fmt: skip
    for settings in ({"block_size": 5}, {"block_size": 5, "beta": 3, "tau": 1.0}):
        loops = {loop: pair.generator(decoding_loop=loop, max_draft_batch=0, **settings)
                 for loop in ("static", "dynamic")}  # fmt: skip
        found = {loop: decode(pair, generator, sources, 1) for loop, generator in loops.items()}
        for static, dynamic in zip(found["static"], found["dynamic"]):
            assert static["tokens"].tolist() == dynamic["tokens"].tolist()
            assert static.get("spec_accepted_tokens") == dynamic.get("spec_accepted_tokens")
            assert static.get("spec_iterations") == dynamic.get("spec_iterations")
        assert loops["static"].static is not None and loops["dynamic"].static is None


def test_the_host_is_read_once_per_iteration_but_the_first_and_once_for_the_output(pair,
                                                                                   sources):
    generator = pair.generator(block_size=3)
    batches = list(pair.batches(sources[:4], 1))
    before = host.count_reads()
    with torch.inference_mode():
        for _, sample in batches:
            generator.generate([pair.verifier], sample)
    calls = generator.stats.batched_verifier_calls
    assert calls > len(batches)
    # a flag after every call but a sentence's first, and its output
    assert host.count_reads() - before == calls


@pytest.mark.parametrize("settings", [{"verify": "sampling"}, {"tree_branching": "2,1"},
                                      {"draft_stop": 0.5}, {"decoding_loop": "dynamic"}])  # fmt: skip
def test_what_the_static_loop_does_not_serve_decodes_on_the_dynamic_loop(pair, sources, settings):
    generator = pair.generator(max_draft_batch=0, **settings)
    with torch.inference_mode():
        _, sample = next(pair.batches(sources[:1], 1))
        before = host.count_reads()
        generator.generate([pair.verifier], sample)
    assert host.count_reads() == before
    assert generator.stats.batched_verifier_calls > 0


def test_an_unknown_decoding_loop_is_refused_in_one_line():
    with pytest.raises(SpecNmtError, match=r"^decoding_loop must be one of auto, static, dyna"):
        DEFAULTS.replace(decoding_loop="graph")


def test_the_default_loop_is_static_on_a_gpu_and_dynamic_on_the_cpu(sources):
    assert DEFAULTS.decoding_loop == "auto"
    assert StaticLoop.wanted(DEFAULTS, torch.device("cuda"))
    assert not StaticLoop.wanted(DEFAULTS, torch.device("cpu"))
    assert StaticLoop.wanted(DEFAULTS.replace(decoding_loop="static"), torch.device("cpu"))
    assert not StaticLoop.wanted(DEFAULTS.replace(decoding_loop="dynamic"),
                                    torch.device("cuda"))  # fmt: skip
    pair = SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, device="cpu", drafter="file")
    generator = pair.generator(max_draft_batch=0)
    assert generator.static is None and not generator.on_static_loop
    with torch.inference_mode():
        _, sample = next(pair.batches(sources[:1], 1))
        generator.generate([pair.verifier], sample)
    assert generator.stats.accepted_tokens > 0


def test_a_translators_calls_share_one_static_loop_while_the_weights_stay():
    """A translator makes a generator per call; their static loop (and on CUDA its captured
    graphs) is made once per verifier and settings, and again once a verifier weight changed."""
    pair = SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, device="cpu", drafter="file",
                                          decoding_loop="static")
    first, again = pair.generator(block_size=3), pair.generator(block_size=3)
    assert first.static is again.static
    assert pair.generator(block_size=5).static is not first.static
    assert pair.generator(verify="sampling").static is None  # a rule it does not serve
    with torch.no_grad():
        pair.verifier.decoder.layers[0].fc1.weight.add_(0.0)  # a new version, as training makes
    assert pair.generator(block_size=3).static is not first.static


def test_drafters_taking_turns_on_one_loop_keep_their_static_forms(pair, sources):
    """Two drafters decoding in turns at the same settings share the task's loop: each keeps its
    static form (on CUDA, its graphs) instead of replacing the other's at every batch, until a
    weight of its own changes; a drafter past MAX_DRAFTERS pushes the oldest out."""
    generator = pair.generator(block_size=3)
    loop, real = generator.static, generator.drafter
    other = copy.copy(real)  # another adapter over the same weights
    first = loop.drafter_for(real)
    second = loop.drafter_for(other)
    assert second is not first
    assert loop.drafter_for(real) is first and loop.drafter_for(other) is second
    decode(pair, generator, sources[:3], 1)
    assert generator.stats.accepted_tokens > 0
    assert loop.drafter_for(real) is first  # decoding with it kept it
    with torch.no_grad():
        real.scorer.model.decoder.layers[0].fc1.weight.add_(0.0)  # a new version
    assert loop.drafter_for(real) is not first
    newest = [copy.copy(real) for _ in range(static_loop.MAX_DRAFTERS)]
    for drafter in newest:
        loop.drafter_for(drafter)
    assert all(loop.drafter_for(drafter) is loop.drafter_for(drafter) for drafter in newest)
    assert id(other) not in loop._drafters
