"""Drafter training batches: a translation batch becomes one row of labels per random cut of each
target, and the decoder input the drafter model lays out for its cuts (``training_input``)."""

from typing import Dict, Optional

import torch

from spec_nmt.drafters.spec_drafter import SpecDrafterModel, fit_width


def unwrapped(model):
    """The model inside fairseq's distributed wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def drafter_sample(sample: Dict, model, k: int, cuts_per_sentence: int, mask: int, pad: int,
                   eos: int, generator: Optional[torch.Generator] = None) -> Dict:  # fmt: skip
    """Turn a translation batch into a drafter batch for ``model``: cut every target at
    ``cuts_per_sentence`` random points (stratified: the j-th of m cuts falls in the j-th m-th of
    its length); each cut c's labels are y[c:c+k] (EOS included, padding past the end), one row
    per cut, the cuts of a sentence next to each other, and the model's ``draft_slots(k)`` masks
    per cut. ``model`` None (a caller's layout check) cuts as a Spec-Drafter."""
    target = sample["target"]
    m = cuts_per_sentence
    model_class = type(unwrapped(model)) if model is not None else SpecDrafterModel
    target_lengths = target.ne(pad).sum(dim=1).repeat_interleave(m)
    uniform = torch.rand(target_lengths.size(0), generator=generator).to(target.device)
    stratum = torch.arange(target_lengths.size(0), device=target.device) % m
    fraction = (stratum + uniform) / m
    first = model_class.FIRST_CUT  # c in [first, len)
    cuts = first + (fraction * (target_lengths - first)).long()
    cuts = torch.minimum(cuts, (target_lengths - 1).clamp(min=first))

    rows = target.repeat_interleave(m, dim=0)
    label_index = cuts.unsqueeze(1) + torch.arange(k, device=target.device)
    labels = fit_width(rows, int(label_index.max()) + 1, pad).gather(1, label_index)
    shifted = torch.cat([target.new_full((target.size(0), 1), eos), target[:, :-1]], dim=1)
    slots = unwrapped(model).draft_slots(k) if model is not None else k
    decoder_input = model_class.training_input(shifted, cuts, slots, mask, pad)
    net_input = dict(sample["net_input"], **decoder_input)
    return dict(sample, net_input=net_input, target=labels, ntokens=int(labels.ne(pad).sum()))
