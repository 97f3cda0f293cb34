"""Prepacked fp32 linear layers (spec_nmt/decoding/linears.py): the same products as the layers'
own, packed when they are made, bypassed where a gradient is needed, packed once per verifier by
the task; the encoder forward that uses them gives the stock encoder's output."""

import pytest
import torch
from torch import nn

from spec_nmt.decoding.linears import PackedLinears, packing_available
from spec_nmt.decoding.settings import DEFAULTS
from spec_nmt.models import block_forward
from spec_nmt.translator import SpecTranslator
from tests.conftest import BUNDLED_MODEL_DIR
from tests.test_verifier_cache import DECODER_VARIANTS, source_batch, tiny_transformer

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN")


def layers():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.Linear(1024, 256), nn.Linear(8, 8))


@torch.no_grad()
def test_packed_products_are_the_layers_own():
    model = layers()
    project = PackedLinears(model)
    assert set(project.weights) == set(model)  # every fp32 linear layer
    wide, narrow, small = model
    for rows in (1, 4, 11, 96):
        x = torch.randn(rows, 256)
        torch.testing.assert_close(project(wide, x), wide(x), rtol=1e-5, atol=1e-5)
    # 3-d and not contiguous, as the decoder's [W, B, C] features after a transpose
    x = torch.randn(4, 3, 1024).transpose(0, 1)
    torch.testing.assert_close(project(narrow, x), narrow(x), rtol=1e-5, atol=1e-5)
    x = torch.randn(1, 8)
    torch.testing.assert_close(project(small, x), small(x), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_weights_are_packed_when_the_projections_are_made():
    """A weight changed in place afterwards (training) is not seen: a new PackedLinears is."""
    model = layers()
    wide = model[0]
    project = PackedLinears(model)
    x = torch.randn(8, 256)
    before = project(wide, x)
    wide.weight.mul_(2)
    torch.testing.assert_close(project(wide, x), before)
    torch.testing.assert_close(PackedLinears(model)(wide, x), wide(x), rtol=1e-5, atol=1e-5)


def test_a_gradient_goes_through_the_layer_itself():
    model = layers()
    wide = model[0]
    x = torch.randn(8, 256, requires_grad=True)
    PackedLinears(model)(wide, x).sum().backward()
    assert wide.weight.grad is not None and x.grad is not None


def test_the_task_packs_a_verifier_once():
    translator = SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, device="cpu")
    task, verifier = translator.task, translator.verifier
    first = task.generator_for(verifier, translator.drafter, DEFAULTS).verifier.project
    second = task.generator_for(verifier, translator.drafter, DEFAULTS.replace(temperature=0.5))
    assert second.verifier.project is first
    assert first.weights[verifier.decoder.output_projection] is not None


@torch.no_grad()
@pytest.mark.parametrize("variant", list(DECODER_VARIANTS))
def test_the_encoder_forward_gives_the_stock_encoders_output(variant):
    """Every encoder shape of the verifier variants (pre-norm, layernorm-embedding, learned or no
    positions, ...), a left-padded batch: the same output at every real token, the same padding
    and lengths, with the packed products and with the layers' own."""
    model, dictionary = tiny_transformer(**DECODER_VARIANTS[variant])
    assert block_forward.encoder_supported(model.encoder)
    net_input = source_batch(dictionary, 3)
    stock = model.encoder.forward_torchscript(net_input)
    real = ~stock["encoder_padding_mask"][0].t().unsqueeze(2)  # [S, B, 1]
    for project in (PackedLinears(model), block_forward.plain):
        ours = block_forward.encode(model.encoder, net_input["src_tokens"], project)
        assert set(ours) == set(stock)
        difference = (ours["encoder_out"][0] - stock["encoder_out"][0]) * real
        assert difference.abs().max() < 1e-5
        for key in ("encoder_padding_mask", "encoder_embedding", "src_lengths"):
            assert torch.equal(ours[key][0], stock[key][0]), key
