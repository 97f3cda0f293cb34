"""The Python API on the bundled model pair: text in, text out, in order, exactly the verifier's
greedy translation in lossless mode, reproducible samples, per-sentence statistics, clear errors."""

import re

import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

from spec_nmt import loading, options
from spec_nmt.errors import SpecNmtError
from spec_nmt.loading import INT8_LAYERS
from spec_nmt.settings import DEFAULTS
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
    translations = translator.translate(SENTENCES, batch_size=3, max_draft_batch=0)
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
    together = translator.translate(SENTENCES, batch_size=7, max_draft_batch=0)
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
    # one made for greedy beam trees samples its tree with RSD-S
    beam = SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, block_size=3, tree_budget=6)
    assert beam.sample(lines, temperature=0.8, seed=5) == translator.sample(
        lines, temperature=0.8, seed=5, verify="rsd", block_size=3, tree_budget=6
    )


@pytest.mark.parametrize(
    "call,message",
    [
        # the API names the keywords its caller used, not the command line's flags (issue 58)
        (lambda t: t.translate("x", beta=0), "beta must be an integer >= 1, got 0"),
        (lambda t: t.translate("x", beta=3, max_draft_batch=2),
         "max_draft_batch=2 with a relaxed top-beta/tau (beta=3)"),
        (lambda t: t.translate("x", block_size=0, tree_branching="2,1"),
         "block_size=0 (no drafts) decodes with the verifier alone"),
        # as the command line refuses --temperature without a sampling rule
        (lambda t: t.translate("x", temperature=0.5),
         "temperature sets how to sample: call sample() instead of translate()"),
        (lambda t: t.translate("x", seed=3, sampling_topk=5),
         "sampling_topk, seed set how to sample"),
        (lambda t: t.translate("x", beams=3), "unknown setting(s) beams"),
        (lambda t: t.translate("x", verify="rsd", tree_budget=6), "use sample() to sample"),
        (lambda t: t.sample("x", verify="top_beta"), "sample() takes verify="),
        (lambda t: t.sample("x", temperature=0), "temperature must be > 0"),
        (lambda t: t.translate(["x", 3]), "a string or a list of strings"),
        (lambda t: t.translate("x", batch_size=0), "batch_size must be >= 1"),
        (lambda t: t.translate("x", beta=2, max_draft_batch=1), "depend on its batch"),
    ],
)
def test_bad_calls_raise_one_line_errors(translator, call, message):
    with pytest.raises(SpecNmtError) as error:
        call(translator)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert "--" not in str(error.value)  # no command-line flag in the API's words


def test_the_translators_defaults_may_hold_sampling_settings_for_sample():
    """from_pretrained's settings are defaults for sample() too: a temperature there is no
    request to sample greedy translations, so translate() keeps working."""
    warm = SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, device="cpu", temperature=0.7)
    assert warm.translate("Guten Morgen.") == "Good morning."
    with pytest.raises(SpecNmtError, match="^beta must be an integer >= 1, got 0$"):
        SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, device="cpu", beta=0)


def test_a_missing_model_file_is_named(tmp_path):
    with pytest.raises(SpecNmtError, match="verifier.pt is missing"):
        SpecTranslator.from_pretrained(tmp_path)


def test_a_model_directory_may_hold_a_drafter_for_the_device(tmp_path):
    """drafter.DEVICE.pt (the one measured fastest there) wins over drafter.pt on that device
    only; --drafter-path over both."""
    for name in ("verifier.pt", "dict.de.txt", "dict.en.txt", "spm.model", "drafter.pt"):
        (tmp_path / name).symlink_to(BUNDLED_MODEL_DIR / name)
    assert SpecTranslator.from_pretrained(tmp_path, device="cpu").drafter_path == (
        tmp_path / "drafter.pt")
    (tmp_path / "drafter.cuda.pt").symlink_to(BUNDLED_MODEL_DIR / "drafter.pt")
    assert SpecTranslator.from_pretrained(tmp_path, device="cpu").drafter_path.name == "drafter.pt"
    (tmp_path / "drafter.cpu.pt").symlink_to(BUNDLED_MODEL_DIR / "drafter.pt")
    pair = SpecTranslator.from_pretrained(tmp_path, device="cpu")
    assert pair.drafter_path == tmp_path / "drafter.cpu.pt"
    assert pair.translate("Guten Morgen.") == SpecTranslator.from_pretrained(
        BUNDLED_MODEL_DIR, device="cpu").translate("Guten Morgen.")
    chosen = SpecTranslator.from_pretrained(tmp_path, tmp_path / "drafter.pt", device="cpu")
    assert chosen.drafter_path == tmp_path / "drafter.pt"


def int8_layer_names(model):
    return {name for name, module in model.named_modules()
            if isinstance(module, torch.ao.nn.quantized.dynamic.Linear)}  # fmt: skip


@pytest.mark.parametrize("native", [True, False])
def test_drafter_precision_auto_is_bf16_where_the_cpu_multiplies_bf16(monkeypatch, native):
    """auto (the default) runs the cached drafter's decoder in bf16 on a CPU with native bf16
    products, else in fp32; the verifier and the drafter's encoder copy stay fp32, so lossless
    output does not change, and --stats' precision says which ran."""
    monkeypatch.setattr(loading, "native_bf16", lambda: native)
    auto = SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, device="cpu", drafter="file")
    fp32 = SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, device="cpu", drafter="file",
                                          drafter_precision="fp32")  # fmt: skip
    wanted = torch.bfloat16 if native else torch.float32
    assert {p.dtype for p in auto.drafter.model.decoder.parameters()} == {wanted}
    assert {p.dtype for p in auto.drafter.model.encoder.parameters()} == {torch.float32}
    assert {p.dtype for p in auto.verifier.parameters()} == {torch.float32}
    assert auto.drafter.precision == ("bf16" if native else "fp32")
    assert fp32.drafter.precision == "fp32"
    assert auto.translate(SENTENCES, batch_size=1) == fp32.translate(SENTENCES)
    assert auto.decoding_stats.accepted_tokens > 0  # (drafts for a sentence alone)
    # the relaxed rule, whose output the drafts decide, drafts in fp32: bf16 drafts depend a
    # little on the batch (test_batch_invariance.py holds translations to it)
    relaxed = auto.generator(beta=3, tau=1.0).drafter
    assert relaxed.precision == "fp32" and (relaxed is not auto.drafter) == native
    assert relaxed.model.decoder.embed_tokens.weight.dtype == torch.float32
    assert auto.generator().drafter is auto.drafter


def test_drafter_precision_int8_quantizes_the_feed_forward_and_output_layers():
    """int8 (opt-in) puts the drafter's feed-forward layers and output projection in int8, never
    the verifier's, so lossless output does not change."""
    int8 = SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, device="cpu", drafter_precision="int8")
    fp32 = SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, device="cpu", drafter_precision="fp32")
    assert not int8_layer_names(fp32.drafter.model)
    feed_forward_and_output = {
        name for name, module in fp32.drafter.model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in INT8_LAYERS
    }  # fmt: skip
    assert len(feed_forward_and_output) > 4  # both drafter kinds' FFNs and output projection
    assert int8_layer_names(int8.drafter.model) == feed_forward_and_output
    assert not int8_layer_names(int8.verifier)
    assert int8.drafter.precision == "int8"
    assert int8.translate(SENTENCES) == fp32.translate(SENTENCES)


@pytest.mark.parametrize(
    "precision,device,dtype,cached,native,decided",
    [("auto", "cpu", torch.float32, True, True, "bf16"),
     ("auto", "cpu", torch.float32, True, False, "fp32"),
     ("auto", "cpu", torch.float32, False, True, "fp32"),
     ("auto", "cpu", torch.float16, True, True, "fp32"),
     ("auto", "meta", torch.float32, True, True, "fp32"),
     ("fp32", "cpu", torch.float32, True, True, "fp32"),
     ("bf16", "cpu", torch.float32, True, False, "bf16"),
     ("bf16", "cpu", torch.float32, False, True, "serves the cached drafter only"),
     ("bf16", "meta", torch.float32, True, True, "CPU in fp32 only"),
     ("int8", "cpu", torch.float32, False, True, "int8"),
     ("int8", "cpu", torch.float16, True, True, "CPU in fp32 only"),
     ("int8", "meta", torch.float32, True, True, "CPU in fp32 only"),
     ("INT8", "cpu", torch.float32, True, True,
      "must be one of auto, fp32, bf16, int8, got 'INT8'")],
)  # fmt: skip
def test_drafter_precision_decides_by_device_dtype_drafter_and_cpu(monkeypatch, precision, device,
                                                                   dtype, cached, native,
                                                                   decided):  # fmt: skip
    """auto means bf16 only for a cached drafter on a CPU with native bf16 products, in fp32;
    bf16 and int8 elsewhere are refused (bf16 also for other drafters), and so is a precision
    that does not exist."""
    monkeypatch.setattr(loading, "native_bf16", lambda: native)
    if decided not in options.DRAFTER_PRECISION_NAMES:
        with pytest.raises(SpecNmtError, match=re.escape(decided)):
            loading.drafter_precision(precision, device, dtype, cached)
    else:
        assert loading.drafter_precision(precision, device, dtype, cached) == decided


@pytest.mark.parametrize(
    "settings, limit",
    [
        ({}, 1),  # lossless: drafts only for a sentence alone
        ({"verify": "rsd"}, 1),
        ({"verify": "sampling"}, 1),
        ({"beta": 1, "tau": 0.5}, 1),  # beta 1: only the best token passes, whatever tau
        ({"beta": 3, "tau": 1.0}, 0),  # relaxed: its drafts decide it, so every batch drafts
        ({"max_draft_batch": 0}, 0),
        ({"max_draft_batch": 8}, 8),
        ({"beta": 3, "tau": 1.0, "max_draft_batch": 0}, 0),
    ],
)
def test_the_drafting_batch_limit_by_rule(settings, limit):
    assert DEFAULTS.replace(**settings).draft_batch_limit() == limit
