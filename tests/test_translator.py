"""The Python API on the bundled model pair: text in, text out, in order, exactly the verifier's
greedy translation in lossless mode, reproducible samples, per-sentence statistics, clear errors."""

import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

from spec_nmt.errors import SpecNmtError
from spec_nmt.translator import SpecTranslator
from tests.conftest import BUNDLED_MODEL_DIR

SENTENCES = [
    "Guten Morgen.",
    "Das Haus ist groß.",
    "",
    "Wie geht es dir heute?",
    "   ",
    "Die Regierung hat am Dienstag ein neues Gesetz beschlossen.",
    "Ja.",
]


@pytest.fixture(scope="module")
def translator():
    return SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, block_size=6)


def stock_greedy(translator, lines):
    generator = SequenceGenerator(
        [translator.verifier], translator.tgt_dict, beam_size=1,
        max_len_a=translator.settings.max_len_a, max_len_b=translator.settings.max_len_b,
    )  # fmt: skip
    outputs = [None] * len(lines)
    with torch.inference_mode():
        # one at a time: SequenceGenerator caps a whole batch by its longest source
        for indices, sample in translator.batches(translator.encode(lines), 1):
            for line, hypos in zip(indices, generator.generate([translator.verifier], sample)):
                outputs[line] = translator.decode(hypos[0]["tokens"])
    return outputs


def test_lossless_translations_are_the_verifiers_greedy_ones_in_order(translator):
    translations = translator.translate(SENTENCES, batch_size=3)
    # stock fairseq translates an empty source too; speculative decoding keeps it empty
    expected = [out if line.strip() else "" for line, out in zip(SENTENCES, stock_greedy(translator, SENTENCES))]
    assert translations == expected
    assert translations[2] == translations[4] == ""
    assert all(translations[i] for i in (0, 1, 3, 5, 6))
    stats = translator.statistics
    assert len(stats) == len(SENTENCES)
    assert stats[5]["iterations"] >= 1 and stats[5]["output_tokens"] > stats[5]["accepted_tokens"]


def test_one_sentence_in_one_string_out(translator):
    assert translator.translate("Guten Morgen.") == translator.translate(["Guten Morgen."])[0]


def test_lossless_translations_do_not_depend_on_the_batch(translator):
    together = translator.translate(SENTENCES, batch_size=7)
    alone = [translator.translate(line) for line in SENTENCES]
    assert together == alone


def test_samples_are_reproducible_with_a_seed(translator):
    lines = SENTENCES[:2] * 3
    first = translator.sample(lines, temperature=0.8, seed=5, verify="rsd", tree_branching="2,1,1")
    again = translator.sample(lines, temperature=0.8, seed=5, verify="rsd", tree_branching="2,1,1")
    other = translator.sample(lines, temperature=0.8, seed=6, verify="rsd", tree_branching="2,1,1")
    assert first == again and first != other
    assert all(first)
    # a translator made for RSD samples with RSD by default, with its own tree
    rsd = SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, verify="rsd", tree_branching="2,1,1")
    assert rsd.sample(lines, temperature=0.8, seed=5) == first


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda t: t.translate("x", beta=0), "--beta must be an integer >= 1"),
        (lambda t: t.translate("x", beams=3), "unknown setting(s) beams"),
        (lambda t: t.translate("x", verify="rsd", tree_budget=6), "use sample() to sample"),
        (lambda t: t.sample("x", verify="top_beta"), "sample() takes verify="),
        (lambda t: t.sample("x", temperature=0), "--temperature must be > 0"),
        (lambda t: t.translate(["x", 3]), "a string or a list of strings"),
        (lambda t: t.translate("x", batch_size=0), "batch_size must be >= 1"),
    ],
)
def test_bad_calls_raise_one_line_errors(translator, call, message):
    with pytest.raises(SpecNmtError) as error:
        call(translator)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_missing_model_file_is_named(tmp_path):
    with pytest.raises(SpecNmtError, match="verifier.pt is missing"):
        SpecTranslator.from_pretrained(tmp_path)
