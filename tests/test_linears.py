"""Prepacked fp32 linear layers (spec_nmt/decoding/linears.py): the same products as the layers'
own, packed when they are made, bypassed where the default kernel is faster or a gradient is
needed, and packed once per verifier by the task."""

import pytest
import torch
from torch import nn

from spec_nmt.decoding.linears import PACKED_FROM, PackedLinears, packing_available
from spec_nmt.decoding.settings import DEFAULTS
from spec_nmt.translator import SpecTranslator
from tests.conftest import BUNDLED_MODEL_DIR

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
    # a small product goes to the layer itself: bit for bit its output
    x = torch.randn(4, 8)
    assert 4 * small.weight.numel() < PACKED_FROM
    assert torch.equal(project(small, x), small(x))


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
