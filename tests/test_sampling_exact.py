"""Exactness, statistically: the first two output tokens (joint) of speculative sampling and of
RSD (both tree kinds) with every drafter kind (the NAR one also over a draft vocabulary) are
distributed exactly as sampling from the verifier; a broken acceptance rule fails the same
chi-square test.

Small random Transformers over a 9-symbol vocabulary, made here. The verifier's embeddings are
scaled up so that its distributions are peaked; the drafters' are flatter, so that many drafts
are accepted and many rejected."""

import copy
from argparse import Namespace
from types import SimpleNamespace

import pytest
import torch
from fairseq.data import Dictionary
from fairseq.models.transformer import TransformerModel, base_architecture
from fairseq.search import Sampling
from fairseq.sequence_generator import SequenceGenerator

from spec_nmt.decoding import rules as rules_module
from spec_nmt.decoding.loop import SpeculativeGenerator
from spec_nmt.decoding.rules import sampling_probs
from spec_nmt.decoding.scorer import BlockScorer
from spec_nmt.drafters.ar_drafter import ArDrafter
from spec_nmt.drafters.feature_drafter import FeatureDrafterModel
from spec_nmt.drafters.spec_drafter import (
    NarDrafter,
    SpecDrafterModel,
    restrict_output,
    spec_drafter_architecture,
)
from spec_nmt.settings import DecodingSettings
from spec_nmt.task import SpecTranslationConfig, SpecTranslationTask
from tests.stats import chi_square_pvalue

SAMPLES = 20000
BATCH = 5000
TEMPERATURE = 0.8
SOURCE = [4, 5, 6, 7, 8]
RULE_SETTINGS = {
    "sampling": {"verify": "sampling", "block_size": 3},
    "rsd-c": {"verify": "rsd", "tree_branching": "2,2,1"},
    "rsd-s": {"verify": "rsd", "block_size": 3, "tree_budget": 6},  # 2 beams, 3 levels
}


def model_args(decoder_layers):
    args = Namespace(
        encoder_layers=1, decoder_layers=decoder_layers, encoder_embed_dim=16,
        decoder_embed_dim=16, encoder_ffn_embed_dim=32, decoder_ffn_embed_dim=32,
        encoder_attention_heads=2, decoder_attention_heads=2, share_all_embeddings=True,
        dropout=0.0, max_source_positions=32, max_target_positions=32,
    )  # fmt: skip
    return args


def peaked(model, scale=2.0):
    with torch.no_grad():
        model.decoder.embed_tokens.weight.mul_(scale)
    return model.eval()


@pytest.fixture(scope="module")
def models():
    return build_models()


def build_models():
    dictionary = Dictionary()
    for i in range(5):
        dictionary.add_symbol(f"w{i}")
    dictionaries = SimpleNamespace(source_dictionary=dictionary, target_dictionary=dictionary)
    torch.manual_seed(0)
    args = model_args(2)
    base_architecture(args)
    verifier = peaked(TransformerModel.build_model(args, dictionaries))
    torch.manual_seed(1)
    args = model_args(1)
    base_architecture(args)
    ar_drafter = peaked(TransformerModel.build_model(args, dictionaries), scale=1.0)
    torch.manual_seed(2)
    task = SpecTranslationTask(SpecTranslationConfig(block_size=3), dictionary, dictionary)
    args = model_args(1)
    spec_drafter_architecture(args)
    nar_drafter = peaked(SpecDrafterModel.build_model(args, task), scale=1.0)
    pad, eos = dictionary.pad(), dictionary.eos()
    # a draft vocabulary without <unk>, w3 and w4: the verifier's samples of those come from
    # the residual only
    restricted_drafter = copy.deepcopy(nar_drafter)
    vocabulary = torch.tensor([eos, 4, 5, 6])
    restrict_output(restricted_drafter.decoder, vocabulary)
    torch.manual_seed(3)
    feature_drafter = FeatureDrafterModel(verifier, unroll_steps=1, dropout=0.0).eval()
    return {
        "dictionary": dictionary,
        "verifier": verifier,
        "ar": ArDrafter(ar_drafter, pad, eos),
        "feature": feature_drafter.decoding_adapter(pad, eos),
        "nar": NarDrafter(nar_drafter, pad, eos),
        "nar-vocabulary": NarDrafter(restricted_drafter, pad, eos, vocabulary),
    }


def batch(dictionary, rows):
    src = torch.tensor(SOURCE + [dictionary.eos()]).expand(rows, -1)
    return {"net_input": {"src_tokens": src, "src_lengths": torch.full((rows,), src.size(1))}}


@torch.no_grad()
def exact_joint(models, topk=-1, topp=-1.0):
    """q(x1) q(x2 | x1) [V, V] from full forwards of the stock decoder, with the adjustments
    fairseq's sampling makes (temperature, no pad, no EOS first: --min-len 1)."""
    model, dictionary = models["verifier"], models["dictionary"]
    vocab = len(dictionary)
    net_input = batch(dictionary, vocab)["net_input"]
    encoder_out = model.encoder.forward_torchscript(net_input)
    eos, pad = dictionary.eos(), dictionary.pad()
    prefixes = torch.stack([torch.full((vocab,), eos), torch.arange(vocab)], dim=1)
    logits, _ = model.decoder(prefixes, encoder_out=encoder_out)
    logprobs = (logits / TEMPERATURE).log_softmax(-1)
    logprobs[:, :, pad] = float("-inf")
    logprobs[:, 0, eos] = float("-inf")
    probs = sampling_probs(logprobs, topk, topp)
    return probs[0, 0].unsqueeze(1) * probs[:, 1]


def first_two_counts(generate, dictionary):
    vocab = len(dictionary)
    counts = torch.zeros(vocab * vocab, dtype=torch.long)
    for _ in range(SAMPLES // BATCH):
        for hypos in generate(batch(dictionary, BATCH)):
            first, second = hypos[0]["tokens"][:2].tolist()
            counts[first * vocab + second] += 1
    return counts


def speculative(models, drafter, rule, seed=0, topk=-1):
    settings = DecodingSettings(**RULE_SETTINGS[rule], temperature=TEMPERATURE,
                                sampling_topk=topk, seed=seed, max_len_a=0, max_len_b=2,
                                max_draft_batch=0)  # fmt: skip
    return SpeculativeGenerator(
        BlockScorer(models["verifier"], temperature=TEMPERATURE), models[drafter],
        models["dictionary"], settings,
    )  # fmt: skip


@pytest.mark.parametrize("drafter", ["nar", "ar", "nar-vocabulary", "feature"])
@pytest.mark.parametrize("rule", ["sampling", "rsd-c", "rsd-s"])
def test_first_two_tokens_follow_the_verifier(models, drafter, rule):
    generator = speculative(models, drafter, rule)
    counts = first_two_counts(lambda s: generator.generate(None, s), models["dictionary"])
    pvalue = chi_square_pvalue(counts, exact_joint(models).flatten())
    print(f"{rule} {drafter}: {generator.stats.summary()}; p = {pvalue:.3g}")
    assert generator.stats.accepted_tokens > 0.2 * SAMPLES  # the drafts matter
    assert pvalue > 1e-3, f"{rule} with the {drafter} drafter: p = {pvalue:.2e}"


def test_sampling_without_drafts_is_exact(models):
    """--block-size 0: no drafter at all, every token the verifier's own sample."""
    settings = DecodingSettings(verify="sampling", block_size=0, temperature=TEMPERATURE,
                                max_len_a=0, max_len_b=2)  # fmt: skip
    generator = SpeculativeGenerator(
        BlockScorer(models["verifier"], temperature=TEMPERATURE), models["nar"],
        models["dictionary"], settings,
    )  # fmt: skip
    counts = first_two_counts(lambda s: generator.generate(None, s), models["dictionary"])
    assert generator.stats.drafted_tokens == 0
    assert chi_square_pvalue(counts, exact_joint(models).flatten()) > 1e-3


def test_top_k_sampling_is_exact_too(models):
    generator = speculative(models, "ar", "rsd-c", topk=3)
    counts = first_two_counts(lambda s: generator.generate(None, s), models["dictionary"])
    assert chi_square_pvalue(counts, exact_joint(models, topk=3).flatten()) > 1e-3


def test_the_reference_is_what_fairseq_sampling_draws(models):
    stock = SequenceGenerator(
        [models["verifier"]], models["dictionary"], beam_size=1, max_len_b=2,
        temperature=TEMPERATURE, search_strategy=Sampling(models["dictionary"]),
    )  # fmt: skip
    torch.manual_seed(0)
    counts = first_two_counts(lambda s: stock.generate([models["verifier"]], s), models["dictionary"])
    assert chi_square_pvalue(counts, exact_joint(models).flatten()) > 1e-3


def always_accept(draft_tokens, draft_probs, verifier_probs, eos, generator=None, uniforms=None,
                  valid=None):
    """Broken speculative sampling: accept every draft the verifier does not rule out."""
    k = draft_tokens.size(1)
    allowed = verifier_probs[:, :k].gather(2, draft_tokens.unsqueeze(2)).squeeze(2) > 0
    n_accepted = allowed.long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(draft_tokens.size(0))
    following = torch.multinomial(verifier_probs[rows, n_accepted], 1, generator=generator)
    return n_accepted, following.squeeze(1)


def keep_first_child(tree, verifier_probs, eos, generator=None):
    """Broken RSD: walk down the first child of every node while the verifier allows it."""
    rows = torch.arange(tree.tokens.size(0))
    depth = int(tree.depths.max())
    children = rules_module.children_table(tree)
    path = torch.full((len(rows), depth), -1, dtype=torch.long)
    current = torch.zeros(len(rows), dtype=torch.long)
    walking = torch.ones(len(rows), dtype=torch.bool)
    for level in range(depth):
        child = children[rows, current, 0]
        token = tree.tokens[rows, child.clamp(min=0)]
        walking &= child.ge(0) & verifier_probs[rows, current, token].gt(0)
        path[:, level] = torch.where(walking, child, -1)
        current = torch.where(walking, child + 1, current)
    n_accepted = path.ge(0).sum(dim=1)
    following = torch.multinomial(verifier_probs[rows, current], 1, generator=generator)
    return path, n_accepted, following.squeeze(1)


@pytest.mark.parametrize("rule,broken", [("sampling", always_accept), ("rsd-c", keep_first_child)])
def test_a_broken_rule_fails_the_same_test(models, monkeypatch, rule, broken):
    name = "speculative_sample" if rule == "sampling" else "recursive_rejection"
    monkeypatch.setattr(rules_module, name, broken)
    generator = speculative(models, "ar", rule)
    counts = first_two_counts(lambda s: generator.generate(None, s), models["dictionary"])
    assert chi_square_pvalue(counts, exact_joint(models).flatten()) < 1e-3


def test_a_seed_reproduces_the_samples_and_another_seed_changes_them(models):
    def run(seed):
        generator = speculative(models, "nar", "rsd-s", seed=seed)
        return [h[0]["tokens"].tolist() for h in generator.generate(None, batch(models["dictionary"], 200))]

    assert run(3) == run(3)
    assert run(3) != run(4)
