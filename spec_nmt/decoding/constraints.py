"""fairseq's adjustments of a step's log-probs (SequenceGenerator with ``--beam 1`` or
``--sampling``), made for every entry of a scored block at once, by both loops: PAD is never
chosen, ``--unkpen`` lowers UNK, an output at its length limit must end (EOS forced), and one
shorter than ``--min-len`` must not. A lossless rule must see exactly the log-probs fairseq's
greedy step sees.
"""

import torch
from torch import Tensor


def constrain(logits: Tensor, steps: Tensor, max_lens: Tensor, settings, eos: int, pad: int,
              unk: int, ask_host: bool = True) -> Tensor:  # fmt: skip
    """Make in ``logits`` [B, W, V] the adjustments of entry [b, i], which predicts output step
    ``steps[b, i]`` of a row whose limit is ``max_lens[b]``, touching only the columns and
    entries concerned. Returns the log-normaliser [B, W] of the unadjusted distribution:
    ``logits - normaliser`` are fairseq's adjusted log-probs, and the rules only compare
    tokens of one entry, which a per-entry shift does not change. ``ask_host`` False: without
    reading from the device whether an adjustment applies (the static loop's one read per
    iteration), at the cost of writing every entry's row."""
    normalizer = torch.logsumexp(logits, dim=-1)
    # a NaN logit makes fairseq's log-probs NaN, then -inf, at that step
    broken = normalizer.isnan()
    if not ask_host or broken.any():
        logits.masked_fill_(broken.unsqueeze(2), float("-inf"))
        normalizer = normalizer.masked_fill(broken, 0.0)
    logits[:, :, pad] = float("-inf")
    if settings.unkpen:
        logits[:, :, unk] -= settings.unkpen
    force_eos = steps.ge(max_lens.unsqueeze(1))
    if not ask_host or force_eos.any():
        eos_logits = logits[:, :, eos].clone()
        logits.masked_fill_(force_eos.unsqueeze(2), float("-inf"))
        logits[:, :, eos] = eos_logits
    logits[:, :, eos].masked_fill_(steps.lt(settings.min_len), float("-inf"))
    return normalizer
