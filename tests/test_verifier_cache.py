"""Block and tree scoring and cache rollback of the verifier adapter against full recomputation."""

from argparse import Namespace
from types import SimpleNamespace

import pytest
import torch
from fairseq.data import Dictionary
from fairseq.models.transformer import TransformerModel, base_architecture

from spec_nmt.decoding import linears, scripted_layers
from spec_nmt.decoding.linears import NEVER
from spec_nmt.decoding.scorer import BlockScorer
from spec_nmt.decoding.tree import block_visibility
from spec_nmt.errors import SpecNmtError

VOCAB = 24


# Every decoder shape a user can train with fairseq's transformer flags (--decoder-normalize-before,
# --layernorm-embedding, --decoder-learned-pos, --no-scale-embedding, --scale-*): block scoring
# must decode each of them exactly.
DECODER_VARIANTS = {
    "post-norm (default)": {},
    "pre-norm": {"encoder_normalize_before": True, "decoder_normalize_before": True},
    "layernorm-embedding": {"layernorm_embedding": True},
    "learned positions": {"learned_positions": True},
    "no-scale-embedding": {"no_scale_embedding": True},
    "scale-attn": {"scale_attn": True},
    "scale-fc": {"scale_fc": True},
    "scale-heads": {"scale_heads": True},
    "scale-resids": {"scale_resids": True},
    "no positional embeddings": {"no_token_positional_embeddings": True},
    "gelu": {"activation_fn": "gelu"},
    "decoder output dim != embed dim": {"share_all_embeddings": False, "decoder_output_dim": 24},
    "pre-norm, all scale-*, layernorm-embedding": {
        "encoder_normalize_before": True, "decoder_normalize_before": True,
        "layernorm_embedding": True, "scale_attn": True, "scale_fc": True, "scale_heads": True,
        "scale_resids": True,
    },
}  # fmt: skip


def tiny_transformer(learned_positions=False, seed=0, **variant):
    dictionary = Dictionary()
    for i in range(VOCAB):
        dictionary.add_symbol(f"w{i}")
    args = Namespace(
        encoder_layers=2, decoder_layers=2, encoder_embed_dim=32, decoder_embed_dim=32,
        encoder_ffn_embed_dim=64, decoder_ffn_embed_dim=64, encoder_attention_heads=4,
        decoder_attention_heads=4, dropout=0.0,
        max_source_positions=64, max_target_positions=64,
        decoder_learned_pos=learned_positions, encoder_learned_pos=learned_positions,
        **{"share_all_embeddings": True, **variant},
    )  # fmt: skip
    base_architecture(args)
    torch.manual_seed(seed)
    dictionaries = SimpleNamespace(source_dictionary=dictionary, target_dictionary=dictionary)
    model = TransformerModel.build_model(args, dictionaries).eval()
    with torch.no_grad():  # scale-* weights start as ones; make them matter
        for name, parameter in model.named_parameters():
            if name.endswith(("c_attn", "w_resid")):
                parameter.uniform_(0.5, 1.5)
    return model, dictionary


def random_tokens(dictionary, *shape):
    return torch.randint(dictionary.nspecial, len(dictionary), shape)


def full_forward_logprobs(model, net_input, decoder_input):
    """Reference: the stock decoder over the whole sequence, no cache."""
    encoder_out = model.encoder.forward_torchscript(net_input)
    out = model.decoder(decoder_input, encoder_out=encoder_out)
    return model.get_normalized_probs(out, log_probs=True)


def source_batch(dictionary, batch, length=7):
    src = random_tokens(dictionary, batch, length)
    src[:, -1] = dictionary.eos()
    src[0, :2] = dictionary.pad()  # left padding, as fairseq batches sources
    lengths = src.ne(dictionary.pad()).sum(1)
    return {"src_tokens": src, "src_lengths": lengths}


def block_logprobs(verifier, state, *block):
    return verifier.score_logits(state, *block).log_softmax(dim=-1)


def commit_prefix(verifier, state, width, keep, by_index=True):
    """Row b keeps the first keep[b] entries of the block just scored: named by index, or
    ``keep=None`` (a chain's accepted prefix)."""
    entries = torch.arange(width).expand(len(keep), -1) if by_index else None
    verifier.commit(state, entries, torch.tensor(keep))


def decoder_shape(model):
    """Which of the variant options the built decoder really has (the test would prove nothing
    if fairseq ignored a flag)."""
    decoder, layer = model.decoder, model.decoder.layers[0]
    return {
        "decoder_normalize_before": layer.normalize_before,
        "layernorm_embedding": decoder.layernorm_embedding is not None,
        "learned_positions": type(decoder.embed_positions).__name__ == "LearnedPositionalEmbedding",
        "no_scale_embedding": decoder.embed_scale == 1.0,
        "scale_attn": layer.attn_ln is not None,
        "scale_fc": layer.ffn_layernorm is not None,
        "scale_heads": layer.c_attn is not None,
        "scale_resids": layer.w_resid is not None,
        "no_token_positional_embeddings": decoder.embed_positions is None,
        "decoder_output_dim": decoder.project_out_dim is not None,
        "activation_fn": layer.activation_fn is scripted_layers.ACTIVATIONS[1],
    }


@pytest.mark.parametrize("variant", list(DECODER_VARIANTS))
@torch.no_grad()
def test_blocks_and_rollbacks_match_full_recomputation(variant):
    options = DECODER_VARIANTS[variant]
    model, dictionary = tiny_transformer(**options)
    built = {name for name, present in decoder_shape(model).items() if present}
    assert built == set(options) - {"encoder_normalize_before", "share_all_embeddings"}
    verifier = BlockScorer(model)
    net_input = source_batch(dictionary, 3)
    state = verifier.start(net_input)
    kept = torch.full((3, 1), dictionary.eos())  # what each row has fed so far, incl. the block
    kept = [kept[i] for i in range(3)]
    # per iteration: block width and how many block entries each row keeps (different per row,
    # so the cache gets holes and must be compacted)
    schedule = [(4, [2, 4, 1]), (3, [1, 3, 3]), (5, [5, 1, 2]), (2, [2, 2, 2])]
    for width, keep in schedule:
        pending = torch.stack([row[-1] for row in kept])
        block = torch.cat([pending.unsqueeze(1), random_tokens(dictionary, 3, width - 1)], 1)
        scores = block_logprobs(verifier, state, block)
        for b in range(3):
            sequence = torch.cat([kept[b][:-1], block[b]]).unsqueeze(0)
            row_input = {k: v[b : b + 1] for k, v in net_input.items()}
            reference = full_forward_logprobs(model, row_input, sequence)[0, -width:]
            torch.testing.assert_close(scores[b], reference, atol=2e-5, rtol=1e-5)
        commit_prefix(verifier, state, width, keep)
        # keep[b] block entries stay in the cache; the next pending token is any new token
        kept = [
            torch.cat([kept[b][:-1], block[b, : keep[b]], random_tokens(dictionary, 1)])
            for b in range(3)
        ]
        assert state.fed_lengths.tolist() == [len(row) - 1 for row in kept]


# the decoder shapes scripted_layers runs; the others go through the stock modules
SCRIPTED_VARIANTS = ("post-norm (default)", "pre-norm", "layernorm-embedding", "learned positions",
                     "no-scale-embedding", "no positional embeddings", "gelu")  # fmt: skip


@pytest.mark.parametrize("packed", [False, True], ids=["own products", "packed products"])
@pytest.mark.parametrize("variant", list(DECODER_VARIANTS))
@torch.no_grad()
def test_the_common_decoder_layers_run_as_one_scripted_call_with_the_modules_logits(
    monkeypatch, variant, packed
):
    """The same chain blocks (every row's block at the same slot, then at different ones after
    unequal commits) and a tree, scored through the scripted layers and through the stock
    modules, with the layers' own products and with packed ones: the same logits and the same
    caches."""
    if packed and not linears.packing_available():
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setattr(linears, "_packed_from",
                        lambda outputs, inputs, dtype: 1 if packed else NEVER)
    model, dictionary = tiny_transformer(**DECODER_VARIANTS[variant])
    assert scripted_layers.decoder_supported(model.decoder) == (variant in SCRIPTED_VARIANTS)
    scripted, modules = BlockScorer(model), BlockScorer(model)
    modules.layers_function = None
    net_input = source_batch(dictionary, 3)
    states = [scorer.start(net_input) for scorer in (scripted, modules)]
    parents = torch.tensor([TREE_PARENTS] * 3)
    tree = (torch.tensor([0] + TREE_DEPTHS), block_visibility(parents))
    for width, keep, shape in [(4, [4, 4, 4], ()), (3, [1, 3, 2], ()), (7, [1, 1, 1], tree)]:
        block = random_tokens(dictionary, 3, width)
        logits = [scorer.score_logits(state, block, *shape) for scorer, state in
                  zip((scripted, modules), states)]  # fmt: skip
        torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)
        for scorer, state in zip((scripted, modules), states):
            commit_prefix(scorer, state, width, keep)
    assert (scripted._scripted is not None) == (variant in SCRIPTED_VARIANTS)
    assert modules._scripted is None
    for ours, theirs in zip(states[0].keys + states[0].values, states[1].keys + states[1].values):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_int8_layers_go_through_the_modules():
    """--drafter-precision int8 replaces the feed-forward layers with dynamically quantized ones,
    which the scripted layers do not compute."""
    model, _ = tiny_transformer()
    assert scripted_layers.decoder_supported(model.decoder)
    quantized = torch.ao.quantization.quantize_dynamic(model, {"decoder.layers.1.fc1"},
                                                       dtype=torch.qint8)  # fmt: skip
    assert not scripted_layers.decoder_supported(quantized.decoder)
    assert BlockScorer(quantized).layers_function is None


@torch.no_grad()
def test_a_changed_weight_is_taken_again_and_training_goes_through_the_modules():
    model, dictionary = tiny_transformer()
    verifier = BlockScorer(model)
    net_input = source_batch(dictionary, 1)
    block = random_tokens(dictionary, 1, 3)

    def scores():
        state = verifier.start(net_input)
        return verifier.score_logits(state, block)

    scores()
    taken = verifier._scripted
    model.decoder.layers[1].fc2.weight.mul_(3)
    changed = scores()
    assert verifier._scripted is not taken
    reference = model.decoder(block, encoder_out=model.encoder.forward_torchscript(net_input))[0]
    torch.testing.assert_close(changed, reference, atol=2e-5, rtol=1e-5)
    model.train()
    assert verifier.scripted_layers() is None
    model.eval()
    with torch.enable_grad():
        assert verifier.scripted_layers() is None


@torch.no_grad()
def test_dropping_rows_keeps_the_others_exact():
    model, dictionary = tiny_transformer()
    verifier = BlockScorer(model)
    net_input = source_batch(dictionary, 3)
    state = verifier.start(net_input)
    block = torch.cat([torch.full((3, 1), dictionary.eos()), random_tokens(dictionary, 3, 3)], 1)
    block_logprobs(verifier, state, block)
    commit_prefix(verifier, state, 4, [3, 1, 2])
    rows = torch.tensor([0, 2])
    verifier.select_rows(state, rows)
    next_block = random_tokens(dictionary, 2, 2)
    scores = block_logprobs(verifier, state, next_block)
    for i, b in enumerate(rows.tolist()):
        keep = [3, 1, 2][b]
        sequence = torch.cat([block[b, :keep], next_block[i]]).unsqueeze(0)
        row_input = {k: v[b : b + 1] for k, v in net_input.items()}
        reference = full_forward_logprobs(model, row_input, sequence)[0, -2:]
        torch.testing.assert_close(scores[i], reference, atol=2e-5, rtol=1e-5)


def stock_incremental_keys(model, row_input, sequence):
    """Reference cache: every layer's self-attention keys and values [heads, len, head_dim] after
    fairseq's own incremental decoder has fed ``sequence`` one token at a time."""
    encoder_out = model.encoder.forward_torchscript(row_input)
    state = {}
    for step in range(1, len(sequence) + 1):
        prefix = sequence[:step].unsqueeze(0)
        model.decoder(prefix, encoder_out=encoder_out, incremental_state=state)
    buffers = [layer.self_attn._get_input_buffer(state) for layer in model.decoder.layers]
    return [(b["prev_key"][0], b["prev_value"][0]) for b in buffers]


@pytest.mark.parametrize("variant", ["post-norm (default)", "pre-norm"])
@torch.no_grad()
def test_cache_holds_exactly_the_committed_prefix_after_random_accepts_and_rejections(variant):
    """Random blocks, random per-row acceptance, one row leaving: each row's committed cache
    slots equal the keys/values fairseq's incremental decoder computes for that row's committed
    inputs, and the encoder attention's keys/values never change."""
    model, dictionary = tiny_transformer(**DECODER_VARIANTS[variant])
    verifier = BlockScorer(model)
    net_input = source_batch(dictionary, 3)
    state = verifier.start(net_input)
    encoder_keys = [k.clone() for k in state.encoder_keys]
    generator = torch.Generator().manual_seed(7)
    rows = [0, 1, 2]  # original row of each state row
    fed = [torch.tensor([dictionary.eos()]) for _ in range(3)]  # committed inputs + pending token
    for iteration in range(8):
        width = int(torch.randint(1, 6, (1,), generator=generator, device="cpu"))
        drafts = random_tokens(dictionary, len(rows), width - 1)
        block = torch.cat([torch.stack([fed[r][-1] for r in rows]).unsqueeze(1), drafts], 1)
        block_logprobs(verifier, state, block)
        keep = torch.randint(1, width + 1, (len(rows),), generator=generator, device="cpu").tolist()
        commit_prefix(verifier, state, width, keep, by_index=iteration % 2 == 0)
        for i, r in enumerate(rows):
            fed[r] = torch.cat([fed[r][:-1], block[i, : keep[i]], random_tokens(dictionary, 1)])
        if iteration == 3:  # the middle row finishes
            rows = [0, 2]
            verifier.select_rows(state, torch.tensor([0, 2]))
            encoder_keys = [k[[0, 2]] for k in encoder_keys]
        for i, r in enumerate(rows):
            committed = fed[r][:-1]
            assert int(state.fed_lengths[i]) == len(committed)
            row_input = {k: v[r : r + 1] for k, v in net_input.items()}
            reference = stock_incremental_keys(model, row_input, committed)
            for layer, (keys, values) in enumerate(reference):
                torch.testing.assert_close(state.keys[layer][i, :, : len(committed)], keys)
                torch.testing.assert_close(state.values[layer][i, :, : len(committed)], values)
    for before, after in zip(encoder_keys, state.encoder_keys):
        assert torch.equal(before, after)


# root → nodes 0, 1; node 0 → 2, 3; node 1 → 4; node 2 → 5 (entries: root, then node i at i+1)
TREE_PARENTS = [-1, -1, 0, 0, 1, 2]
TREE_DEPTHS = [1, 1, 2, 2, 2, 3]


def path_to(parents, node):
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def prefixed_state(verifier, dictionary, net_input, keep):
    """A state whose rows have committed different prefixes (so the cache has holes)."""
    state = verifier.start(net_input)
    batch = len(keep)
    first = torch.cat([torch.full((batch, 1), dictionary.eos()), random_tokens(dictionary, batch, 3)], 1)
    block_logprobs(verifier, state, first)
    commit_prefix(verifier, state, 4, keep)
    return state, [first[b, : keep[b]] for b in range(batch)]


@pytest.mark.parametrize("learned_positions", [False, True])
@torch.no_grad()
def test_tree_scores_equal_each_path_decoded_alone(learned_positions):
    model, dictionary = tiny_transformer(learned_positions)
    verifier = BlockScorer(model)
    net_input = source_batch(dictionary, 2)
    state, prefixes = prefixed_state(verifier, dictionary, net_input, [4, 2])
    parents = torch.tensor([TREE_PARENTS, TREE_PARENTS])
    parents[1] = torch.tensor([-1, -1, 1, 0, 0, 3])  # another shape in the other row
    block = random_tokens(dictionary, 2, 7)  # root (pending token) + 6 nodes
    depths = torch.tensor([0] + TREE_DEPTHS)
    scores = block_logprobs(verifier, state, block, depths, block_visibility(parents))
    for b in range(2):
        row_input = {k: v[b : b + 1] for k, v in net_input.items()}
        for node in range(-1, 6):
            path = [0] + [n + 1 for n in path_to(parents[b].tolist(), node)]
            sequence = torch.cat([prefixes[b], block[b, path]]).unsqueeze(0)
            reference = full_forward_logprobs(model, row_input, sequence)[0, -1]
            torch.testing.assert_close(scores[b, node + 1], reference, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("committed", [[3, 1], [3, 3]], ids=["unequal prefixes", "equal prefixes"])
@torch.no_grad()
def test_a_tree_fed_level_by_level_then_committed_matches_full_recomputation(committed):
    """How the autoregressive drafter uses the scorer: root, then one level per call, each
    seeing its ancestors among the uncommitted entries; then keep one path. Rows with equal
    committed prefixes take the scorer's shared-slot path."""
    model, dictionary = tiny_transformer(seed=3)
    verifier = BlockScorer(model)
    net_input = source_batch(dictionary, 2)
    state, prefixes = prefixed_state(verifier, dictionary, net_input, committed)
    parents = torch.tensor([TREE_PARENTS, TREE_PARENTS])
    visible = block_visibility(parents)
    tokens = random_tokens(dictionary, 2, 7)
    levels = [(0, 1), (1, 3), (3, 6), (6, 7)]  # entry ranges: root, depth 1, 2, 3
    for start, end in levels:
        depth = torch.tensor([0] + TREE_DEPTHS)[start:end]
        scores = block_logprobs(verifier, state, tokens[:, start:end], depth, visible[:, start:end, :end])
        for b in range(2):
            row_input = {k: v[b : b + 1] for k, v in net_input.items()}
            for entry in range(start, end):
                path = [0] + [n + 1 for n in path_to(TREE_PARENTS, entry - 1)]
                sequence = torch.cat([prefixes[b], tokens[b, path]]).unsqueeze(0)
                reference = full_forward_logprobs(model, row_input, sequence)[0, -1]
                torch.testing.assert_close(scores[b, entry - start], reference, atol=2e-5, rtol=1e-5)
    # row 0 keeps root → node 0 → node 2 → node 5, row 1 keeps root → node 1
    keep = torch.tensor([[0, 1, 3, 6], [0, 2, 0, 0]])
    verifier.commit(state, keep, torch.tensor([4, 2]))
    following = random_tokens(dictionary, 2, 2)
    scores = block_logprobs(verifier, state, following)
    for b in range(2):
        row_input = {k: v[b : b + 1] for k, v in net_input.items()}
        kept = tokens[b, keep[b, : [4, 2][b]]]
        sequence = torch.cat([prefixes[b], kept, following[b]]).unsqueeze(0)
        reference = full_forward_logprobs(model, row_input, sequence)[0, -2:]
        torch.testing.assert_close(scores[b], reference, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "options",
    [{"cross_self_attention": True}, {"share_all_embeddings": False, "adaptive_softmax_cutoff": "10"}],
)
def test_decoders_that_block_scoring_cannot_reproduce_are_refused_with_one_line(options):
    model, _ = tiny_transformer(**options)
    with pytest.raises(SpecNmtError, match="uses --cross-self-attention, an adaptive softmax"):
        BlockScorer(model)
