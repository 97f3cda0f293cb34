"""Task ``spec_translation``: fairseq's translation task, plus

* training a drafter: every target is cut at random points c, each cut's labels are y[c:c+k]
  (EOS included, padding past the end). A Spec-Drafter gets one decoder row BOS + y[:c] + k
  [MASK]s per cut; a cached drafter gets BOS + y once, then one block of k masks per cut;
* speculative decoding: with ``--drafter-path``, ``build_generator`` returns the speculative
  generator, so ``fairseq-generate`` and ``fairseq-interactive`` decode with it unchanged. The
  drafter is a Spec-Drafter (non-autoregressive) or any stock fairseq Transformer trained with
  ``--task translation`` (autoregressive); ``--verify`` picks the rule.
"""

import atexit
import copy
import io
import logging
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Dict, Optional
from weakref import WeakKeyDictionary

import torch
from fairseq import checkpoint_utils, metrics
from fairseq.dataclass import ChoiceEnum
from fairseq.logging.meters import safe_round
from fairseq.models import ARCH_MODEL_REGISTRY
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from spec_nmt.checkpoint_loading import model_config
from spec_nmt.compact_drafter import with_verifier_copies
from spec_nmt.decoding.drafters import (
    ArDrafter,
    CachedDrafter,
    HeadsDrafter,
    NarDrafter,
    restrict_output,
)
from spec_nmt.decoding.generator import SpeculativeGenerator
from spec_nmt.decoding.linears import PackedLinears
from spec_nmt.decoding.verifier import TransformerVerifier
from spec_nmt.decoding.rules import RULES
from spec_nmt.decoding.settings import DEFAULTS, DecodingSettings
from spec_nmt.errors import SpecNmtError
from spec_nmt.models.cached_drafter import CachedDrafterModel
from spec_nmt.models.heads_drafter import HeadsDrafterModel
from spec_nmt.models.spec_drafter import (
    MASK_SYMBOL,
    SpecDrafterModel,
    masked_input,
)

logger = logging.getLogger(__name__)

VERIFY_CHOICES = ChoiceEnum(list(RULES))
DRAFTER_PRECISION_NAMES = ("auto", "fp32", "int8")
# int8 drafts depend on their batch (activation scales per call): opt-in, see drafts_in_int8
DEFAULT_DRAFTER_PRECISION = "fp32"
DRAFTER_PRECISIONS = ChoiceEnum(list(DRAFTER_PRECISION_NAMES))


@dataclass
class SpecTranslationConfig(TranslationConfig):
    block_size: int = field(
        default=DEFAULTS.block_size,
        metadata={
            "help": "k: [MASK] positions the drafter fills per iteration, in training (the "
            "recipes of scripts/train_drafter.sh set their own) and decoding; in decoding 0 "
            "drafts nothing: the verifier alone on the same loop (greedy or sampling)"
        },
    )
    cuts_per_sentence: int = field(
        default=1,
        metadata={
            "help": "drafter training: cut each target at this many random points per batch; "
            "the encoder runs once per sentence, so extra cuts cost less than extra epochs"
        },
    )
    drafter_path: Optional[str] = field(
        default=None,
        metadata={
            "help": "drafter checkpoint (Spec-Drafter, cached or autoregressive drafter); when "
            "given, fairseq-generate/fairseq-interactive decode speculatively with the --path "
            "model as the verifier"
        },
    )
    drafter_precision: DRAFTER_PRECISIONS = field(
        default=DEFAULT_DRAFTER_PRECISION,
        metadata={
            "help": "the drafter's feed-forward and output layers: fp32, int8 (dynamic "
            "quantization, CPU only: cheaper drafts), or auto: int8 when the drafter runs on the "
            "CPU in fp32. The verifier stays as it is, so every rule keeps its guarantee; int8 "
            "quantizes activations per call, so its drafts, and top-beta/tau output, may depend "
            "on the batch"
        },
    )
    beta: int = field(
        default=DEFAULTS.beta,
        metadata={"help": "top-beta rule: a drafted token must be among the verifier's beta best"},
    )
    tau: float = field(
        default=DEFAULTS.tau,
        metadata={
            "help": "top-beta rule: a drafted token's log-prob must be within tau of the "
            "verifier's best (--beta 1 --tau 0 is lossless: exactly the verifier's greedy output)"
        },
    )
    verify: VERIFY_CHOICES = field(
        default=DEFAULTS.verify,
        metadata={
            "help": "verification rule: top_beta (greedy drafts, --beta/--tau), sampling "
            "(speculative sampling of a drafted chain) or rsd (recursive rejection sampling "
            "over a draft tree); sampling and rsd sample exactly from the verifier, with "
            "--temperature, --sampling-topk, --sampling-topp and --seed"
        },
    )
    tree_branching: Optional[str] = field(
        default=DEFAULTS.tree_branching,
        metadata={
            "help": "a draft tree: comma-separated children per node at each depth (e.g. "
            "3,2,2,1: the tree is as deep as the list is long, and --block-size is not used). "
            "--verify rsd (RSD-C) draws the children without replacement by Gumbel-top-k; with "
            "neither this nor --tree-budget it draws "
            f"{RULES['rsd'].default_branching} (the most tokens per verifier call of the "
            "6-node trees on newstest2013, BENCHMARKS.md). --verify top_beta gives every node "
            "the drafter's best tokens and accepts the path the rule passes (still lossless "
            "with --beta 1 --tau 0); without it or --tree-budget, a chain"
        },
    )
    tree_budget: int = field(
        default=DEFAULTS.tree_budget,
        metadata={
            "help": "a draft tree of about this many nodes per iteration: beam search over the "
            "drafter's sequences, width tree-budget // block-size over block-size levels; "
            "stochastic for --verify rsd (RSD-S), the most probable sequences for --verify "
            "top_beta (still lossless with --beta 1 --tau 0)"
        },
    )
    adaptive_block: bool = field(
        default=DEFAULTS.adaptive_block,
        metadata={
            "help": "chains of drafts (top_beta, sampling): each sentence's k starts at "
            "--block-size, doubles after a fully accepted block (up to --block-size) and drops "
            "to the accepted count + 1 after a rejection"
        },
    )
    max_draft_batch: Optional[int] = field(
        default=DEFAULTS.max_draft_batch,
        metadata={
            "help": "the most sentences a batch may have and still draft; a larger batch decodes "
            "with the verifier alone on the same loop (its drafts would cost more than they "
            "earn). 0: draft in batches of any size. Default: 1 for the rules whose output the "
            "drafts cannot change (lossless top_beta, sampling, rsd), no limit for a relaxed "
            "--beta/--tau, whose drafts decide its translations"
        },
    )
    eval_acceptance_verifier: Optional[str] = field(
        default=None,
        metadata={
            "help": "drafter training: at every validation, decode the validation set "
            "speculatively with this verifier checkpoint and the drafter being trained (k = "
            "--block-size), and log accepted_lossless, the mean accepted drafts per iteration "
            "of the lossless rule, and, when --beta/--tau relax it, accepted_top_beta; "
            "--best-checkpoint-metric accepted_lossless --maximize-best-checkpoint-metric keeps "
            "the drafter that agrees best"
        },
    )
    eval_acceptance_sentences: int = field(
        default=0,
        metadata={
            "help": "with --eval-acceptance-verifier: decode only the validation sentences of id "
            "below N (the first N lines of the validation set; 0: every sentence). Each "
            "validation then decodes N sentences once per measured rule instead of the whole set"
        },
    )


@register_task("spec_translation", dataclass=SpecTranslationConfig)
class SpecTranslationTask(TranslationTask):
    cfg: SpecTranslationConfig

    def __init__(self, cfg: SpecTranslationConfig, src_dict, tgt_dict):
        if cfg.cuts_per_sentence < 1:
            raise SpecNmtError(f"--cuts-per-sentence must be >= 1, got {cfg.cuts_per_sentence}")
        if cfg.eval_acceptance_sentences < 0:
            raise SpecNmtError(
                f"--eval-acceptance-sentences must be >= 0, got {cfg.eval_acceptance_sentences}"
            )
        if cfg.eval_acceptance_sentences and not cfg.eval_acceptance_verifier:
            raise SpecNmtError(
                "--eval-acceptance-sentences selects what --eval-acceptance-verifier decodes: "
                "give that too"
            )
        # the rule's flags, checked now (fairseq's generation flags join them in build_generator)
        DecodingSettings.from_fairseq(cfg, None, DEFAULTS.seed)
        super().__init__(cfg, src_dict, tgt_dict)
        self._drafter_dicts = None
        self._source_token_limit = None
        self._acceptance_verifier = None
        self._packed_verifiers: "WeakKeyDictionary[torch.nn.Module, PackedLinears]" = (
            WeakKeyDictionary()
        )

    # ----- dictionaries -------------------------------------------------------------------
    def drafter_dictionaries(self):
        """(source, target) dictionaries of the drafter: the data's, with [MASK] appended when
        missing. Appending keeps every other index, so drafter and verifier ids agree."""
        if self._drafter_dicts is None:
            self._drafter_dicts = tuple(
                _with_mask(d) for d in (self.source_dictionary, self.target_dictionary)
            )
        return self._drafter_dicts

    # ----- training the drafter -------------------------------------------------------------
    def build_model(self, cfg, from_checkpoint=False):
        init_path = getattr(cfg, "init_from_verifier", None)
        verifier_state = None
        if not from_checkpoint and init_path:
            verifier_state = _read_checkpoint("--init-from-verifier", init_path)
            arch = getattr(cfg, "arch", None) or getattr(cfg, "_name", None)
            model_class = ARCH_MODEL_REGISTRY.get(arch)
            if model_class is not None and issubclass(model_class, SpecDrafterModel):
                model_class.adopt_verifier(cfg, model_config(verifier_state), init_path)
        if not from_checkpoint and self.cfg.block_size < 1:
            raise SpecNmtError(
                "--block-size 0 decodes without drafts; a drafter trains on k >= 1 masks"
            )
        model = super().build_model(cfg, from_checkpoint)
        if not from_checkpoint and not isinstance(model, SpecDrafterModel):
            raise SpecNmtError(
                "--task spec_translation trains drafters (--arch spec_drafter_small, "
                "cached_drafter_small, ...); train the verifier with --task translation"
            )
        if not from_checkpoint and not init_path and isinstance(model, CachedDrafterModel):
            raise SpecNmtError(
                "a cached drafter drafts on the verifier's frozen encoder: give "
                "--init-from-verifier VERIFIER.pt, the verifier it will decode with"
            )
        if verifier_state is not None:
            model.initialize_from_verifier(init_path, verifier_state)
        return model

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
        return super().train_step(
            self.drafter_sample(sample, model), model, criterion, optimizer, update_num, ignore_grad
        )

    def valid_step(self, sample, model, criterion):
        # Fixed cut points per batch, so validation losses compare across epochs.
        generator = torch.Generator().manual_seed(int(sample["id"].sum()))
        drafter_sample = self.drafter_sample(sample, model, generator)
        loss, sample_size, logging_output = super().valid_step(drafter_sample, model, criterion)
        if self.cfg.eval_acceptance_verifier:
            if type(model).__name__ == "FullyShardedDataParallel":  # its parameters are sharded
                raise SpecNmtError(
                    "--eval-acceptance-verifier does not work with --ddp-backend fully_sharded"
                )
            logging_output.update(self._acceptance_counts(sample, _unwrapped(model)))
        return loss, sample_size, logging_output

    def acceptance_settings(self) -> Dict[str, DecodingSettings]:
        """The rules --eval-acceptance-verifier measures, by metric name."""
        # batches of validation sentences: they must draft to measure anything
        lossless = DEFAULTS.replace(block_size=self.cfg.block_size, max_draft_batch=0)
        settings = {"accepted_lossless": lossless}
        if (self.cfg.beta, self.cfg.tau) != (lossless.beta, lossless.tau):
            settings["accepted_top_beta"] = lossless.replace(beta=self.cfg.beta, tau=self.cfg.tau)
        return settings

    def _acceptance_counts(self, sample, drafter_model) -> Dict[str, int]:
        """Accepted drafts and iterations of each measured rule on this validation batch; zeros
        for a batch without a selected sentence (DDP sums the same keys from every worker)."""
        verifier_model = self._verifier_for_acceptance(drafter_model)
        drafter = drafter_adapter(drafter_model, self.target_dictionary)
        source = self._acceptance_source(sample)
        counts = {}
        for name, settings in self.acceptance_settings().items():
            drafts = iterations = 0
            if source is not None:
                generator = self.generator_for(verifier_model, drafter, settings)
                generator.generate([verifier_model], source)
                drafts, iterations = generator.stats.accepted_tokens, generator.stats.iterations
            counts[f"_{name}_drafts"] = drafts
            counts[f"_{name}_iterations"] = iterations
        return counts

    def _acceptance_source(self, sample) -> Optional[Dict]:
        """The batch's sentences that --eval-acceptance-sentences selects, as generator input
        (None when it selects none)."""
        src_tokens = sample["net_input"]["src_tokens"]
        src_lengths = sample["net_input"]["src_lengths"]
        limit = self.cfg.eval_acceptance_sentences
        if limit:
            chosen = sample["id"] < limit
            if not bool(chosen.any()):
                return None
            src_lengths = src_lengths[chosen]
            src_tokens = src_tokens[chosen]
            # without the padding columns that only the other rows needed
            src_tokens = src_tokens[:, src_tokens.ne(self.source_dictionary.pad()).any(dim=0)]
        return {"net_input": {"src_tokens": src_tokens, "src_lengths": src_lengths}}

    def _verifier_for_acceptance(self, drafter_model):
        if self._acceptance_verifier is None:
            flag, path = "--eval-acceptance-verifier", self.cfg.eval_acceptance_verifier
            verifier = self._load_beside(path, _read_checkpoint(flag, path), drafter_model)
            if isinstance(verifier, SpecDrafterModel):
                raise SpecNmtError(
                    f"{flag} {path} is a drafter; give the verifier (a Transformer trained "
                    "with --task translation)"
                )
            if isinstance(drafter_model, CachedDrafterModel):
                drafter_model.check_verifier_matches(verifier)
            self._acceptance_verifier = verifier
            rules = " and ".join(
                f"{name} (beta {s.beta}, tau {s.tau:g})"
                for name, s in self.acceptance_settings().items()
            )
            sentences = self.cfg.eval_acceptance_sentences
            logger.info("validation decodes %s with the verifier %s at k=%d: %s",
                        f"its first {sentences} sentences" if sentences else "every sentence",
                        path, self.cfg.block_size, rules)  # fmt: skip
        return self._acceptance_verifier

    def _load_beside(self, path: str, state, reference_model):
        """The model of a checkpoint, on the device and in the dtype of ``reference_model``."""
        (model,), _ = checkpoint_utils.load_model_ensemble([path], task=self, state=state)
        reference = next(reference_model.parameters())
        return model.to(device=reference.device, dtype=reference.dtype).eval()

    def reduce_metrics(self, logging_outputs, criterion):
        super().reduce_metrics(logging_outputs, criterion)
        for name in self.acceptance_settings():
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

    def drafter_sample(self, sample, model, generator: Optional[torch.Generator] = None):
        """Turn a translation batch into a drafter batch for ``model``: cut every target at
        --cuts-per-sentence random points (stratified: the j-th of m cuts falls in the j-th m-th
        of its length). Labels are one row per cut, the cuts of a sentence next to each other.
        A Spec-Drafter gets one decoder row per cut (its model runs the encoder once per
        sentence and shares it between them); a cached or heads drafter gets BOS + target once
        and one block of k masks per cut."""
        target = sample["target"]
        pad, eos = self.target_dictionary.pad(), self.target_dictionary.eos()
        mask = self.drafter_dictionaries()[1].index(MASK_SYMBOL)
        k, m = self.cfg.block_size, self.cfg.cuts_per_sentence
        target_lengths = target.ne(pad).sum(dim=1).repeat_interleave(m)
        uniform = torch.rand(target_lengths.size(0), generator=generator).to(target.device)
        stratum = torch.arange(target_lengths.size(0), device=target.device) % m
        fraction = (stratum + uniform) / m
        # c in [first, len); no model (a caller's layout check) cuts as a Spec-Drafter
        first = getattr(_unwrapped(model), "FIRST_CUT", SpecDrafterModel.FIRST_CUT)
        cuts = first + (fraction * (target_lengths - first)).long()
        cuts = torch.minimum(cuts, (target_lengths - 1).clamp(min=first))

        rows = target.repeat_interleave(m, dim=0)
        label_index = cuts.unsqueeze(1) + torch.arange(k, device=target.device)
        labels = _fit_width(rows, int(label_index.max()) + 1, pad).gather(1, label_index)
        shifted = torch.cat([target.new_full((target.size(0), 1), eos), target[:, :-1]], dim=1)
        if isinstance(_unwrapped(model), CachedDrafterModel):
            masks = target.new_full((target.size(0), m * k), mask)
            net_input = dict(sample["net_input"], prev_output_tokens=torch.cat([shifted, masks], 1),
                             cuts=cuts.view(-1, m))  # fmt: skip
        else:
            shifted = _fit_width(shifted.repeat_interleave(m, dim=0), int(cuts.max()) + 1 + k, pad)
            decoder_input = masked_input(shifted, cuts + 1, k, mask, pad)
            net_input = dict(sample["net_input"], prev_output_tokens=decoder_input)
        return dict(sample, net_input=net_input, target=labels, ntokens=int(labels.ne(pad).sum()))

    # ----- speculative decoding ---------------------------------------------------------------
    def build_generator(
        self,
        models,
        args,
        seq_gen_cls=None,
        extra_gen_cls_kwargs=None,
        prefix_allowed_tokens_fn=None,
    ):
        if self.cfg.drafter_path is None:
            return super().build_generator(
                models, args, seq_gen_cls, extra_gen_cls_kwargs, prefix_allowed_tokens_fn
            )
        _check_generation_args(args, len(models), self.cfg.verify)
        tolerant_stdin()
        drafter = self.load_drafter(self.cfg.drafter_path, models[0])
        # fairseq-generate/-interactive seed torch with --seed just before this call
        generator = self.speculative_generator(models[0], drafter, args, seed=torch.initial_seed())
        atexit.register(generator.log_summary)
        return generator

    def speculative_generator(self, verifier_model, drafter, args, seed: int):
        """The speculative generator for this task's rule and draft shape, with fairseq's
        generation settings ``args`` (length limits, penalties, temperature, top-k/top-p)."""
        settings = DecodingSettings.from_fairseq(self.cfg, args, seed)
        return self.generator_for(verifier_model, drafter, settings)

    def source_token_limit(self, verifier_model, drafter) -> int:
        """The most source tokens (EOS included) the task and both models accept."""
        return min(
            self.cfg.max_source_positions,
            verifier_model.encoder.max_positions(),
            drafter.max_source_positions(),
        )

    def generator_for(self, verifier_model, drafter, settings: DecodingSettings):
        """The speculative generator for ``settings`` over these models. The verifier's linear
        layers are packed once per model (verifiers do not change while they decode)."""
        project = self._packed_verifiers.get(verifier_model)
        if project is None:
            project = self._packed_verifiers[verifier_model] = PackedLinears(verifier_model)
        verifier = TransformerVerifier(verifier_model, temperature=settings.temperature,
                                       project=project)  # fmt: skip
        generator = SpeculativeGenerator(verifier, drafter, self.target_dictionary, settings)
        # (the drafter it runs: none with k = 0)
        self._source_token_limit = self.source_token_limit(verifier_model, generator.drafter)
        return generator

    def load_drafter(self, path: str, verifier_model):
        """Load a drafter checkpoint onto the verifier's device and dtype (its linear layers in
        int8 by --drafter-precision): a Spec-Drafter, a cached drafter, or a stock Transformer
        translation model (autoregressive drafter)."""
        state = with_verifier_copies(_read_checkpoint("--drafter-path", path), verifier_model, path)
        arch = _checkpoint_arch(state)
        autoregressive = arch is not None and arch.startswith("transformer")
        if not (is_nar_drafter(state) or autoregressive):
            raise SpecNmtError(
                f"--drafter-path {path} is neither a Spec-Drafter, a cached or heads drafter nor "
                f"a Transformer checkpoint (arch {arch}); train one with --task spec_translation "
                "--arch spec_drafter_small, cached_drafter_small or heads_drafter_small, or with "
                "--task translation --arch transformer"
            )
        if autoregressive:
            embeddings = state["model"].get("decoder.embed_tokens.weight")
            if embeddings is not None and embeddings.size(0) != len(self.target_dictionary):
                raise SpecNmtError(
                    f"--drafter-path {path} has {embeddings.size(0)} target symbols but the "
                    f"dictionary in {self.cfg.data} has {len(self.target_dictionary)}: drafter "
                    "and verifier must share the data directory's dictionary"
                )
        vocabulary = read_draft_vocabulary(state, path, self.target_dictionary, autoregressive)
        model = self._load_beside(path, state, verifier_model)
        if isinstance(model, CachedDrafterModel):
            model.check_verifier_matches(verifier_model)
            # its copy of the verifier's decoder only trains: decoding reads the verifier's states
            model.verifier_decoder = None
        weights = next(model.parameters())
        if vocabulary is not None:  # before int8, which then quantizes the smaller projection
            vocabulary = vocabulary.to(weights.device)
            restrict_output(model.decoder, vocabulary)
        if drafts_in_int8(self.cfg.drafter_precision, weights.device.type, weights.dtype):
            model = _int8_linears(model)
        return drafter_adapter(model, self.target_dictionary, vocabulary)

    def get_interactive_tokens_and_lengths(self, lines, encode_fn):
        """Encode input lines; a line longer than the models accept is cut to fit (with a
        warning) instead of stopping fairseq-interactive, so N lines give N translations."""
        tokens, lengths = super().get_interactive_tokens_and_lengths(lines, encode_fn)
        limit = self._source_token_limit
        if limit is None:
            return tokens, lengths
        tokens = [cut_to_limit(line_tokens, limit) for line_tokens in tokens]
        return tokens, [line_tokens.numel() for line_tokens in tokens]


def cut_to_limit(line_tokens: torch.Tensor, limit: int) -> torch.Tensor:
    """A source line's token ids (EOS last) as the models can take them: a line of more than
    ``limit`` keeps its first ``limit - 1`` tokens and its EOS, with a warning."""
    if line_tokens.numel() <= limit:
        return line_tokens
    logger.warning(
        "input line of %d tokens is longer than the models accept; translating its first %d "
        "tokens", line_tokens.numel() - 1, limit - 1,
    )  # fmt: skip
    return torch.cat([line_tokens[: limit - 1], line_tokens[-1:]])


def tolerant_stdin() -> None:
    """fairseq-interactive reads stdin with Python's defaults, so an invalid UTF-8 byte kills it
    and a lone carriage return splits a line in two. Before anything is read, make bad bytes
    U+FFFD and only newlines end lines, so N input lines always give N outputs."""
    if isinstance(sys.stdin, io.TextIOWrapper):
        try:
            sys.stdin.reconfigure(errors="replace", newline="\n")
        except (OSError, ValueError):  # already read from (e.g. the API in a REPL): leave it
            pass


def _read_checkpoint(flag: str, path: str):
    if not os.path.isfile(path):
        raise SpecNmtError(f"{flag} {path}: no such file")
    return checkpoint_utils.load_checkpoint_to_cpu(path)


def drafter_adapter(model, dictionary, vocabulary: Optional[torch.Tensor] = None):
    """The decoding loop's adapter for a drafter model: cached drafter, Spec-Drafter (over
    ``vocabulary`` when given, see read_draft_vocabulary), or any other fairseq translation model
    as an autoregressive drafter."""
    pad, eos = dictionary.pad(), dictionary.eos()
    if isinstance(model, HeadsDrafterModel):
        return HeadsDrafter(model, pad, eos, vocabulary)
    if isinstance(model, CachedDrafterModel):
        return CachedDrafter(model, pad, eos, vocabulary)
    if isinstance(model, SpecDrafterModel):
        return NarDrafter(model, pad, eos, vocabulary)
    return ArDrafter(model, pad, eos)


# The checkpoint key of a NAR drafter's draft vocabulary (scripts/export_model.py writes it).
DRAFT_VOCABULARY_KEY = "draft_vocabulary"


def read_draft_vocabulary(state, path: str, dictionary,
                          autoregressive: bool) -> Optional[torch.Tensor]:  # fmt: skip
    """The ascending target symbol ids a drafter checkpoint drafts over (None: all of them),
    checked against the target ``dictionary``: every id a symbol of it, EOS among them, PAD
    not."""
    vocabulary = state.get(DRAFT_VOCABULARY_KEY)
    if vocabulary is None:
        return None
    problem = None
    if autoregressive:
        problem = "only the NAR drafters (Spec-Drafter, cached, heads) draft over a vocabulary"
    elif not isinstance(vocabulary, torch.Tensor) or vocabulary.dim() != 1 or (
        vocabulary.is_floating_point() or vocabulary.numel() == 0
    ):
        problem = "it must be a non-empty 1-d tensor of symbol ids"
    elif not bool((vocabulary[1:] > vocabulary[:-1]).all()):
        problem = "its ids must be ascending and distinct"
    elif int(vocabulary[0]) < 0 or int(vocabulary[-1]) >= len(dictionary):
        problem = f"its ids must be symbols of the {len(dictionary)}-symbol target dictionary"
    elif dictionary.pad() in vocabulary.tolist() or dictionary.eos() not in vocabulary.tolist():
        problem = "it must hold EOS and not PAD"
    if problem:
        raise SpecNmtError(f"--drafter-path {path}: bad {DRAFT_VOCABULARY_KEY}: {problem}")
    return vocabulary.long()


def _with_mask(dictionary):
    if MASK_SYMBOL in dictionary.indices:
        return dictionary
    extended = copy.deepcopy(dictionary)
    extended.add_symbol(MASK_SYMBOL, n=0)
    return extended


# The layers that --drafter-precision int8 quantizes: the feed-forward layers and the output
# projection, where int8 pays (2-5x on a CPU). The attention projections stay: int8 was slower
# there, and fairseq's own attention reads their weights as tensors.
INT8_LAYERS = ("fc1", "fc2", "output_projection")


def drafts_in_int8(precision: str, device_type: str, dtype: torch.dtype) -> bool:
    """Whether a drafter whose weights are on ``device_type`` in ``dtype`` runs its layers in
    int8: asked for, or ``auto`` on the CPU in fp32, where
    int8 drafts cost about 0.1 greedy steps less per iteration for the same acceptance
    (BENCHMARKS.md). Not the default: with activation scales per call, a sentence's drafts (and
    so its top-beta/tau output) would depend on the batch it is decoded in."""
    if precision not in DRAFTER_PRECISION_NAMES:
        raise SpecNmtError(
            f"--drafter-precision must be auto, fp32 or int8, got {precision!r}"
        )
    cpu_fp32 = device_type == "cpu" and dtype == torch.float32
    if precision == "int8" and not cpu_fp32:
        raise SpecNmtError(
            "--drafter-precision int8 runs on the CPU in fp32 only (add --cpu, drop --fp16)"
        )
    return precision == "int8" or (precision == "auto" and cpu_fp32)


def _int8_linears(model):
    """The model with its feed-forward and output layers dynamically quantized to int8 (int8
    weights, activations quantized per call); drafts only decide what gets accepted."""
    quantized = {
        name: torch.ao.quantization.default_dynamic_qconfig
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in INT8_LAYERS
    }
    with warnings.catch_warnings():  # torch.ao's deprecation notice for eager-mode quantization
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, quantized, dtype=torch.qint8)


def _unwrapped(model):
    """The model inside fairseq's distributed wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _fit_width(tokens, width: int, pad: int):
    """Right-pad or cut [B, T] tokens to [B, width]."""
    if tokens.size(1) >= width:
        return tokens[:, :width]
    filler = tokens.new_full((tokens.size(0), width - tokens.size(1)), pad)
    return torch.cat([tokens, filler], dim=1)


def is_nar_drafter(state) -> bool:
    """Whether a checkpoint is a NAR drafter: a Spec-Drafter, a cached or a heads drafter."""
    arch = _checkpoint_arch(state)
    return arch is not None and arch.startswith(("spec_drafter", "cached_drafter",
                                                 "heads_drafter"))  # fmt: skip


def _checkpoint_arch(state) -> Optional[str]:
    model = model_config(state)
    return getattr(model, "arch", None) or getattr(model, "_name", None)


def _beam_given_on_command_line() -> bool:
    return any(arg == "--beam" or arg.startswith("--beam=") for arg in sys.argv[1:])


def _check_generation_args(args, n_models: int, verify: str) -> None:
    """Reject generation flags that speculative decoding cannot honour, one line each."""
    if n_models != 1:
        raise SpecNmtError("speculative decoding takes exactly one verifier in --path")
    # fairseq's default --beam is 5; only an explicit --beam other than 1 is a user's request.
    if getattr(args, "beam", 1) != 1 and _beam_given_on_command_line():
        raise SpecNmtError(
            f"--beam {args.beam} cannot be combined with --drafter-path: speculative decoding "
            "verifies greedy decoding or sampling (drop --beam or use --beam 1)"
        )
    if not RULES[verify].sampled_drafts and getattr(args, "sampling", False):
        raise SpecNmtError(
            "--sampling with --drafter-path needs --verify sampling or --verify rsd "
            "(top_beta verifies greedy decoding)"
        )
    unsupported = {
        "nbest": (1, "--nbest must be 1 with --drafter-path (one hypothesis per sentence)"),
        "prefix_size": (0, "--prefix-size is not supported with --drafter-path"),
        "constraints": (None, "--constraints are not supported with --drafter-path"),
        "match_source_len": (False, "--match-source-len is not supported with --drafter-path"),
        "no_repeat_ngram_size": (0, "--no-repeat-ngram-size is not supported with --drafter-path"),
        "diverse_beam_groups": (-1, "diverse beam search is not supported with --drafter-path"),
        "diversity_rate": (-1.0, "--diversity-rate is not supported with --drafter-path"),
        "print_alignment": (None, "--print-alignment is not supported with --drafter-path"),
        "score_reference": (False, "--score-reference is not supported with --drafter-path"),
        "lm_path": (None, "--lm-path is not supported with --drafter-path"),
        "retain_iter_history": (
            False,
            "--retain-iter-history is not supported with --drafter-path",
        ),
    }
    for name, (default, message) in unsupported.items():
        value = getattr(args, name, default)
        if value not in (default, None):
            raise SpecNmtError(message)
