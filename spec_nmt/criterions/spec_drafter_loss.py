"""Criterion ``spec_drafter_loss``: label-smoothed cross-entropy over the drafted positions that
have a label (masks past the target's EOS are not scored).

Besides the loss it reports how drafting would fare against the reference: ``acc`` (per-token
accuracy), ``lead`` (mean run of correct tokens from the start of the block, what a verifier
that agrees with the reference would accept) and ``first1`` .. ``firstN`` (percent of blocks whose
first n drafted tokens are all right; positions past the end of the target count as right).

``--on-policy-weight`` judges the drafter's own drafts by the lossless rule while it trains (the
on-policy examples of DistillSpec, Zhou et al. 2024): a position drafted after a wrong draft in its
block is discarded by the verifier, so its loss counts less.

A drafter trained with ``--ctc-upsample N`` (drafters/ctc.py) has N x k slots per block: its loss is
CTC's over the block's labels, with [MASK] as the blank, and the metrics judge its collapsed drafts.
"""

import math
from dataclasses import dataclass, field

import torch
from fairseq import metrics, utils
from fairseq.criterions import FairseqCriterion, register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss
from fairseq.dataclass import FairseqDataclass

from spec_nmt.drafters.ctc import collapse
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


@register_criterion("spec_drafter_loss", dataclass=SpecDrafterLossConfig)
class SpecDrafterLoss(FairseqCriterion):
    def __init__(self, task, label_smoothing, report_first_n, on_policy_weight=0.0):
        super().__init__(task)
        if not 0.0 <= on_policy_weight <= 1.0:
            raise SpecNmtError(f"--on-policy-weight must lie in [0, 1], got {on_policy_weight}")
        self.eps = label_smoothing
        self.report_first_n = report_first_n
        self.on_policy_weight = on_policy_weight

    def forward(self, model, sample, reduce=True):
        """The loss over the masks that have a label; the model scores only those (logits
        [n, V]): masks past the target's EOS would cost output-layer time for nothing. (A CTC
        drafter's loss reads every slot: ``ctc_loss``.)"""
        target = sample["target"]  # [B, k]
        is_label = target.ne(self.padding_idx)
        if getattr(unwrapped(model), "ctc_upsample", 0):
            loss, nll_loss, right = self.ctc_loss(model, sample, is_label)
        else:
            loss, nll_loss, right = self.position_loss(model, sample, is_label)
        leading = (right | ~is_label).long().cumprod(dim=1)  # 1 while every token so far is right
        if self.on_policy_weight:
            reached = torch.cat([leading.new_ones(leading.size(0), 1), leading[:, :-1]], dim=1)
            weight = 1.0 - self.on_policy_weight + self.on_policy_weight * reached[is_label]
            loss = loss * weight.unsqueeze(-1).to(loss.dtype)
        if reduce:
            loss, nll_loss = loss.sum(), nll_loss.sum()
        sample_size = sample["ntokens"]
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

    def position_loss(self, model, sample, is_label):
        """Label-smoothed cross-entropy per labelled mask [n, 1], its NLL, and which masks
        [B, k] the drafter gets right."""
        logits, extra = model(**sample["net_input"], scored=is_label)
        lprobs = model.get_normalized_probs((logits, extra), log_probs=True)
        labels = sample["target"][is_label]
        right = torch.zeros_like(is_label)
        right[is_label] = lprobs.argmax(dim=-1).eq(labels)
        loss, nll_loss = label_smoothed_nll_loss(
            lprobs, labels, self.eps, ignore_index=self.padding_idx, reduce=False
        )
        return loss, nll_loss, right

    def ctc_loss(self, model, sample, is_label):
        """CTC's loss per block [B, 1] (as its NLL; no smoothing), and which of the collapsed
        drafts [B, k] equal their label."""
        if self.on_policy_weight:
            raise SpecNmtError("--on-policy-weight weights drafts by position: a CTC drafter "
                               "(--ctc-upsample) has one loss per block")  # fmt: skip
        target = sample["target"]
        logits, extra = model(**sample["net_input"])  # [B, slots, V]: every slot
        lprobs = model.get_normalized_probs((logits, extra), log_probs=True).float()
        blank = unwrapped(model).decoder.mask_idx
        slots = torch.full((target.size(0),), lprobs.size(1), dtype=torch.long,
                           device=target.device)  # fmt: skip
        loss = torch.nn.functional.ctc_loss(
            lprobs.transpose(0, 1), target, slots, is_label.sum(dim=1), blank=blank,
            reduction="none", zero_infinity=True,
        ).unsqueeze(1)  # fmt: skip
        drafts, filled = collapse(lprobs.argmax(dim=-1), blank, target.size(1))
        return loss, loss, filled & drafts.eq(target)

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
