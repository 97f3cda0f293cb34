"""Python API in fairseq's hub style: a model directory in, sentences in, sentences out.

    from spec_nmt.translator import SpecTranslator
    translator = SpecTranslator.from_pretrained("data/models/bench-de-en", block_size=5, beta=3, tau=1.0)
    translator.translate("Guten Morgen.")
    translator.translate(["Guten Morgen.", "Wie geht es dir? Gut."], batch_size=32)
    translator.sample("Guten Morgen.", temperature=0.7, verify="rsd", tree_branching="2,1,1")
    translator.statistics  # per line of the last call: sentences, decoded, iterations, ...
    translator.decoding_stats  # the last call's totals: drafted, accepted, batches without drafts

Each input line may hold several sentences: it is split into sentences, which are translated in
batches, and their translations are joined into one output line (split_sentences=False sends each
line as it is). A model directory holds verifier.pt, drafter.pt, dict.{src,tgt}.txt and spm.model
(scripts/export_model.py writes one). Sentencepiece is applied to the input and removed from the
output; decoding settings are keyword arguments named as in ``DecodingSettings``
(spec_nmt/settings.py, which holds their defaults): block_size, beta, tau, verify, seed, ...

A sentence whose translation lost one of its numbers is repaired after decoding
(spec_nmt/number_repair.py; ``keep_numbers=False`` turns it off): the guarantees of the rules
(lossless: the verifier's greedy output; sampling: exact samples) hold for the model's output
before that repair, and for every sentence that kept its numbers.
"""

import functools
import logging
import secrets
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import spec_nmt.plugin  # noqa: F401  isort: skip  (first: fairseq quiet, the plugin registered)
import sentencepiece
import torch
from fairseq import checkpoint_utils, utils

from spec_nmt.data_prep import MAX_PIECES
from spec_nmt.decoding.loop import DecodingStats, SpeculativeGenerator
from spec_nmt.decoding.scorer import BlockScorer
from spec_nmt.drafters.spec_drafter import MASK_SYMBOL
from spec_nmt.errors import SpecNmtError
from spec_nmt.loading import load_decoding_drafter
from spec_nmt.number_repair import ConstrainedRedecoder, repair
from spec_nmt.options import DEFAULT_BATCH_SIZE, DEFAULT_DRAFTER, DEFAULT_DRAFTER_PRECISION
from spec_nmt.runtime import DEFAULT_THREADS, announce_kernel_timing, use_threads
from spec_nmt.settings import (
    DEFAULTS,
    KEYWORDS,
    VERIFY_RULES,
    DecodingSettings,
    check_sampling_settings_used,
    samples,
)
from spec_nmt.symbols import ForeignCharacters, nothing_to_translate
from spec_nmt.task import SpecTranslationConfig, SpecTranslationTask
from spec_nmt.text import (
    clean_line,
    cut_to_limit,
    join_pieces,
    join_sentences,
    split_sentences,
    warn_of_long_sentences,
)


def device_drafter(model_dir: Path, device: str) -> Path:
    """The model directory's drafter for this device: ``drafter.DEVICE.pt`` (drafter.cuda.pt,
    drafter.cpu.pt) where the directory holds one, the drafter that measured fastest there; else
    ``drafter.pt``."""
    own = model_dir / f"drafter.{torch.device(device).type}.pt"
    return own if own.is_file() else model_dir / "drafter.pt"


class SpecTranslator:
    """A verifier, a drafter (Spec-Drafter, cached or autoregressive), their dictionaries and the
    sentencepiece model, loaded once; each call decodes with the settings it is given."""

    def __init__(self, task: SpecTranslationTask, verifier, drafter, spm_model,
                 settings: DecodingSettings, seeded: bool = False,
                 drafter_path: Optional[Path] = None):  # fmt: skip
        self.task = task
        self.verifier = verifier
        self.drafter = drafter
        self.spm = spm_model
        self.settings = settings  # every call's defaults
        # whether settings.seed was chosen: without a seed, each sample() call draws its own
        self.seeded = seeded
        self.drafter_path = drafter_path  # the file the drafter came from (--stats names it)
        self.src_dict, self.tgt_dict = task.source_dictionary, task.target_dictionary
        self.max_source_tokens = task.source_token_limit(verifier, drafter)
        # characters the source side cannot read: kept out of it (symbols.py)
        self.foreign = ForeignCharacters(set("".join(_pieces(self.src_dict))), spm_model.normalize)
        self.statistics: List[Dict] = []
        # the last call's totals: drafted, accepted, batches decoded without drafts, ...
        self.decoding_stats = DecodingStats()

    @classmethod
    def from_pretrained(
        cls,
        model_dir: Union[str, Path],
        drafter_path: Optional[Union[str, Path]] = None,
        source_lang: str = "de",
        target_lang: str = "en",
        device: Optional[str] = None,
        drafter: str = DEFAULT_DRAFTER,
        drafter_precision: str = DEFAULT_DRAFTER_PRECISION,
        verbose: bool = False,
        dtype: torch.dtype = torch.float32,
        threads: int = DEFAULT_THREADS,
        **settings,
    ) -> "SpecTranslator":
        """Load ``model_dir`` onto ``device`` (default: CUDA when available) with its drafter
        for that device (``device_drafter``), or ``drafter_path`` instead, in ``dtype``
        (torch.float16: as fairseq's --fp16); ``drafter`` (auto, twin, file, none) is the
        task's ``--drafter`` (auto and twin need no drafter file; auto drafts with it where the
        twin does not), ``drafter_precision`` (auto, fp32, bf16, int8) its
        ``--drafter-precision``.
        ``settings`` are the defaults of every call. fairseq's and spec_nmt's INFO lines
        (dictionary sizes, loading) go to the log only when ``verbose``; warnings always do.
        ``threads``: torch's CPU threads per operation, set for the whole process
        (torch.set_num_threads; spec_nmt/runtime.py says why the default is 1)."""
        use_threads(threads)  # (first: the product kernels are chosen per thread count)
        # fairseq sets the root logger to DEBUG when imported: an application embedding the
        # translator would print every loading step otherwise
        for name in ("fairseq", "spec_nmt"):
            logging.getLogger(name).setLevel(logging.INFO if verbose else logging.WARNING)
        model_dir = Path(model_dir)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        given = drafter_path is not None
        if given and not Path(drafter_path).is_file():
            raise SpecNmtError(f"drafter {drafter_path}: no such file")
        drafter_path = Path(drafter_path) if given else device_drafter(model_dir, device)
        needed = ["verifier.pt", f"dict.{source_lang}.txt", f"dict.{target_lang}.txt", "spm.model"]
        needed = [model_dir / name for name in needed]
        if drafter != "none" and (given or drafter == "file" or drafter_path.is_file()):
            needed.append(drafter_path)
        else:  # (the twin, or nothing, drafts: a verifier without a drafter of its own)
            drafter_path = None
        for path in needed:
            if not path.is_file():
                raise SpecNmtError(
                    f"{path} is missing: a model directory holds verifier.pt, drafter.pt, "
                    "dict.*.txt and spm.model (scripts/export_model.py writes one)"
                )
        announce_kernel_timing(device)
        defaults = DEFAULTS.replace(**settings)
        cfg = SpecTranslationConfig(
            data=str(model_dir), source_lang=source_lang, target_lang=target_lang,
            drafter_path=drafter_path and str(drafter_path), drafter=drafter,
            drafter_precision=drafter_precision,
        )  # fmt: skip
        task = SpecTranslationTask.setup_task(cfg)
        verifier = _load_verifier(model_dir / "verifier.pt", task)
        verifier = verifier.to(device=device, dtype=dtype).eval()
        drafter = load_decoding_drafter(task, drafter, cfg.drafter_path, verifier)
        spm_model = _load_sentencepiece(model_dir / "spm.model", task.source_dictionary,
                                        model_dir / f"dict.{source_lang}.txt")  # fmt: skip
        return cls(task, verifier, drafter, spm_model, defaults, seeded="seed" in settings,
                   drafter_path=drafter_path)  # fmt: skip

    @property
    def device(self) -> torch.device:
        return next(self.verifier.parameters()).device

    # ----- generators -------------------------------------------------------------------------
    def generator(self, **settings) -> SpeculativeGenerator:
        """A speculative generator over the loaded models, with these settings changed."""
        settings = self.settings.replace(**settings)
        return self.task.generator_for(self.verifier, self.drafter, settings)

    # ----- text in, text out --------------------------------------------------------------
    def translate(
        self,
        lines: Union[str, Sequence[str]],
        batch_size: int = DEFAULT_BATCH_SIZE,
        split_sentences: bool = True,
        progress: Optional[Callable[[int], None]] = None,
        keep_numbers: bool = True,
        **settings,
    ):
        """Translate one line (returns a string) or a list (returns a list, same order). A line
        of several sentences is split, its sentences are translated in batches with all others
        and joined again (``split_sentences=False`` sends each line as one sentence).
        ``progress(n)`` is called after each batch with the n lines it finished (maybe 0).
        ``keep_numbers``: a sentence whose translation lost a number of its source gets it back
        (spec_nmt/number_repair.py); lossless output is the verifier's greedy output before
        that repair, and ``False`` returns it as it is."""
        generator = self.generator(**settings)
        if samples(generator.verify):
            raise SpecNmtError("translate() verifies greedy decoding; use sample() to sample")
        check_sampling_settings_used(generator.verify, settings, KEYWORDS)
        return self._decode(generator, lines, batch_size, split_sentences, progress, keep_numbers)

    def sample(
        self,
        lines: Union[str, Sequence[str]],
        temperature: Optional[float] = None,
        seed: Optional[int] = None,
        verify: Optional[str] = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        split_sentences: bool = True,
        progress: Optional[Callable[[int], None]] = None,
        keep_numbers: bool = True,
        **settings,
    ):
        """Sample translations exactly from the verifier (temperature, sampling_topk,
        sampling_topp), several tokens per verifier call; ``verify`` is ``sampling`` or ``rsd``
        (draft tree: tree_branching or tree_budget, else the default tree), by default the
        translator's rule if it samples, else ``rsd`` over its tree (tree_branching: RSD-C,
        tree_budget: RSD-S) or, without one, ``sampling``. Equal seeds give equal samples;
        without a seed (here or to from_pretrained) every call draws a fresh one, so repeated
        calls give different samples. Lines are split into sentences as in translate(), and
        numbers are repaired as there: a sample that lost a number is replaced, so the samples
        are exact only with ``keep_numbers=False``."""
        sampling_rules = [name for name, rule in VERIFY_RULES.items() if rule.sampled]
        if verify is None:
            verify = self.settings.verify
            if verify not in sampling_rules:  # the translator's tree, if any, sampled with RSD
                has_tree = self.settings.tree_branching or self.settings.tree_budget
                verify = "rsd" if has_tree else "sampling"
        if verify not in sampling_rules:
            choices = " or ".join(repr(name) for name in sampling_rules)
            raise SpecNmtError(f"sample() takes verify={choices}, got {verify!r}")
        if seed is None and not self.seeded:
            seed = secrets.randbits(63)
        # temperature and seed default to the translator's settings
        given = {"temperature": temperature, "seed": seed}
        settings.update({name: value for name, value in given.items() if value is not None})
        generator = self.generator(verify=verify, **settings)
        return self._decode(generator, lines, batch_size, split_sentences, progress, keep_numbers)

    def encode(self, lines: Sequence[str], warn: bool = True) -> List[torch.Tensor]:
        """Source token ids per line; a line longer than the models accept keeps its first
        tokens (with a warning unless not ``warn``)."""
        return [cut_to_limit(self._ids(clean_line(line), self.src_dict, append_eos=True),
                             self.max_source_tokens, warn) for line in lines]  # fmt: skip

    def _ids(self, text: str, dictionary, append_eos: bool) -> torch.Tensor:
        """``dictionary``'s ids of ``text``'s sentencepiece pieces."""
        pieces = " ".join(self.spm.encode(text, out_type=str))
        return dictionary.encode_line(pieces, add_if_not_exist=False, append_eos=append_eos).long()

    def encode_target(self, text: str) -> torch.Tensor:
        """Target token ids of ``text``, without EOS (a constraint of number repair)."""
        return self._ids(text, self.tgt_dict, append_eos=False)

    def decode(self, token_ids: torch.Tensor) -> str:
        """Target ids → text, removing sentencepiece as fairseq's --bpe sentencepiece does."""
        return join_pieces(self.tgt_dict.string(token_ids))

    def batches(self, tokens: List[torch.Tensor],
                batch_size: int) -> Iterator[Tuple[List[int], Dict]]:  # fmt: skip
        """Batches of similar source length, each (line index of every row, fairseq sample).
        fairseq's collater orders rows by length, so the indices come from the sample's ids."""
        if batch_size < 1:
            raise SpecNmtError(f"batch_size must be >= 1, got {batch_size}")
        dataset = self.task.build_dataset_for_inference(tokens, [t.numel() for t in tokens])
        order = sorted(range(len(tokens)), key=lambda i: tokens[i].numel())
        for start in range(0, len(order), batch_size):
            indices = order[start : start + batch_size]  # dataset index = line index
            sample = dataset.collater([dataset[i] for i in indices])
            yield sample["id"].tolist(), _to_device(sample, self.device)

    def number_repair(self, settings: DecodingSettings) -> Callable[[str, str], str]:
        """(source sentence, its translation) → the translation with its lost numbers put back,
        re-decoding with the verifier and these settings' length limits where it must."""
        # (a sentence decoded again was encoded, and its cut reported, once already)
        encode_again = functools.partial(self.encode, warn=False)
        redecode = ConstrainedRedecoder(self.verifier, self.tgt_dict, settings, encode_again,
                                        self.encode_target, self.decode, self.batches)  # fmt: skip
        return functools.partial(repair, redecode=redecode)

    def _sentences(self, lines: Sequence[str], split: bool) -> Tuple[List[str], List[int]]:
        """The sentences of all lines in one list, and the line of each."""
        sentences, owner = [], []
        for index, line in enumerate(lines):
            text = clean_line(line)
            pieces = (split_sentences(text, self.task.cfg.source_lang) if split
                      else [text] if text else [])  # fmt: skip
            sentences.extend(pieces)
            owner.extend([index] * len(pieces))
        return sentences, owner

    def _decode(self, generator, lines, batch_size: int, split: bool, progress,
                keep_numbers: bool = True):  # fmt: skip
        single = isinstance(lines, str)
        lines = [lines] if single else lines
        if not isinstance(lines, (list, tuple)) or not all(isinstance(x, str) for x in lines):
            raise SpecNmtError("lines must be a string or a list of strings")
        sentences, owner = self._sentences(lines, split)
        remaining = [0] * len(lines)
        for index in owner:
            remaining[index] += 1
        # characters the model cannot read: out of what it reads, back into its translation;
        # a sentence of nothing else is copied (symbols.py)
        readable, runs = zip(*map(self.foreign.split, sentences)) if sentences else ((), ())
        translations: List[str] = [""] * len(sentences)
        statistics = [dict(_NOT_DECODED) for _ in sentences]
        decoded = []
        for i, sentence in enumerate(sentences):
            if nothing_to_translate(readable[i], runs[i]):
                translations[i] = sentence
                remaining[owner[i]] -= 1
            else:
                decoded.append(i)
        if progress is not None and remaining.count(0):
            progress(remaining.count(0))  # blank and copied lines are done already
        numbers = self.number_repair(generator.settings) if keep_numbers else None
        with torch.inference_mode():
            sources = self.encode([readable[i] for i in decoded])
            warn_of_long_sentences(sources, MAX_PIECES)  # (the recipes' length filter)
            batches = list(self.batches(sources, batch_size))
            generator.look_ahead([sample for _, sample in batches])
            for positions, sample in batches:
                done = 0
                for position, hypos in zip(positions, generator.generate([self.verifier], sample)):
                    i, best = decoded[position], hypos[0]
                    translations[i] = self.decode(best["tokens"].cpu())
                    if numbers is not None:  # (before progress: a repair may decode again)
                        translations[i] = numbers(readable[i], translations[i])
                    translations[i] = ForeignCharacters.restore(translations[i], runs[i])
                    statistics[i] = {
                        "iterations": best.get("spec_iterations", 0),
                        "accepted_tokens": best.get("spec_accepted_tokens", 0),
                        "output_tokens": int(best["tokens"].numel()),
                        "score": float(best["score"]),
                    }
                    remaining[owner[i]] -= 1
                    done += remaining[owner[i]] == 0
                # after every batch, even one that finished no line (the sentences of a long
                # line): a progress bar then moves while such a line is decoded
                if progress is not None:
                    progress(done)
        outputs = [[] for _ in lines]
        score_sums = [0.0] * len(lines)
        self.statistics = [
            {"sentences": 0, "decoded": 0, "iterations": 0, "accepted_tokens": 0,
             "output_tokens": 0, "score": None}  # fmt: skip
            for _ in lines
        ]
        for i, index in enumerate(owner):
            outputs[index].append(translations[i])
            line_statistics = self.statistics[index]
            line_statistics["sentences"] += 1
            if statistics[i]["score"] is not None:  # (not a copied sentence)
                score_sums[index] += statistics[i]["score"]
                line_statistics["decoded"] += 1
            for key in ("iterations", "accepted_tokens", "output_tokens"):
                line_statistics[key] += statistics[i][key]
        for line_statistics, score_sum in zip(self.statistics, score_sums):
            # a line's score is its decoded sentences' mean score (the verifier's log-prob per
            # output token, EOS included, in nats, with the default lenpen 1); None when blank
            # or copied
            if line_statistics["decoded"]:
                line_statistics["score"] = score_sum / line_statistics["decoded"]
        self.decoding_stats = generator.stats
        outputs = [join_sentences(pieces) for pieces in outputs]
        return outputs[0] if single else outputs


# a sentence's statistics when it is not decoded (copied: symbols.py)
_NOT_DECODED = {"iterations": 0, "accepted_tokens": 0, "output_tokens": 0, "score": None}


def _load_verifier(path: Path, task: SpecTranslationTask):
    state = checkpoint_utils.load_checkpoint_to_cpu(str(path))
    (verifier,), _ = checkpoint_utils.load_model_ensemble([str(path)], task=task, state=state)
    BlockScorer(verifier, role=str(path))  # refuses what cannot verify, naming the file
    return verifier


def _pieces(dictionary) -> List[str]:
    """The dictionary's entries that are text pieces: not its special symbols, [MASK] or
    fairseq's padding words."""
    return [w for w in dictionary.symbols[dictionary.nspecial :]
            if w != MASK_SYMBOL and not w.startswith("madeupword")]  # fmt: skip


def _load_sentencepiece(path: Path, dictionary, dictionary_path: Path):
    """The sentencepiece model, refused when the dictionary was not built from its pieces (most
    input would become <unk>)."""
    try:
        model = sentencepiece.SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError) as error:
        raise SpecNmtError(f"{path} is not a readable sentencepiece model ({error})") from error
    pieces = {model.id_to_piece(i) for i in range(model.get_piece_size())}
    words = _pieces(dictionary)
    known = sum(word in pieces for word in words)
    if known < 0.9 * len(words):
        raise SpecNmtError(
            f"{path} does not match {dictionary_path}: only {known} of {len(words)} dictionary "
            "entries are pieces of this sentencepiece model; put the spm.model the training data "
            "were encoded with into the model directory"
        )
    return model


def _to_device(sample: Dict, device: torch.device) -> Dict:
    """Every tensor of the sample on ``device``, as fairseq-generate moves it: fairseq's
    SequenceGenerator indexes the sample's ids with device tensors."""
    return utils.apply_to_sample(lambda tensor: tensor.to(device), sample)
