"""One run of spec-nmt-translate once its arguments are checked (spec_nmt/cli.py): the models
load, the input is translated buffer by buffer (or line by line at a terminal), and the run's
throughput and, with --stats, what drafting did are reported on stderr.
"""

import contextlib
import itertools
import logging
import os
import secrets
import sys
import time
from dataclasses import dataclass, field, fields
from typing import Callable, List, TextIO

import spec_nmt.plugin  # noqa: F401  isort: skip  (first: fairseq without its INFO hints)
import torch
from tqdm import tqdm

from spec_nmt.cli import given_settings
from spec_nmt.decoding.drafter import drafter_for_rule, drafts_continuations
from spec_nmt.decoding.loop import DecodingStats
from spec_nmt.input_text import buffers, decoded_lines, input_name, open_input
from spec_nmt.settings import DEFAULTS, samples
from spec_nmt.translator import SpecTranslator

# The progress bar shows once decoding has run this long (seconds): quick runs stay quiet, and
# any longer one, a few lines or one long line, shows that it works.
PROGRESS_DELAY_S = 1.0


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
