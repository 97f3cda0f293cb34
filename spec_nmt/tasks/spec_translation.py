"""Task ``spec_translation``: fairseq's translation task, plus

* training a Spec-Drafter: every target is cut at a random point c; the decoder input becomes
  BOS + y[:c] + k [MASK]s and the labels y[c:c+k] (EOS included, padding past the end);
* speculative decoding: with ``--drafter-path``, ``build_generator`` returns the speculative
  generator, so ``fairseq-generate`` and ``fairseq-interactive`` decode with it unchanged.
"""

import atexit
import copy
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch
from fairseq import checkpoint_utils
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from spec_nmt.decoding.drafters import NarDrafter
from spec_nmt.decoding.generator import SpeculativeGenerator
from spec_nmt.decoding.verifier import TransformerVerifier
from spec_nmt.decoding.verify import check_top_beta_params
from spec_nmt.errors import SpecNmtError
from spec_nmt.models.spec_drafter import MASK_SYMBOL, SpecDrafterModel

logger = logging.getLogger(__name__)


@dataclass
class SpecTranslationConfig(TranslationConfig):
    block_size: int = field(
        default=25,
        metadata={
            "help": "k: [MASK] positions the drafter fills per iteration, in training and decoding"
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
            "help": "Spec-Drafter checkpoint; when given, fairseq-generate/fairseq-interactive "
            "decode speculatively with the --path model as the verifier"
        },
    )
    beta: int = field(
        default=1,
        metadata={"help": "top-beta rule: a drafted token must be among the verifier's beta best"},
    )
    tau: float = field(
        default=0.0,
        metadata={
            "help": "top-beta rule: a drafted token's log-prob must be within tau of the "
            "verifier's best (--beta 1 --tau 0 is lossless: exactly the verifier's greedy output)"
        },
    )


@register_task("spec_translation", dataclass=SpecTranslationConfig)
class SpecTranslationTask(TranslationTask):
    cfg: SpecTranslationConfig

    def __init__(self, cfg: SpecTranslationConfig, src_dict, tgt_dict):
        if cfg.block_size < 1:
            raise SpecNmtError(f"--block-size must be >= 1, got {cfg.block_size}")
        if cfg.cuts_per_sentence < 1:
            raise SpecNmtError(f"--cuts-per-sentence must be >= 1, got {cfg.cuts_per_sentence}")
        check_top_beta_params(cfg.beta, cfg.tau)
        super().__init__(cfg, src_dict, tgt_dict)
        self._drafter_dicts = None
        self._source_token_limit = None

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
        model = super().build_model(cfg, from_checkpoint)
        if not from_checkpoint and not isinstance(model, SpecDrafterModel):
            raise SpecNmtError(
                "--task spec_translation trains Spec-Drafters (--arch spec_drafter_small, "
                "spec_drafter_base, ...); train the verifier with --task translation"
            )
        init_path = getattr(cfg, "init_from_verifier", None)
        if not from_checkpoint and init_path:
            model.initialize_from_verifier(init_path)
        return model

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
        return super().train_step(
            self.drafter_sample(sample), model, criterion, optimizer, update_num, ignore_grad
        )

    def valid_step(self, sample, model, criterion):
        # Fixed cut points per batch, so validation losses compare across epochs.
        generator = torch.Generator().manual_seed(int(sample["id"].sum()))
        return super().valid_step(self.drafter_sample(sample, generator), model, criterion)

    def drafter_sample(self, sample, generator: Optional[torch.Generator] = None):
        """Turn a translation batch into a drafter batch: cut every target at random points c
        (--cuts-per-sentence rows per sentence, next to each other; the drafter model runs the
        encoder once per sentence and shares it between them)."""
        target = sample["target"].repeat_interleave(self.cfg.cuts_per_sentence, dim=0)
        pad, eos = self.target_dictionary.pad(), self.target_dictionary.eos()
        mask = self.drafter_dictionaries()[1].index(MASK_SYMBOL)
        k = self.cfg.block_size
        target_lengths = target.ne(pad).sum(dim=1)
        # Stratified: the j-th of m cuts of a sentence falls in the j-th m-th of its length.
        m = self.cfg.cuts_per_sentence
        uniform = torch.rand(target.size(0), generator=generator).to(target.device)
        stratum = torch.arange(target.size(0), device=target.device) % m
        fraction = (stratum + uniform) / m
        cuts = (fraction * target_lengths).long().clamp(max=target_lengths - 1)  # c in [0, len)

        width = int(cuts.max()) + 1 + k
        slots = torch.arange(width, device=target.device).unsqueeze(0)
        shifted = torch.cat([target.new_full((target.size(0), 1), eos), target], dim=1)
        shifted = _fit_width(shifted, width, pad)
        prefix_end = cuts.unsqueeze(1) + 1
        decoder_input = torch.where(
            slots < prefix_end, shifted, torch.where(slots < prefix_end + k, mask, pad)
        )
        label_index = cuts.unsqueeze(1) + torch.arange(k, device=target.device)
        labels = _fit_width(target, int(label_index.max()) + 1, pad).gather(1, label_index)

        drafter_sample = dict(sample)
        drafter_sample["net_input"] = dict(sample["net_input"], prev_output_tokens=decoder_input)
        drafter_sample["target"] = labels
        drafter_sample["ntokens"] = int(labels.ne(pad).sum())
        return drafter_sample

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
        _check_generation_args(args, len(models))
        verifier = TransformerVerifier(models[0], temperature=getattr(args, "temperature", 1.0))
        drafter = self.load_drafter(self.cfg.drafter_path, models[0])
        self._source_token_limit = min(
            self.cfg.max_source_positions,
            models[0].encoder.max_positions(),
            drafter.model.encoder.max_positions(),
        )
        generator = SpeculativeGenerator(
            verifier,
            drafter,
            self.target_dictionary,
            block_size=self.cfg.block_size,
            beta=self.cfg.beta,
            tau=self.cfg.tau,
            max_len_a=getattr(args, "max_len_a", 0),
            max_len_b=getattr(args, "max_len_b", 200),
            min_len=getattr(args, "min_len", 1),
            normalize_scores=not getattr(args, "unnormalized", False),
            len_penalty=getattr(args, "lenpen", 1),
            unk_penalty=getattr(args, "unkpen", 0),
        )
        atexit.register(generator.log_summary)
        return generator

    def load_drafter(self, path: str, verifier_model) -> NarDrafter:
        """Load a Spec-Drafter checkpoint onto the verifier's device and dtype."""
        if not os.path.isfile(path):
            raise SpecNmtError(f"--drafter-path {path}: no such file")
        try:
            state = checkpoint_utils.load_checkpoint_to_cpu(path)
        except Exception as error:  # truncated, corrupt or not a torch file at all
            raise SpecNmtError(
                f"--drafter-path {path} is not a readable fairseq checkpoint "
                f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
            ) from error
        arch = _checkpoint_arch(state)
        if arch is None or not arch.startswith("spec_drafter"):
            raise SpecNmtError(
                f"--drafter-path {path} is not a Spec-Drafter checkpoint (arch {arch}); train "
                "one with --task spec_translation --arch spec_drafter_small (or spec_drafter_base)"
            )
        (model,), _ = checkpoint_utils.load_model_ensemble([path], task=self, state=state)
        reference = next(verifier_model.parameters())
        model = model.to(device=reference.device, dtype=reference.dtype).eval()
        return NarDrafter(model, pad=self.target_dictionary.pad())

    def get_interactive_tokens_and_lengths(self, lines, encode_fn):
        """Encode input lines; a line longer than the models accept is cut to fit (with a
        warning) instead of stopping fairseq-interactive, so N lines give N translations."""
        tokens, lengths = super().get_interactive_tokens_and_lengths(lines, encode_fn)
        limit = self._source_token_limit
        if limit is None:
            return tokens, lengths
        eos = self.source_dictionary.eos()
        for i, line_tokens in enumerate(tokens):
            if line_tokens.numel() > limit:
                logger.warning(
                    "input line of %d tokens is longer than the models accept; "
                    "translating its first %d tokens",
                    line_tokens.numel() - 1,
                    limit - 1,
                )
                tokens[i] = torch.cat([line_tokens[: limit - 1], line_tokens.new_tensor([eos])])
                lengths[i] = limit
        return tokens, lengths


def _with_mask(dictionary):
    if MASK_SYMBOL in dictionary.indices:
        return dictionary
    extended = copy.deepcopy(dictionary)
    extended.add_symbol(MASK_SYMBOL, n=0)
    return extended


def _fit_width(tokens, width: int, pad: int):
    """Right-pad or cut [B, T] tokens to [B, width]."""
    if tokens.size(1) >= width:
        return tokens[:, :width]
    filler = tokens.new_full((tokens.size(0), width - tokens.size(1)), pad)
    return torch.cat([tokens, filler], dim=1)


def _checkpoint_arch(state) -> Optional[str]:
    cfg = state.get("cfg")
    if cfg is not None and cfg.get("model") is not None:
        return getattr(cfg["model"], "arch", None) or getattr(cfg["model"], "_name", None)
    args = state.get("args")
    return getattr(args, "arch", None)


def _beam_given_on_command_line() -> bool:
    return any(arg == "--beam" or arg.startswith("--beam=") for arg in sys.argv[1:])


def _check_generation_args(args, n_models: int) -> None:
    """Reject generation flags that speculative decoding cannot honour, one line each."""
    if n_models != 1:
        raise SpecNmtError("speculative decoding takes exactly one verifier in --path")
    # fairseq's default --beam is 5; only an explicit --beam other than 1 is a user's request.
    if getattr(args, "beam", 1) != 1 and _beam_given_on_command_line():
        raise SpecNmtError(
            f"--beam {args.beam} cannot be combined with --drafter-path: speculative decoding "
            "verifies greedy decoding (drop --beam or use --beam 1)"
        )
    unsupported = {
        "nbest": (1, "--nbest must be 1 with --drafter-path (one hypothesis per sentence)"),
        "sampling": (False, "--sampling is not available with --drafter-path"),
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
