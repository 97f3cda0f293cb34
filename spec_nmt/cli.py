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
import logging
import typing
from dataclasses import fields

# Nothing here imports torch or fairseq (seconds): --help and argument errors answer at once, and
# the models load only in spec_nmt.cli_session, once the arguments are checked.
from spec_nmt import options
from spec_nmt.errors import SpecNmtError
from spec_nmt.runtime import DEFAULT_THREADS, THREADS_HELP, check_threads
from spec_nmt.settings import (
    DECODING_LOOPS,
    FLAGS,
    RULE_SETTINGS,
    SAMPLING_SETTINGS,
    VERIFY_RULES,
    DecodingSettings,
    check_sampling_settings_used,
    flag_help,
)

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
        "--drafter", choices=options.DRAFTER_CHOICES, default=options.DEFAULT_DRAFTER,
        help=options.DRAFTER_HELP + " (default: %(default)s)",
    )  # fmt: skip
    add_setting_flags(parser)
    parser.add_argument(
        "--batch-size", type=int, default=options.DEFAULT_BATCH_SIZE,
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
    parser.add_argument("--drafter-precision", choices=options.DRAFTER_PRECISION_NAMES,
                        default=options.DEFAULT_DRAFTER_PRECISION,
                        help=options.DRAFTER_PRECISION_HELP + " (default: %(default)s)")
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


def main(argv=None):
    # fairseq configures the root logger at DEBUG when imported; a translator wants warnings only.
    logging.getLogger().setLevel(logging.WARNING)
    args = parse_args(argv)
    from spec_nmt.cli_session import one_line_warnings, run  # (torch and fairseq load here)

    with one_line_warnings():
        run(args)


if __name__ == "__main__":
    main()
