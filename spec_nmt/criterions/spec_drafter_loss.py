"""Criterion ``spec_drafter_loss``: label-smoothed cross-entropy over the drafted positions that
have a label (masks past the target's EOS are not scored).

Besides the loss it reports how drafting would fare against the reference: ``acc`` (per-token
accuracy), ``lead`` (mean run of correct tokens from the start of the block, what a verifier
that agrees with the reference would accept) and ``first1`` .. ``firstN`` (percent of blocks whose
first n drafted tokens are all right; positions past the end of the target count as right).

``--on-policy-weight`` judges the drafter's own drafts by the lossless rule while it trains (the
on-policy examples of DistillSpec, Zhou et al. 2024): a position drafted after a wrong draft in its
block is discarded by the verifier, so its loss counts less.

``--glance-ratio`` trains the drafter by glancing (GLAT, Qian et al. 2021): a first pass without
gradients drafts every block; in each block round(ratio × its wrong drafts) labelled masks,
chosen at random, get their label as input instead of [MASK], and the loss is the second pass's
over the masks left. A drafter that drafts badly is shown more of its block, and learns how the
tokens of a block depend on each other; decoding stays one pass over k masks. The metrics are
the first pass's: what drafting one pass would give.
"""

import math
from dataclasses import dataclass, field

import torch
from fairseq import metrics, utils
from fairseq.criterions import FairseqCriterion, register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss
from fairseq.dataclass import FairseqDataclass

from spec_nmt.drafters.cached_drafter import CachedDrafterModel
from spec_nmt.drafters.training_batches import unwrapped
from spec_nmt.errors import SpecNmtError


@dataclass
class SpecDrafterLossConfig(FairseqDataclass):
    label_smoothing: float = field(
        default=0.1, metadata={"help": "epsilon for label smoothing, 0 means none"}
    )
    report_first_n: int = field(
        default=5, metadata={"help": "log firstN metrics for N = 1 .. this (capped at k)"}
    )
    on_policy_weight: float = field(
        default=0.0,
        metadata={
            "help": "w in [0, 1]: each drafted position's loss is scaled by 1 - w, plus w if "
            "the drafter's argmax equals the label at every earlier position of its block (the "
            "verifier would reach it); 0 trains every position alike"
        },
    )
    glance_ratio: float = field(
        default=0.0,
        metadata={
            "help": "glancing training (GLAT) in [0, 1]: per block, this share of the first "
            "pass's wrong drafts is shown as labels in place of masks for the scored pass; 0: "
            "none"
        },
    )


@register_criterion("spec_drafter_loss", dataclass=SpecDrafterLossConfig)
class SpecDrafterLoss(FairseqCriterion):
    def __init__(self, task, label_smoothing, report_first_n, on_policy_weight=0.0,
                 glance_ratio=0.0):  # fmt: skip
        super().__init__(task)
        for flag, value in (("on-policy-weight", on_policy_weight),
                            ("glance-ratio", glance_ratio)):  # fmt: skip
            if not 0.0 <= value <= 1.0:
                raise SpecNmtError(f"--{flag} must lie in [0, 1], got {value}")
        self.eps = label_smoothing
        self.report_first_n = report_first_n
        self.on_policy_weight = on_policy_weight
        self.glance_ratio = glance_ratio

    def forward(self, model, sample, reduce=True):
        """The loss over the masks that have a label; the model scores only those (logits
        [n, V]): masks past the target's EOS would cost output-layer time for nothing."""
        target = sample["target"]  # [B, k]
        net_input = sample["net_input"]
        is_label = target.ne(self.padding_idx)
        labels = target[is_label]
        scored = is_label
        if self.glance_ratio and model.training:
            drafter = unwrapped(model)
            if not isinstance(drafter, CachedDrafterModel):  # (its decoder lays out by masks)
                raise SpecNmtError("--glance-ratio trains the cached drafter only (--arch "
                                   "cached_drafter_*)")
            with torch.no_grad():
                drafts = model(**net_input, scored=is_label)[0].argmax(dim=-1)
            right = torch.zeros_like(is_label)
            right[is_label] = drafts.eq(labels)
            shown = glanced(is_label, right, self.glance_ratio)
            net_input = dict(net_input, shown_tokens=with_labels_shown(
                net_input["prev_output_tokens"], drafter.decoder.mask_idx, target, shown))
            scored = is_label & ~shown
        logits, extra = model(**net_input, scored=scored)
        lprobs = model.get_normalized_probs((logits, extra), log_probs=True)
        if scored is is_label:  # (glancing: the first pass's drafts, as one pass drafts them)
            right = torch.zeros_like(is_label)
            right[is_label] = lprobs.argmax(dim=-1).eq(labels)
        leading = (right | ~is_label).long().cumprod(dim=1)  # 1 while every token so far is right
        loss, nll_loss = label_smoothed_nll_loss(
            lprobs, target[scored], self.eps, ignore_index=self.padding_idx, reduce=False
        )
        if self.on_policy_weight:
            reached = torch.cat([leading.new_ones(leading.size(0), 1), leading[:, :-1]], dim=1)
            weight = 1.0 - self.on_policy_weight + self.on_policy_weight * reached[scored]
            loss = loss * weight.unsqueeze(-1).to(loss.dtype)
        if reduce:
            loss, nll_loss = loss.sum(), nll_loss.sum()
        sample_size = sample["ntokens"] if scored is is_label else int(scored.sum())
        logging_output = {
            "loss": loss.data,
            "nll_loss": nll_loss.data,
            "ntokens": sample["ntokens"],
            "nsentences": target.size(0),
            "sample_size": sample_size,
            "n_correct": int((right & is_label).sum()),
            "lead_sum": int((leading.bool() & is_label).sum()),
        }
        for n in range(1, min(self.report_first_n, target.size(1)) + 1):
            logging_output[f"first{n}_count"] = int(leading[:, n - 1].sum())
        return loss, sample_size, logging_output

    @staticmethod
    def reduce_metrics(logging_outputs) -> None:
        def total(key):
            return sum(log.get(key, 0) for log in logging_outputs)

        loss, nll_loss = total("loss"), total("nll_loss")
        ntokens, nsentences = total("ntokens"), total("nsentences")
        sample_size = total("sample_size")
        metrics.log_scalar("loss", loss / max(sample_size, 1) / math.log(2), sample_size, round=3)
        metrics.log_scalar("nll_loss", nll_loss / max(ntokens, 1) / math.log(2), ntokens, round=3)
        metrics.log_derived("ppl", lambda meters: utils.get_perplexity(meters["nll_loss"].avg))
        metrics.log_scalar("acc", 100.0 * total("n_correct") / max(ntokens, 1), ntokens, round=2)
        metrics.log_scalar("lead", total("lead_sum") / max(nsentences, 1), nsentences, round=3)
        first_keys = sorted(
            {key for log in logging_outputs for key in log if key.startswith("first")},
            key=lambda key: int(key[len("first") : -len("_count")]),
        )
        for key in first_keys:
            name = key[: -len("_count")]
            metrics.log_scalar(name, 100.0 * total(key) / max(nsentences, 1), nsentences, round=2)

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True


def glanced(is_label: torch.Tensor, right: torch.Tensor, ratio: float) -> torch.Tensor:
    """[B, k] bool: per block, round(ratio x its wrong drafts) of its labelled masks, at random."""
    wrong = (is_label & ~right).sum(dim=1)
    count = (wrong.float() * ratio).round().long()
    draw = torch.rand(is_label.shape, device=is_label.device).masked_fill(~is_label, 2.0)
    rank = draw.argsort(dim=1).argsort(dim=1)  # each mask's place in its block's draw
    return is_label & (rank < count.unsqueeze(1))


def with_labels_shown(prev_output_tokens: torch.Tensor, mask_idx: int, target: torch.Tensor,
                      shown: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The decoder input with the label in place of each shown mask. The cached drafter's
    input holds the masks of the target's rows in row-major order (the blocks of a sentence's
    cuts one after another behind its prefix)."""
    slots = prev_output_tokens.eq(mask_idx)
    if int(slots.sum()) != target.numel():  # a layout this does not know: a caller's bug
        raise ValueError(f"{int(slots.sum())} masks in the decoder input for {target.numel()} "
                         "labels")
    masks = prev_output_tokens[slots]
    shown_input = prev_output_tokens.clone()
    shown_input[slots] = torch.where(shown.flatten(), target.flatten(), masks)
    return shown_input
