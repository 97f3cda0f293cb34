"""``spec-nmt-translate``: German text in, English text out, with a model directory.

    spec-nmt-translate data/models/bench-de-en --input news.de > news.en
    echo "Der Hund schläft. Es regnet." | spec-nmt-translate data/models/bench-de-en

One output line per input line, in input order. Lines may hold several sentences (split, translated
and joined again; --no-split-sentences turns that off). Input is read in buffers of
--buffer-size lines; inside a buffer the sentences are sorted by length and decoded in batches of
--batch-size, and the buffer's translations are written as soon as it is done. A progress bar
(stderr) is shown for inputs of more than a few hundred lines, and the throughput is printed at
the end. At a terminal each typed line is translated at once.
"""

import argparse
import itertools
import logging
import os
import sys
import time
from typing import Iterator, List, TextIO

from tqdm import tqdm

from spec_nmt.settings import DEFAULTS
from spec_nmt.errors import SpecNmtError
from spec_nmt.loading import DEFAULT_DRAFTER_PRECISION, DRAFTER_PRECISION_NAMES
from spec_nmt.text import tolerant_stdin
from spec_nmt.translator import DEFAULT_BATCH_SIZE, SpecTranslator

PROGRESS_MIN_LINES = 300


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
        "--drafter-path", default=None, help="drafter checkpoint instead of MODEL_DIR/drafter.pt"
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help=f"k: drafted tokens per iteration; 0: no drafts, the verifier alone on the same "
        f"loop (default {DEFAULTS.block_size})",
    )
    parser.add_argument(
        "--beta",
        type=int,
        default=None,
        help="top-beta rule: accept drafts among the verifier's beta best "
        f"(default {DEFAULTS.beta})",
    )
    parser.add_argument(
        "--tau",
        type=float,
        default=None,
        help="top-beta rule: accept drafts within tau of the best log-prob "
        f"(default {DEFAULTS.tau:g})",
    )
    parser.add_argument(
        "--max-draft-batch",
        type=int,
        default=None,
        help="the most sentences a batch may have and still draft; larger batches decode with "
        "the verifier alone (0: draft in every batch; default: 1 for the lossless rule, no "
        "limit for a relaxed --beta/--tau)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help="sentences per batch"
    )
    parser.add_argument(
        "--buffer-size",
        type=int,
        default=1000,
        help="lines read before decoding; sentences are sorted by length inside a buffer",
    )
    parser.add_argument(
        "--no-split-sentences",
        action="store_true",
        help="translate each line as one sentence (as fairseq-interactive does)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="no progress bar and no throughput line"
    )
    parser.add_argument(
        "--cpu", action="store_true", help="decode on the CPU even if CUDA is available"
    )
    parser.add_argument(
        "--drafter-precision",
        choices=DRAFTER_PRECISION_NAMES,
        default=DEFAULT_DRAFTER_PRECISION,
        help="the drafter's feed-forward and output layers in int8 (CPU only: cheaper drafts, "
        "same guarantees, but top-beta/tau output may depend on the batch) or fp32; auto: int8 "
        "on the CPU (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    if args.buffer_size < 1:
        raise SpecNmtError(f"--buffer-size must be >= 1, got {args.buffer_size}")
    return args


def open_input(path: str) -> TextIO:
    """The input as text lines: invalid UTF-8 becomes U+FFFD and only a newline ends a line, so
    N lines in always means N lines out."""
    if path == "-":
        tolerant_stdin()
        return sys.stdin
    try:
        return open(path, encoding="utf-8", errors="replace", newline="\n")
    except OSError as error:
        raise SpecNmtError(f"--input {path}: {error.strerror}") from error


def buffers(stream: TextIO, size: int) -> Iterator[List[str]]:
    """Lists of at most ``size`` lines (without their newlines), as they are read."""
    while True:
        buffer = [line.rstrip("\n") for line in itertools.islice(stream, size)]
        if not buffer:
            return
        yield buffer


def counted(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def translate_stream(translator, stream: TextIO, args) -> None:
    """Translate buffer by buffer, writing each buffer's lines as soon as they are done."""
    chunks = buffers(stream, args.buffer_size)
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
    show = not args.quiet and (total is None or total > PROGRESS_MIN_LINES)
    lines = sentences = output_tokens = 0
    start = time.perf_counter()
    with tqdm(total=total, unit="line", disable=not show, file=sys.stderr,
              dynamic_ncols=True) as bar:  # fmt: skip
        for buffer in itertools.chain([first], chunks):
            translations = translator.translate(
                buffer,
                batch_size=args.batch_size,
                split_sentences=not args.no_split_sentences,
                progress=bar.update,
            )
            sys.stdout.write("".join(t + "\n" for t in translations))
            sys.stdout.flush()
            lines += len(buffer)
            sentences += sum(s["sentences"] for s in translator.statistics)
            output_tokens += sum(s["output_tokens"] for s in translator.statistics)
    seconds = max(time.perf_counter() - start, 1e-9)
    if not args.quiet:
        print(
            f"spec-nmt-translate: {counted(lines, 'line')}, {counted(sentences, 'sentence')}, "
            f"{output_tokens} target tokens in {seconds:.1f} s: {sentences / seconds:.1f} "
            f"sentences/s, {output_tokens / seconds:.0f} tokens/s",
            file=sys.stderr,
        )


def main(argv=None):
    # fairseq configures the root logger at DEBUG when imported; a translator wants warnings only.
    logging.getLogger().setLevel(logging.WARNING)
    args = parse_args(argv)
    settings = {
        name: getattr(args, name)
        for name in ("block_size", "beta", "tau", "max_draft_batch")
        if getattr(args, name) is not None
    }
    translator = SpecTranslator.from_pretrained(
        args.model_dir,
        drafter_path=args.drafter_path,
        device="cpu" if args.cpu else None,
        drafter_precision=args.drafter_precision,
        **settings,
    )
    stream = open_input(args.input)
    try:
        if stream is sys.stdin and stream.isatty():
            split = not args.no_split_sentences
            for line in stream:  # typed at a terminal: each line at once
                print(translator.translate(line.rstrip("\n"), split_sentences=split), flush=True)
        else:
            translate_stream(translator, stream, args)
    except BrokenPipeError:  # the reader stopped early (| head): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    finally:
        if stream is not sys.stdin:
            stream.close()


if __name__ == "__main__":
    main()
