"""Acceptance validation while a drafter trains (``--eval-acceptance-verifier``): each validation
batch is decoded speculatively with the verifier and the drafter being trained, and the mean
accepted drafts per iteration of each measured rule becomes a metric (``accepted_lossless``,
``accepted_top_beta``) that can choose the best checkpoint.
"""

import logging
from typing import Dict, Optional

from fairseq import metrics
from fairseq.logging.meters import safe_round

from spec_nmt.loading import drafter_adapter, load_paired_verifier
from spec_nmt.settings import DEFAULTS, DecodingSettings

logger = logging.getLogger(__name__)


class AcceptanceValidation:
    """The measurement for one task; the verifier is loaded at the first validation."""

    def __init__(self, task):
        self.task = task
        self._verifier_model = None

    def settings(self) -> Dict[str, DecodingSettings]:
        """The rules --eval-acceptance-verifier measures, by metric name."""
        # batches of validation sentences: they must draft to measure anything
        lossless = DEFAULTS.replace(block_size=self.task.cfg.block_size, max_draft_batch=0)
        settings = {"accepted_lossless": lossless}
        if (self.task.cfg.beta, self.task.cfg.tau) != (lossless.beta, lossless.tau):
            settings["accepted_top_beta"] = lossless.replace(beta=self.task.cfg.beta,
                                                             tau=self.task.cfg.tau)  # fmt: skip
        return settings

    def counts(self, sample, drafter_model) -> Dict[str, int]:
        """Accepted drafts and iterations of each measured rule on this validation batch; zeros
        for a batch without a selected sentence (DDP sums the same keys from every worker)."""
        verifier_model = self._verifier(drafter_model)
        drafter = drafter_adapter(drafter_model, self.task.target_dictionary)
        source = self._source(sample)
        counts = {}
        for name, settings in self.settings().items():
            drafts = iterations = 0
            if source is not None:
                # no CUDA graphs: the drafter's weights change every epoch (its graphs would
                # be captured again at every validation), and a capture beside the training's
                # allocations failed on the H200 (run 6), leaving the RNG in capture mode, so
                # that the next epoch's dropout stopped the training
                generator = self.task.generator_for(verifier_model, drafter, settings,
                                                    capture_graphs=False)  # fmt: skip
                generator.generate([verifier_model], source)
                drafts, iterations = generator.stats.accepted_tokens, generator.stats.iterations
            counts[f"_{name}_drafts"] = drafts
            counts[f"_{name}_iterations"] = iterations
        return counts

    def _source(self, sample) -> Optional[Dict]:
        """The batch's sentences that --eval-acceptance-sentences selects, as generator input
        (None when it selects none)."""
        src_tokens = sample["net_input"]["src_tokens"]
        src_lengths = sample["net_input"]["src_lengths"]
        limit = self.task.cfg.eval_acceptance_sentences
        if limit:
            chosen = sample["id"] < limit
            if not bool(chosen.any()):
                return None
            src_lengths = src_lengths[chosen]
            src_tokens = src_tokens[chosen]
            # without the padding columns that only the other rows needed
            src_tokens = src_tokens[:, src_tokens.ne(self.task.source_dictionary.pad()).any(dim=0)]
        return {"net_input": {"src_tokens": src_tokens, "src_lengths": src_lengths}}

    def _verifier(self, drafter_model):
        if self._verifier_model is None:
            flag, path = "--eval-acceptance-verifier", self.task.cfg.eval_acceptance_verifier
            self._verifier_model = load_paired_verifier(self.task, flag, path, drafter_model)
            rules = " and ".join(
                f"{name} (beta {s.beta}, tau {s.tau:g})"
                for name, s in self.settings().items()
            )
            sentences = self.task.cfg.eval_acceptance_sentences
            logger.info("validation decodes %s with the verifier %s at k=%d: %s",
                        f"its first {sentences} sentences" if sentences else "every sentence",
                        path, self.task.cfg.block_size, rules)  # fmt: skip
        return self._verifier_model

    def log_metrics(self, logging_outputs) -> None:
        """Each rule's accepted drafts per iteration over the validation, as a fairseq metric."""
        for name in self.settings():
            drafts = sum(log.get(f"_{name}_drafts", 0) for log in logging_outputs)
            iterations = sum(log.get(f"_{name}_iterations", 0) for log in logging_outputs)
            if iterations == 0:  # training steps, or validation without --eval-acceptance-verifier
                continue
            metrics.log_scalar(f"_{name}_drafts", drafts)
            metrics.log_scalar(f"_{name}_iterations", iterations)
            metrics.log_derived(
                name,
                lambda meters, n=name: safe_round(
                    meters[f"_{n}_drafts"].sum / meters[f"_{n}_iterations"].sum, 3
                ),
            )
