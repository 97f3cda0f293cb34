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
import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Dict, Optional
from weakref import WeakKeyDictionary

import torch
from fairseq.dataclass import ChoiceEnum
from fairseq.models import ARCH_MODEL_REGISTRY
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from spec_nmt.acceptance_validation import AcceptanceValidation
from spec_nmt.checkpoint_loading import model_config
from spec_nmt.decoding.linears import PackedLinears
from spec_nmt.decoding.loop import SpeculativeGenerator
from spec_nmt.decoding.scorer import BlockScorer
from spec_nmt.drafters.cached_drafter import CachedDrafterModel
from spec_nmt.drafters.spec_drafter import MASK_SYMBOL, SpecDrafterModel
from spec_nmt.drafters.training_batches import drafter_sample, unwrapped
from spec_nmt.errors import SpecNmtError
from spec_nmt.loading import load_decoding_drafter, read_checkpoint, with_mask
from spec_nmt.options import (
    DEFAULT_DRAFTER,
    DEFAULT_DRAFTER_PRECISION,
    DRAFTER_CHOICES,
    DRAFTER_HELP,
    DRAFTER_PRECISION_HELP,
    DRAFTER_PRECISION_NAMES,
)
from spec_nmt.runtime import THREADS_HELP, announce_kernel_timing, use_threads_unless_set
from spec_nmt.settings import (
    DECODING_LOOPS,
    DEFAULTS,
    RULE_SETTINGS,
    VERIFY_RULES,
    DecodingSettings,
    samples,
)
from spec_nmt.text import cut_to_limit, tolerant_stdin

VERIFY_CHOICES = ChoiceEnum(list(VERIFY_RULES))
LOOP_CHOICES = ChoiceEnum(list(DECODING_LOOPS))
DRAFTER_PRECISIONS = ChoiceEnum(list(DRAFTER_PRECISION_NAMES))
DRAFTER_KINDS = ChoiceEnum(list(DRAFTER_CHOICES))


@dataclass
class SpecTranslationBaseConfig(TranslationConfig):
    """The task's own options; the decoding options join them from DecodingSettings."""

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
            "given (or with --drafter twin or none), fairseq-generate/fairseq-interactive "
            "decode speculatively with the --path model as the verifier"
        },
    )
    drafter: DRAFTER_KINDS = field(default=DEFAULT_DRAFTER, metadata={"help": DRAFTER_HELP})
    drafter_precision: DRAFTER_PRECISIONS = field(
        default=DEFAULT_DRAFTER_PRECISION,
        metadata={"help": DRAFTER_PRECISION_HELP},
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
    threads: Optional[int] = field(
        default=None,
        metadata={
            "help": f"with --drafter-path: {THREADS_HELP}, as in spec-nmt-translate; where "
            "OMP_NUM_THREADS is set and --threads is not, torch keeps the count it set"
        },
    )


# What a decoding option also means when this task trains a drafter (DecodingSettings' help
# texts are about decoding: spec-nmt-translate shows them too)
TRAINING_HELP = {"block_size": "In drafter training: the [MASK] positions per cut"}


def _decoding_options():
    """The rule's options as config fields, with DecodingSettings' defaults and help texts."""
    options = []
    for setting in dataclasses.fields(DecodingSettings):
        if setting.name in RULE_SETTINGS:
            kind = {"verify": VERIFY_CHOICES, "decoding_loop": LOOP_CHOICES}.get(setting.name,
                                                                               setting.type)
            text = ". ".join(filter(None, [setting.metadata["help"],
                                           TRAINING_HELP.get(setting.name)]))  # fmt: skip
            options.append((setting.name, kind, field(default=setting.default,
                                                      metadata={"help": text})))  # fmt: skip
    return options


SpecTranslationConfig = dataclasses.make_dataclass(
    "SpecTranslationConfig", _decoding_options(), bases=(SpecTranslationBaseConfig,)
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
        self.acceptance = AcceptanceValidation(self)
        self._packed_verifiers: "WeakKeyDictionary[torch.nn.Module, PackedLinears]" = (
            WeakKeyDictionary()
        )
        # per verifier, its static loops by settings (generator_for)
        self._static_loops: "WeakKeyDictionary[torch.nn.Module, Dict]" = WeakKeyDictionary()

    # ----- dictionaries -------------------------------------------------------------------
    def drafter_dictionaries(self):
        """(source, target) dictionaries of the drafter: the data's, with [MASK] appended when
        missing. Appending keeps every other index, so drafter and verifier ids agree."""
        if self._drafter_dicts is None:
            self._drafter_dicts = tuple(
                with_mask(d) for d in (self.source_dictionary, self.target_dictionary)
            )
        return self._drafter_dicts

    # ----- training the drafter -------------------------------------------------------------
    def build_model(self, cfg, from_checkpoint=False):
        init_path = getattr(cfg, "init_from_verifier", None)
        verifier_state = None
        if not from_checkpoint and init_path:
            verifier_state = read_checkpoint("--init-from-verifier", init_path)
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
            logging_output.update(self.acceptance.counts(sample, unwrapped(model)))
        return loss, sample_size, logging_output

    def reduce_metrics(self, logging_outputs, criterion):
        super().reduce_metrics(logging_outputs, criterion)
        self.acceptance.log_metrics(logging_outputs)

    def drafter_sample(self, sample, model, generator: Optional[torch.Generator] = None):
        """A translation batch as a drafter batch for ``model`` (training_batches.py)."""
        mask = self.drafter_dictionaries()[1].index(MASK_SYMBOL)
        pad, eos = self.target_dictionary.pad(), self.target_dictionary.eos()
        return drafter_sample(sample, model, self.cfg.block_size, self.cfg.cuts_per_sentence,
                              mask, pad, eos, generator)  # fmt: skip

    # ----- speculative decoding ---------------------------------------------------------------
    def build_generator(
        self,
        models,
        args,
        seq_gen_cls=None,
        extra_gen_cls_kwargs=None,
        prefix_allowed_tokens_fn=None,
    ):
        # without a drafter file, only --drafter twin or none asks for speculative decoding
        if self.cfg.drafter_path is None and self.cfg.drafter in ("auto", "file"):
            return super().build_generator(
                models, args, seq_gen_cls, extra_gen_cls_kwargs, prefix_allowed_tokens_fn
            )
        check_generation_args(args, len(models), self.cfg.verify)
        # Speculative decoding keeps one hypothesis, greedy or sampled, whatever fairseq's
        # default --beam 5 says; fairseq-generate prints this value ("Generate test with beam=").
        args.beam = 1
        tolerant_stdin()
        # (before the drafter loads: the product kernels are chosen per thread count)
        use_threads_unless_set(self.cfg.threads)
        announce_kernel_timing(next(models[0].parameters()).device)
        drafter = load_decoding_drafter(self, self.cfg.drafter, self.cfg.drafter_path,
                                        models[0])  # fmt: skip
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

    def generator_for(self, verifier_model, drafter, settings: DecodingSettings,
                      capture_graphs: bool = True):  # fmt: skip
        """The speculative generator for ``settings`` over these models, with the parts that
        take a while to make kept across generators (a translator makes one per call): the
        verifier's packed linear layers per model (verifiers do not change while they
        decode), and per verifier and settings the static loop with the CUDA graphs it
        captured, while the verifier's weights stay those it was made with.
        ``capture_graphs`` False: on CUDA the static loop runs its iterations eagerly."""
        project = self._packed_verifiers.get(verifier_model)
        if project is None:
            project = self._packed_verifiers[verifier_model] = PackedLinears(verifier_model)
        verifier = BlockScorer(verifier_model, temperature=settings.temperature,
                                       project=project)  # fmt: skip
        loops = self._static_loops.setdefault(verifier_model, {})
        static = loops.get(settings)
        if static is not None and not static.current():
            static = None
        # (without one kept, the generator makes the static loop where it is wanted)
        generator = SpeculativeGenerator(verifier, drafter, self.target_dictionary, settings,
                                         static)  # fmt: skip
        if generator.static is not None:
            loops[settings] = generator.static
            if not capture_graphs:  # (a loop whose capture failed stays off)
                generator.static.capture_graphs = False
        # (the drafter it runs: none with k = 0)
        self._source_token_limit = self.source_token_limit(verifier_model, generator.drafter)
        return generator

    def get_interactive_tokens_and_lengths(self, lines, encode_fn):
        """Encode input lines; a line longer than the models accept is cut to fit (with a
        warning) instead of stopping fairseq-interactive, so N lines give N translations."""
        tokens, lengths = super().get_interactive_tokens_and_lengths(lines, encode_fn)
        limit = self._source_token_limit
        if limit is None:
            return tokens, lengths
        tokens = [cut_to_limit(line_tokens, limit) for line_tokens in tokens]
        return tokens, [line_tokens.numel() for line_tokens in tokens]


def _beam_given_on_command_line() -> bool:
    return any(arg == "--beam" or arg.startswith("--beam=") for arg in sys.argv[1:])


def check_generation_args(args, n_models: int, verify: str) -> None:
    """Reject generation flags that speculative decoding cannot honour, one line each."""
    if n_models != 1:
        raise SpecNmtError("speculative decoding takes exactly one verifier in --path")
    # fairseq's default --beam is 5; only an explicit --beam other than 1 is a user's request.
    if getattr(args, "beam", 1) != 1 and _beam_given_on_command_line():
        raise SpecNmtError(
            f"--beam {args.beam} cannot be combined with --drafter-path: speculative decoding "
            "verifies greedy decoding or sampling (drop --beam or use --beam 1)"
        )
    if not samples(verify) and getattr(args, "sampling", False):
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
