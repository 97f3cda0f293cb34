"""spec-nmt-translate: German text in, English text out, with a model directory.

    spec-nmt-translate data/models/bench-de-en --input news.de > news.en
    echo "Der Hund schläft. Es regnet." | spec-nmt-translate data/models/bench-de-en

One output line per input line, in input order. Lines may hold several sentences (split, translated
and joined again; --no-split-sentences turns that off). Input is read in buffers of
--buffer-size lines; inside a buffer the sentences are sorted by length and decoded in batches of
--batch-size, and the buffer's translations are written as soon as it is done. A progress bar
(stderr) appears once decoding has taken a second, and the throughput of the decoding is printed
at the end (--stats: also whether drafting ran and how much it earned). At a terminal each typed
line is translated as soon as it is typed (Ctrl-D ends). Input that is not text (NUL bytes, or
mostly bytes that are not UTF-8: a binary or compressed file) is refused. Input is UTF-8; input
that is not, but reads as Latin-1 (Windows-1252), is read so with a warning (--encoding says
which it is); a line with bytes its encoding cannot read is named in a warning.

A sentence whose translation lost one of its numbers is repaired (--no-number-repair: not).

--verify sampling or rsd samples translations (--temperature, --sampling-topk, --sampling-topp),
from a fresh seed each run, printed on stderr, unless --seed gives one.
"""

import argparse
import codecs
import contextlib
import itertools
import logging
import os
import sys
import secrets
import time
import typing
from dataclasses import dataclass, field, fields
from typing import Callable, List, TextIO

import torch
from tqdm import tqdm

from spec_nmt import loading
from spec_nmt.decoding.drafter import drafter_for_rule, drafts_continuations
from spec_nmt.decoding.loop import DecodingStats
from spec_nmt.errors import SpecNmtError
from spec_nmt.input_text import buffers, decoded_lines, input_name, open_input
from spec_nmt.runtime import DEFAULT_THREADS, THREADS_HELP, check_threads
from spec_nmt.settings import (
    DECODING_LOOPS,
    DEFAULTS,
    FLAGS,
    RULE_SETTINGS,
    SAMPLING_SETTINGS,
    VERIFY_RULES,
    DecodingSettings,
    check_sampling_settings_used,
    flag_help,
    samples,
)
from spec_nmt.translator import DEFAULT_BATCH_SIZE, SpecTranslator

# The progress bar shows once decoding has run this long (seconds): quick runs stay quiet, and
# any longer one, a few lines or one long line, shows that it works.
PROGRESS_DELAY_S = 1.0
DEFAULT_BUFFER_SIZE = 1000
# The decoding settings spec-nmt-translate takes as flags, with DecodingSettings' help texts.
SETTING_FLAGS = RULE_SETTINGS + SAMPLING_SETTINGS


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="spec-nmt-translate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model_dir", help="verifier.pt, drafter.pt, dict.*.txt, spm.model")
    parser.add_argument(
        "--input", default="-", help="text file to translate (default: standard input)"
    )
    parser.add_argument(
        "--encoding", default=None,
        help="the input's encoding, e.g. latin-1 (default: UTF-8, or Windows-1252 with a "
        "warning when the input is not UTF-8 but reads as Latin-1)",
    )  # fmt: skip
    parser.add_argument(
        "--drafter-path", default=None,
        help="drafter checkpoint instead of the model directory's (MODEL_DIR/drafter.DEVICE.pt "
        "where it holds one for the device, e.g. drafter.cuda.pt, else MODEL_DIR/drafter.pt)"
    )
    parser.add_argument(
        "--drafter", choices=loading.DRAFTER_CHOICES, default=loading.DEFAULT_DRAFTER,
        help=loading.DRAFTER_HELP + " (default: %(default)s)",
    )  # fmt: skip
    add_setting_flags(parser)
    parser.add_argument(
        "--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
        help="sentences per batch (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--buffer-size", type=int, default=DEFAULT_BUFFER_SIZE,
        help="lines read before decoding; sentences are sorted by length inside a buffer "
        "(default: %(default)s)")  # fmt: skip
    parser.add_argument("--no-split-sentences", action="store_true",
                        help="translate each line as one sentence (as fairseq-interactive does)")
    parser.add_argument(
        "--no-number-repair",
        action="store_true",
        help="print the model's translations as they are. By default a sentence whose "
        "translation lost one of its source's numbers gets it back: the lost number replaces "
        "a wrong one, or the sentence is decoded again by the verifier with its numbers as "
        "constraints (beam search). Lossless output (the verifier's greedy translation) and "
        "exact samples are what the model gives before that repair",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="no progress bar and no throughput line"
    )
    parser.add_argument(
        "--stats",
        action="store_true",
        help="at the end, on stderr: whether drafting ran (and if not, why), accepted drafts "
        "per iteration, sentences/s and tokens/s, and the mean score (the verifier's "
        "log-probability per output token, EOS included, in nats)",
    )
    parser.add_argument(
        "--cpu", action="store_true", help="decode on the CPU even if CUDA is available"
    )
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                        help=THREADS_HELP + " (default: %(default)s)")
    parser.add_argument("--drafter-precision", choices=loading.DRAFTER_PRECISION_NAMES,
                        default=loading.DEFAULT_DRAFTER_PRECISION,
                        help=loading.DRAFTER_PRECISION_HELP + " (default: %(default)s)")
    return checked(parser.parse_args(argv))


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """The decoding settings' flags, with their help from DecodingSettings; each defaults to
    None, so that what the user gave is known (``given_settings``)."""
    for name in SETTING_FLAGS:
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=setting_type(name),
            choices={"verify": list(VERIFY_RULES), "decoding_loop": list(DECODING_LOOPS)}.get(name),
            default=None,
            help=flag_help(name, with_default=name != "seed") + (
                "; default: a fresh seed each run, printed on stderr, so runs differ"
                if name == "seed" else ""),  # fmt: skip
        )


def checked(args: argparse.Namespace) -> argparse.Namespace:
    """The parsed arguments, refused in one line where a value cannot work (before the models
    load), with --encoding's name made canonical."""
    if args.buffer_size < 1:
        raise SpecNmtError(f"--buffer-size must be >= 1, got {args.buffer_size}")
    check_threads(args.threads, "--threads")
    if args.encoding is not None:
        try:
            args.encoding = codecs.lookup(args.encoding).name
        except LookupError:
            raise SpecNmtError(f"--encoding {args.encoding}: no such encoding (e.g. utf-8, "
                               "latin-1, cp1252)") from None  # fmt: skip
    # the settings' own checks, worded for the command line, before the models load
    settings = DecodingSettings(**given_settings(args))
    check_sampling_settings_used(settings.verify, given_settings(args), FLAGS)
    return args


def setting_type(name: str) -> type:
    """The type of a decoding setting, as its flag parses it (Optional[int] is int)."""
    kind = next(setting.type for setting in fields(DecodingSettings) if setting.name == name)
    return typing.get_args(kind)[0] if typing.get_origin(kind) is typing.Union else kind


def given_settings(args) -> dict:
    """The decoding settings given as flags."""
    return {name: getattr(args, name) for name in SETTING_FLAGS if getattr(args, name) is not None}


def counted(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


@dataclass
class Totals:
    """What one run decoded, added up over its calls of the translator."""

    lines: int = 0
    sentences: int = 0
    output_tokens: int = 0
    decoded: int = 0  # sentences decoded (not copied: spec_nmt/symbols.py)
    score_sum: float = 0.0  # of the decoded sentences' scores
    decoding: DecodingStats = field(default_factory=DecodingStats)
    # spent decoding: not reading (a user typing at a terminal), writing or loading
    seconds: float = 0.0

    @contextlib.contextmanager
    def timed(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start

    def add(self, translator: SpecTranslator, lines: int) -> None:
        self.lines += lines
        for line in translator.statistics:
            self.sentences += line["sentences"]
            self.output_tokens += line["output_tokens"]
            self.decoded += line["decoded"]
            if line["decoded"]:  # (a line's score is the mean of its decoded sentences')
                self.score_sum += line["score"] * line["decoded"]
        for name in (f.name for f in fields(DecodingStats)):
            total = getattr(self.decoding, name) + getattr(translator.decoding_stats, name)
            setattr(self.decoding, name, total)


def decoder(translator: SpecTranslator) -> Callable[..., List[str]]:
    """The translator's call for its rule: sample() for the sampling rules."""
    if samples(translator.settings.verify):
        return translator.sample
    return translator.translate


def translate_stream(translator, stream: TextIO, args, totals: Totals) -> None:
    """Translate buffer by buffer, writing each buffer's lines as soon as they are done."""
    chunks = buffers(decoded_lines(stream, input_name(args.input)), args.buffer_size)
    first = next(chunks, [])
    # A first buffer that is not full is the whole input; a file's lines can be counted; piped
    # input longer than a buffer has no known length.
    if len(first) < args.buffer_size:
        total = len(first)
    elif stream is not sys.stdin:
        with open(stream.name, "rb") as handle:
            total = sum(1 for _ in handle)
    else:
        total = None
    decode = decoder(translator)
    with tqdm(total=total, unit="line", disable=args.quiet, file=sys.stderr,
              dynamic_ncols=True, delay=PROGRESS_DELAY_S) as bar:  # fmt: skip
        for buffer in itertools.chain([first], chunks):
            with totals.timed():
                translations = decode(
                    buffer,
                    batch_size=args.batch_size,
                    split_sentences=not args.no_split_sentences,
                    progress=bar.update,
                    keep_numbers=not args.no_number_repair,
                )
            sys.stdout.write("".join(t + "\n" for t in translations))
            sys.stdout.flush()
            totals.add(translator, len(buffer))


def translate_typed_lines(translator, args, totals: Totals) -> None:
    """At a terminal: each line as soon as it is typed."""
    if not args.quiet:
        print("spec-nmt-translate: type German text, one line at a time; Ctrl-D ends",
              file=sys.stderr, flush=True)  # fmt: skip
    decode = decoder(translator)
    for line in decoded_lines(sys.stdin, "stdin"):
        with totals.timed():
            translation = decode(line, split_sentences=not args.no_split_sentences,
                                 keep_numbers=not args.no_number_repair)  # fmt: skip
        print(translation, flush=True)
        totals.add(translator, 1)


def drafting_report(settings, stats: DecodingStats, drafter) -> str:
    """Whether the run drafted with ``drafter``, and if not, why."""
    if settings.block_size == 0:
        return "drafting off: --block-size 0 decodes with the verifier alone"
    limit = settings.draft_batch_limit(drafter)
    if stats.batches_without_drafts and not stats.drafted_tokens:
        return (
            f"drafting off: every batch had more than {counted(limit, 'sentence')} "
            f"(--max-draft-batch {limit}); --batch-size {limit} or --max-draft-batch 0 drafts"
        )
    if stats.batches_without_drafts:
        return (
            f"drafting in part: {counted(stats.batches_without_drafts, 'batch')} of more than "
            f"{counted(limit, 'sentence')} (--max-draft-batch {limit}) decoded without drafts"
        )
    if drafts_continuations(drafter):
        return f"drafting on: --verify {settings.verify}, whole continuations (--drafter twin)"
    return f"drafting on: --verify {settings.verify}, --block-size {settings.block_size}"


def report(translator, totals: Totals, args) -> None:
    """The throughput of the decoding, and with --stats what drafting did (stderr)."""
    seconds = max(totals.seconds, 1e-9)
    speed = (
        f"{totals.sentences / seconds:.1f} sentences/s, {totals.output_tokens / seconds:.0f} "
        "tokens/s"
    )
    if not args.quiet:
        print(
            f"spec-nmt-translate: {counted(totals.lines, 'line')}, "
            f"{counted(totals.sentences, 'sentence')}, {totals.output_tokens} target tokens in "
            f"{seconds:.1f} s of decoding: {speed}",
            file=sys.stderr,
        )
    if not args.stats:
        return
    stats = totals.decoding
    drafter = drafter_for_rule(translator.drafter, translator.settings)
    lines = [
        drafting_report(translator.settings, stats, drafter),
        f"{stats.mean_accepted_per_iteration:.2f} accepted drafts per iteration "
        f"({stats.accepted_tokens} of {stats.drafted_tokens} drafted tokens accepted in "
        f"{stats.iterations} iterations)",
        f"drafter: {drafter_used(translator, drafter, stats)}",
        f"{speed}, {counted(torch.get_num_threads(), 'CPU thread')}",
        f"mean score {totals.score_sum / max(totals.decoded, 1):.3f} (the verifier's "
        "log-probability per output token, EOS included, in nats)",
    ]
    for line in lines:
        print(f"spec-nmt-translate stats: {line}", file=sys.stderr)


def drafter_used(translator, drafter, stats: DecodingStats) -> str:
    """What drafted for the translator's rule (``drafter``): the twin, the drafter file (with
    its precision), or that nothing drafted."""
    if not stats.drafted_tokens:
        return f"{translator.drafter_path or 'none'} (no drafts)"
    if getattr(drafter, "description", None):
        return drafter.description
    if drafter.precision == "none":
        return "none (the verifier alone)"
    return f"{translator.drafter_path} ({drafter.precision})"


@contextlib.contextmanager
def one_line_warnings():
    """spec_nmt's warnings (a line cut to the models' length ...) as this command's other lines
    read, one line each, instead of in the format of whatever configured logging first."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("spec-nmt-translate warning: %(message)s"))
    handler.setLevel(logging.WARNING)
    package = logging.getLogger("spec_nmt")
    package.addHandler(handler)
    package.propagate = False
    try:
        yield
    finally:
        package.removeHandler(handler)
        package.propagate = True


def main(argv=None):
    # fairseq configures the root logger at DEBUG when imported; a translator wants warnings only.
    logging.getLogger().setLevel(logging.WARNING)
    args = parse_args(argv)
    with one_line_warnings():
        run(args)


def run(args) -> None:
    settings = given_settings(args)
    if samples(settings.get("verify", DEFAULTS.verify)) and args.seed is None:
        # one seed for the whole run, so that --seed gives its samples again
        settings["seed"] = secrets.randbits(63)
        if args.stats or not args.quiet:
            print(f"spec-nmt-translate: sampling with seed {settings['seed']}, drawn for this "
                  f"run (--seed {settings['seed']} samples the same again)", file=sys.stderr)
    # (before the models load: a wrong input fails at once)
    stream = open_input(args.input, args.encoding)
    translator = SpecTranslator.from_pretrained(
        args.model_dir,
        drafter_path=args.drafter_path,
        drafter=args.drafter,
        device="cpu" if args.cpu else None,
        drafter_precision=args.drafter_precision,
        threads=args.threads,
        **settings,
    )
    totals = Totals()
    try:
        if stream is sys.stdin and stream.isatty():
            translate_typed_lines(translator, args, totals)
        else:
            translate_stream(translator, stream, args, totals)
    except BrokenPipeError:  # the reader stopped early (| head): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    finally:
        if stream is not sys.stdin:
            stream.close()
    report(translator, totals, args)


if __name__ == "__main__":
    main()
