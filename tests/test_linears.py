"""Prepacked fp32 linear layers (spec_nmt/decoding/linears.py): the same products as the layers'
own, packed when they are made, bypassed where a gradient is needed or the weight or input is
no longer what was packed, run packed from the row count timed for their shape, packed once per
verifier by the task; the encoder forward with the scripted layers gives the stock encoder's
output, and in training the stock forward runs."""

import json

import pytest
import torch
from torch import nn

from spec_nmt.decoding import block_forward, linears, scripted_layers
from spec_nmt.decoding.linears import NEVER, PackedLinears, packed_dtypes, packing_available
from spec_nmt.decoding.scorer import BlockScorer
from spec_nmt.settings import DEFAULTS
from spec_nmt.translator import SpecTranslator
from tests.conftest import BUNDLED_MODEL_DIR
from tests.test_verifier_cache import DECODER_VARIANTS, source_batch, tiny_transformer

needs_onednn = pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN")


@pytest.fixture
def packed_from_one_row(monkeypatch):
    """Every weight shape runs packed from one row on, whatever this CPU's timings say."""
    monkeypatch.setattr(linears, "_packed_from", lambda outputs, inputs, dtype: 1)


def layers():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.Linear(1024, 256), nn.Linear(8, 8))


@needs_onednn
@torch.no_grad()
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_packed_products_are_the_layers_own(packed_from_one_row, dtype, tolerance):
    """In fp32, and in bf16 (a drafter's, --drafter-precision), up to rounding."""
    if dtype not in packed_dtypes():
        pytest.skip("oneDNN's bf16 path needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT")
    model = layers().to(dtype)
    project = PackedLinears(model)
    assert set(project.weights) == set(model)  # every fp32 or bf16 linear layer
    wide, narrow, small = model
    close = dict(rtol=tolerance, atol=tolerance)
    for rows in (1, 4, 11, 96):
        x = torch.randn(rows, 256, dtype=dtype)
        torch.testing.assert_close(project(wide, x), wide(x), **close)
    # 3-d and not contiguous, as the decoder's [W, B, C] features after a transpose
    x = torch.randn(4, 3, 1024, dtype=dtype).transpose(0, 1)
    torch.testing.assert_close(project(narrow, x), narrow(x), **close)
    x = torch.randn(1, 8, dtype=dtype)
    torch.testing.assert_close(project(small, x), small(x), **close)
    # an input in another dtype goes to the layer itself (which refuses it)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    assert not project._serves(wide, torch.randn(4, 256, dtype=other))


def calls_of(layer):
    """How often the layer itself runs (the packed path does not run it)."""
    calls = []
    layer.register_forward_hook(lambda *_: calls.append(1))
    return calls


@needs_onednn
@torch.no_grad()
def test_a_weight_changed_or_an_input_of_another_dtype_goes_to_the_layer_itself(
    packed_from_one_row,
):
    """The packed copy serves only the weight it was made from, and fp32 CPU inputs: a weight
    changed in place or replaced (load_state_dict, .to) and a bf16 input get the layer's own
    product."""
    model = layers()
    wide, narrow = model[0], model[1]
    wide_calls, narrow_calls = calls_of(wide), calls_of(narrow)
    project = PackedLinears(model)
    x = torch.randn(8, 256)
    project(wide, x)
    assert not wide_calls  # packed
    wide.weight.mul_(2)
    assert torch.equal(project(wide, x), wide(x)) and len(wide_calls) == 2
    fresh = PackedLinears(model)
    fresh(wide, x)
    assert len(wide_calls) == 2  # packed again
    wide.weight = nn.Parameter(wide.weight.detach().clone())
    fresh(wide, x)
    assert len(wide_calls) == 3
    narrow.to(torch.bfloat16)
    x = torch.randn(8, 1024, dtype=torch.bfloat16)
    assert torch.equal(fresh(narrow, x), narrow(x)) and len(narrow_calls) == 2


@needs_onednn
@torch.no_grad()
def test_an_attentions_query_key_and_value_are_one_product(packed_from_one_row):
    """Self-attention's three projections of one input: packed together, the same outputs as
    the layers', one product (none of the layers runs); a changed weight splits them again."""
    model, _ = tiny_transformer()
    attn = model.decoder.layers[0].self_attn
    layers = (attn.q_proj, attn.k_proj, attn.v_proj)
    project = PackedLinears(model)
    assert layers in project.groups
    cross = model.decoder.layers[0].encoder_attn  # its keys and values read another input
    assert (cross.q_proj, cross.k_proj, cross.v_proj) not in project.groups
    calls = [calls_of(layer) for layer in layers]
    x = torch.randn(5, 2, 32)
    for ours, layer in zip(project.many(layers, x), layers):
        torch.testing.assert_close(ours, layer(x), rtol=1e-5, atol=1e-5)
    assert [len(c) for c in calls] == [1, 1, 1]  # only the reference calls above
    attn.k_proj.weight.add_(1)
    for ours, layer in zip(project.many(layers, x), layers):
        torch.testing.assert_close(ours, layer(x), rtol=1e-5, atol=1e-5)
    assert len(calls[1]) == 3  # the changed layer ran itself


@pytest.mark.parametrize("packed_faster, packed_from", [
    ([False, False, True, True], 16), ([True] * 4, 1), ([True, False, True, True], 16),
    ([False] * 4, linears.NEVER), ([True, True, True, False], linears.NEVER),
])  # fmt: skip
def test_a_shape_runs_packed_from_where_packing_won_for_good(packed_faster, packed_from):
    assert linears.first_of_last_run((1, 4, 16, 64), packed_faster) == packed_from


def test_a_machines_choice_is_timed_once_then_read_back(monkeypatch, tmp_path):
    """The first packing of a shape on a machine times it and records the choice; later ones
    (other processes, later runs) read it, so every run here rounds alike."""
    monkeypatch.setattr(linears, "CHOICES_FILE", tmp_path / "cache" / "kernels.json")
    timed = []
    monkeypatch.setattr(linears, "_timed_packed_from",
                        lambda outputs, inputs, dtype: timed.append((outputs, inputs, dtype))
                        or 16)  # fmt: skip
    fp32, bf16 = torch.float32, torch.bfloat16
    assert linears._packed_from(8, 4, fp32) == 16 and timed == [(8, 4, fp32)]
    assert linears._packed_from(8, 4, fp32) == 16 and timed == [(8, 4, fp32)]
    assert linears._packed_from(4, 8, fp32) == 16 and timed == [(8, 4, fp32), (4, 8, fp32)]
    assert linears._packed_from(8, 4, bf16) == 16 and timed[-1] == (8, 4, bf16)  # its own
    recorded = json.loads((tmp_path / "cache" / "kernels.json").read_text())
    assert recorded == {linears._machine(): {"8x4": 16, "4x8": 16, "8x4 bfloat16": 16}}


def test_a_choice_recorded_from_other_timed_row_counts_is_timed_again(monkeypatch, tmp_path):
    """Records made when fewer row counts were timed (before 2 and 3 were: blocks of k = 1, 2
    ran MKL's slower product on the AMD EPYC) are not read: the shape is timed again."""
    monkeypatch.setattr(linears, "CHOICES_FILE", tmp_path / "kernels.json")
    monkeypatch.setattr(linears, "TIMED_ROWS", (1, 4, 16, 64))
    stale = linears._machine()
    monkeypatch.setattr(linears, "TIMED_ROWS", (1, 2, 3, 4, 16, 64))
    (tmp_path / "kernels.json").write_text(json.dumps({stale: {"8x4": 4}}))
    timed = []
    monkeypatch.setattr(linears, "_timed_packed_from",
                        lambda outputs, inputs, dtype: timed.append((outputs, inputs)) or 2)
    assert linears._packed_from(8, 4, torch.float32) == 2 and timed == [(8, 4)]


def test_a_choice_timed_in_cache_is_timed_again(monkeypatch, tmp_path):
    """Records timed on one copy of the weight, in cache (MKL won shapes there that ran slower
    in decoding), are not read: the shape is timed again, its weight read from memory."""
    monkeypatch.setattr(linears, "CHOICES_FILE", tmp_path / "kernels.json")
    in_cache = linears._machine().removesuffix(" | streamed")  # (the key as it was)
    (tmp_path / "kernels.json").write_text(json.dumps({in_cache: {"8x4": 2}}))
    monkeypatch.setattr(linears, "_timed_packed_from", lambda outputs, inputs, dtype: 1)
    assert linears._packed_from(8, 4, torch.float32) == 1
    recorded = json.loads((tmp_path / "kernels.json").read_text())
    assert recorded == {in_cache: {"8x4": 2}, linears._machine(): {"8x4": 1}}


def test_the_last_level_cache_is_the_largest_linux_reports(tmp_path):
    for index, size in (("index0", "48K"), ("index2", "1024K"), ("index3", "32768K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    assert linears._last_level_cache_bytes(tmp_path) == 32 << 20
    (tmp_path / "index4").mkdir()
    (tmp_path / "index4" / "size").write_text("64M\n")
    (tmp_path / "index5").mkdir()
    (tmp_path / "index5" / "size").write_text("unknown\n")  # (not a size: not read)
    assert linears._last_level_cache_bytes(tmp_path) == 64 << 20
    assert linears._last_level_cache_bytes(tmp_path / "none") == linears.LAST_LEVEL_CACHE_BYTES


@needs_onednn
def test_timing_the_kernels_leaves_the_random_state_alone():
    state = torch.get_rng_state()
    linears._timed_packed_from(16, 8, torch.float32)
    assert torch.equal(torch.get_rng_state(), state)


@needs_onednn
@torch.no_grad()
def test_fewer_rows_than_a_shape_runs_packed_from_go_to_the_layer_itself(monkeypatch):
    """Each shape's own row count (timed when packed) decides, alone and in a group."""
    monkeypatch.setattr(linears, "_packed_from", lambda outputs, inputs, dtype: 16)
    model, _ = tiny_transformer()
    attn = model.decoder.layers[0].self_attn
    group = (attn.q_proj, attn.k_proj, attn.v_proj)
    project = PackedLinears(model)
    assert set(project.packed_from.values()) == {16}
    calls = calls_of(attn.out_proj)
    project(attn.out_proj, torch.randn(3, 5, 32))
    assert len(calls) == 1 and project.packed_weight(group, 15) is None
    project(attn.out_proj, torch.randn(4, 4, 32))
    assert len(calls) == 1 and project.packed_weight(group, 16) is project.groups[group].weight
    assert project.choice(15) == (False,) * len(project.packed_from)


@needs_onednn
def test_a_gradient_goes_through_the_layer_itself():
    model = layers()
    wide = model[0]
    x = torch.randn(8, 256, requires_grad=True)
    PackedLinears(model)(wide, x).sum().backward()
    assert wide.weight.grad is not None and x.grad is not None


@needs_onednn
def test_the_task_packs_a_verifier_once():
    translator = SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, device="cpu")
    task, verifier = translator.task, translator.verifier
    first = task.generator_for(verifier, translator.drafter, DEFAULTS).verifier.project
    second = task.generator_for(verifier, translator.drafter, DEFAULTS.replace(temperature=0.5))
    assert second.verifier.project is first
    assert verifier.decoder.output_projection in first.weights
    assert verifier.encoder.layers[0].fc1 in first.weights


@torch.no_grad()
@pytest.mark.parametrize("variant", list(DECODER_VARIANTS))
@pytest.mark.parametrize("packed", [False, True], ids=["own products", "packed products"])
def test_the_encoder_forward_gives_the_stock_encoders_output(monkeypatch, variant, packed):
    """Every encoder shape of the verifier variants (post- and pre-norm, layernorm-embedding,
    learned or no positions, GELU, ...), a left-padded batch and one sentence alone: the same
    output at every real token (only they are computed: zeros at the padding), the same
    padding and lengths, with the layers' own products and with packed ones."""
    if packed and not packing_available():
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setattr(linears, "_packed_from",
                        lambda outputs, inputs, dtype: 1 if packed else NEVER)
    model, dictionary = tiny_transformer(**DECODER_VARIANTS[variant])
    assert scripted_layers.encoder_supported(model.encoder)
    verifier = BlockScorer(model)
    for rows in (3, 1):
        net_input = source_batch(dictionary, rows)
        if rows == 1:  # one sentence has no padding
            net_input = {"src_tokens": net_input["src_tokens"][:, 2:],
                         "src_lengths": net_input["src_lengths"]}  # fmt: skip
        stock = model.encoder.forward_torchscript(net_input)
        real = ~stock["encoder_padding_mask"][0].t().unsqueeze(2)  # [S, B, 1]
        ours = verifier.encode(net_input)
        assert set(ours) == set(stock) and verifier._scripted_encoder is not None
        difference = (ours["encoder_out"][0] - stock["encoder_out"][0]) * real
        assert difference.abs().max() < 1e-5
        assert not ours["encoder_out"][0].masked_select(~real).any()
        assert real.logical_not().any() == (rows > 1)
        for key in ("encoder_padding_mask", "encoder_embedding", "src_lengths"):
            assert torch.equal(ours[key][0], stock[key][0]), key


@torch.no_grad()
@pytest.mark.parametrize("mask", ["per query", "per row", "none"])
@pytest.mark.parametrize("batch, queries", [(1, 4), (1, 40), (8, 1), (16, 4)])
def test_attention_is_the_same_through_either_kernel(batch, queries, mask):
    """Few queries per head go through scaled_dot_product_attention, many through two batched
    products (faster there): both give a plain masked softmax attention with the module's
    scaling, under every mask form the forwards use (per query [B, 1, W, S], per row as the
    source padding [B, 1, 1, S], none), a query that sees one key included."""
    model, _ = tiny_transformer()
    attn = model.decoder.layers[0].self_attn.eval()
    heads, keys_count = attn.num_heads, 7
    head_dim = attn.embed_dim // heads
    query = torch.randn(batch, heads, queries, head_dim)
    keys, values = torch.randn(2, batch, heads, keys_count, head_dim)
    seen = torch.rand(batch, queries, keys_count) < 0.6
    seen[..., 0] = True  # no row without a key
    seen[0, 0] = False
    seen[0, 0, 3] = True  # one query sees a single key: its output is that key's value
    if mask == "per row":
        seen = seen[:, :1].expand_as(seen)
    elif mask == "none":
        seen = torch.ones_like(seen)
    bias = {"per query": lambda: block_forward.additive_mask(seen, query.dtype),
            "per row": lambda: block_forward.additive_mask(seen[:, :1], query.dtype),
            "none": lambda: None}[mask]()  # fmt: skip
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        ours = block_forward._attention(attn, query, keys, values, bias)  # [T, B, C]
    sdpa_ran = any(event.name == "aten::scaled_dot_product_attention"
                   for event in profile.events())  # fmt: skip
    weights = (query @ keys.transpose(-1, -2) * attn.scaling).masked_fill(~seen.unsqueeze(1), -1e9)
    expected = block_forward.merge_heads(weights.softmax(-1) @ values)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    if mask != "none":
        torch.testing.assert_close(ours[0, 0], values[0, :, 3].flatten(), rtol=1e-5, atol=1e-5)
    assert sdpa_ran == ((batch, queries) in ((1, 4), (8, 1)))  # else the products ran
