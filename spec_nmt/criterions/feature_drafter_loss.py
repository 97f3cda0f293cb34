"""Criterion ``feature_drafter_loss``: the feature drafter's loss over its unrolled drafting
steps: at each position t, cross-entropy of the token after ``target[t]`` plus a smooth-L1 pull
of the predicted state towards the verifier's (EAGLE), summed over steps and positions that
have a label.

It reports ``acc1`` .. ``accJ``: percent of positions where drafting step j's token is right
given right drafts before it, the chance the verifier accepts draft j after accepting j - 1.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from fairseq import metrics
from fairseq.criterions import FairseqCriterion, register_criterion
from fairseq.dataclass import FairseqDataclass


@dataclass
class FeatureDrafterLossConfig(FairseqDataclass):
    label_smoothing: float = field(
        default=0.1, metadata={"help": "epsilon for label smoothing, 0 means none"}
    )
    state_loss_weight: float = field(
        default=0.5,
        metadata={"help": "weight of the smooth-L1 distance (mean over the state's dimensions) "
                          "between predicted and true verifier states, against cross-entropy"},
    )


@register_criterion("feature_drafter_loss", dataclass=FeatureDrafterLossConfig)
class FeatureDrafterLoss(FairseqCriterion):
    def __init__(self, task, label_smoothing, state_loss_weight):
        super().__init__(task)
        self.eps = label_smoothing
        self.state_loss_weight = state_loss_weight

    def forward(self, model, sample, reduce=True):
        target = sample["target"]  # [B, T]; position t's draft is target[t + 1]
        logits, predicted, states = model(**sample["net_input"], target=target)
        labels = target[:, 1:]
        t = torch.arange(labels.size(1), device=labels.device)
        loss = logits.new_zeros(())
        logging_output = {"nsentences": target.size(0), "ntokens": sample["ntokens"]}
        sample_size = 0
        for step in range(logits.size(0)):
            scored = labels.ne(self.padding_idx) & (t >= step)  # [B, T - 1]
            step_logits = logits[step, :, :-1][scored].float()
            cross_entropy = F.cross_entropy(step_logits, labels[scored], reduction="sum",
                                            label_smoothing=self.eps)
            distance = F.smooth_l1_loss(predicted[step, :, :-1][scored], states[:, 1:][scored],
                                        reduction="none").mean(dim=-1).sum()
            loss = loss + cross_entropy + self.state_loss_weight * distance
            count = int(scored.sum())
            sample_size += count
            logging_output[f"acc{step + 1}_count"] = count
            logging_output[f"acc{step + 1}_right"] = int(
                step_logits.argmax(dim=-1).eq(labels[scored]).sum())
            logging_output[f"ce{step + 1}"] = cross_entropy.data
        logging_output.update(loss=loss.data, sample_size=sample_size)
        return loss, sample_size, logging_output

    @staticmethod
    def reduce_metrics(logging_outputs) -> None:
        def total(key):
            return sum(log.get(key, 0) for log in logging_outputs)

        sample_size = total("sample_size")
        metrics.log_scalar("loss", total("loss") / max(sample_size, 1) / math.log(2), sample_size,
                           round=3)
        steps = sorted({int(key[3:-6]) for log in logging_outputs for key in log
                        if key.startswith("acc") and key.endswith("_count")})
        for step in steps:
            count = total(f"acc{step}_count")
            metrics.log_scalar(f"acc{step}", 100.0 * total(f"acc{step}_right") / max(count, 1),
                               count, round=2)
            metrics.log_scalar(f"ce{step}", total(f"ce{step}") / max(count, 1) / math.log(2),
                               count, round=3)

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True
