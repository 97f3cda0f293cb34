"""Criterion ``proposal_heads_loss``: the verifier's label-smoothed cross-entropy plus its proposal
heads' cross-entropy, trained together (Medusa-2's joint loss).

At target position t the verifier chooses token t + 1 (teacher-forced: the target's); head j
reads that state and that token and is scored on token t + 1 + j. Head j's loss weighs
``--heads-weight`` × ``--heads-decay`` ** (j - 1): later heads, which are right less often,
pull less on the verifier. Logged per head: ``head{j}_acc``, the percent of its labels it gets
right, and ``head{j}_lead``, the percent of positions where heads 1 .. j are all right (what a
lossless verifier that agrees with the target would accept).
"""

import math
from dataclasses import dataclass, field

import torch
from fairseq import metrics, utils
from fairseq.criterions import FairseqCriterion, register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss
from fairseq.dataclass import FairseqDataclass


@dataclass
class ProposalHeadsLossConfig(FairseqDataclass):
    label_smoothing: float = field(
        default=0.1, metadata={"help": "epsilon for the verifier's label smoothing, 0 means none"}
    )
    heads_weight: float = field(
        default=0.5,
        metadata={"help": "weight of the first head's cross-entropy (the verifier's: 1)"},
    )
    heads_decay: float = field(
        default=0.8, metadata={"help": "each later head's weight is the one before's times this"}
    )
    heads_vocabulary: int = field(
        default=0,
        metadata={
            "help": "the heads propose only the dictionary's first N symbols, its most "
            "frequent (0: all); a label past them is scored as wrong, with no loss"
        },
    )


def shifted(target, steps: int, pad: int):
    """target [B, T] moved ``steps`` positions to the left, padded on the right."""
    return torch.cat([target[:, steps:], target.new_full((target.size(0), steps), pad)], dim=1)


@register_criterion("proposal_heads_loss", dataclass=ProposalHeadsLossConfig)
class ProposalHeadsLoss(FairseqCriterion):
    def __init__(self, task, label_smoothing, heads_weight, heads_decay, heads_vocabulary):
        super().__init__(task)
        self.heads_vocabulary = heads_vocabulary
        self.eps = label_smoothing
        self.heads_weight = heads_weight
        self.heads_decay = heads_decay

    def forward(self, model, sample, reduce=True):
        logits, extra = model(**sample["net_input"])
        lprobs = model.get_normalized_probs((logits, extra), log_probs=True)
        target = sample["target"]
        loss, nll_loss = label_smoothed_nll_loss(
            lprobs.view(-1, lprobs.size(-1)), target.view(-1), self.eps,
            ignore_index=self.padding_idx, reduce=reduce,
        )  # fmt: skip
        chosen = target.ne(self.padding_idx)  # positions whose state chose a token
        head_lprobs = torch.log_softmax(
            model.proposal_logits(
                extra["states"][chosen], target[chosen], self.heads_vocabulary
            ).float(),
            dim=-1,
        )  # [n, heads, V]
        logging_output = {"nll_loss": nll_loss.data, "positions": int(chosen.sum())}
        leading = torch.ones_like(target[chosen], dtype=torch.bool)
        for head in range(head_lprobs.size(1)):
            labels = shifted(target, head + 1, self.padding_idx)[chosen]
            has_label = labels.ne(self.padding_idx)
            scored = has_label & labels.lt(head_lprobs.size(-1))
            head_nll = -head_lprobs[:, head].gather(1, labels.masked_fill(~scored, 0).unsqueeze(1))
            head_nll = head_nll.squeeze(1).masked_fill(~scored, 0.0).sum()
            loss = loss + self.heads_weight * self.heads_decay**head * head_nll
            right = head_lprobs[:, head].argmax(dim=-1).eq(labels) & has_label
            leading &= right | ~has_label
            logging_output[f"head{head + 1}_nll"] = head_nll.data
            logging_output[f"head{head + 1}_labels"] = int(has_label.sum())
            logging_output[f"head{head + 1}_right"] = int(right.sum())
            logging_output[f"head{head + 1}_leading"] = int(leading.sum())
        sample_size = sample["ntokens"]
        logging_output.update(loss=loss.data, ntokens=sample["ntokens"],
                              nsentences=target.size(0), sample_size=sample_size)  # fmt: skip
        return loss, sample_size, logging_output

    @staticmethod
    def reduce_metrics(logging_outputs) -> None:
        def total(key):
            return sum(log.get(key, 0) for log in logging_outputs)

        ntokens, sample_size = total("ntokens"), total("sample_size")
        metrics.log_scalar("loss", total("loss") / max(sample_size, 1) / math.log(2), sample_size,
                           round=3)  # fmt: skip
        metrics.log_scalar("nll_loss", total("nll_loss") / max(ntokens, 1) / math.log(2), ntokens,
                           round=3)  # fmt: skip
        metrics.log_derived("ppl", lambda meters: utils.get_perplexity(meters["nll_loss"].avg))
        positions = total("positions")
        heads = sorted({int(key[4:-4]) for log in logging_outputs for key in log
                        if key.startswith("head") and key.endswith("_nll")})  # fmt: skip
        for head in heads:
            labels = total(f"head{head}_labels")
            metrics.log_scalar(f"head{head}_nll", total(f"head{head}_nll") / max(labels, 1)
                               / math.log(2), labels, round=3)  # fmt: skip
            metrics.log_scalar(f"head{head}_acc", 100.0 * total(f"head{head}_right")
                               / max(labels, 1), labels, round=2)  # fmt: skip
            metrics.log_scalar(f"head{head}_lead", 100.0 * total(f"head{head}_leading")
                               / max(positions, 1), positions, round=2)  # fmt: skip

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True
