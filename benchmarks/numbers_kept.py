"""How often a translation keeps the source's numbers: the share of number-bearing source lines
whose numbers all reappear in their translation (spec_nmt/number_repair.py: the source read the
German way, the output the English way, so German "4,20" is kept by "4.20" and "1.234.567" by
"1,234,567" or "1234567", but "1.500" is not kept by "1.500" nor "$4.20" by "$420"); also the
looser count, the same digits with separators removed.

    OMP_NUM_THREADS=1 python benchmarks/numbers_kept.py data/models/bench-de-en \
        --src $D/valid.de --json benchmarks/results/numbers-newstest2013.json
    python benchmarks/numbers_kept.py --src $D/valid.de --hyp out.en   # a file, no decoding

It translates as spec-nmt-translate does (SpecTranslator.translate, lossless defaults, sentences
split) with number repair on, or off with --no-number-repair, and writes the figure, the lines
that lose a number, the CPU model and the commit as JSON.
"""

import argparse
import inspect
import json
import platform
import re
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from common import commit, cpu_model, read_lines

from spec_nmt.number_repair import missing_numbers, numbers_in
from spec_nmt.translator import SpecTranslator


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", nargs="?", help="model directory (not with --hyp)")
    parser.add_argument("--src", required=True, help="German source, one line per line")
    parser.add_argument("--hyp", help="score these translations instead of decoding")
    parser.add_argument("--lines", type=int, default=None, help="only the first N lines")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--no-number-repair", action="store_true",
                        help="keep_numbers=False: the model's output as it is")  # fmt: skip
    parser.add_argument("--output", help="write the translations here")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    if bool(args.hyp) == bool(args.model_dir):
        parser.error("give a model directory to decode, or --hyp to score a file")
    return args


def measure(sources, outputs):
    """Lines with a number, lines that keep them all, and each line that loses one."""
    assert len(sources) == len(outputs), (len(sources), len(outputs))
    bearing = [i for i, source in enumerate(sources) if numbers_in(source)]
    failing = []
    for i in bearing:
        missing = missing_numbers(sources[i], outputs[i])
        if missing:
            failing.append({"line": i + 1, "source": sources[i], "output": outputs[i],
                            "missing": missing})  # fmt: skip
    kept = len(bearing) - len(failing)
    # the looser comparison: the same digits, whatever the separators ("$420" keeps "$4.20")
    same_digits = sum(not _digits_missing(sources[i], outputs[i]) for i in bearing)
    return {
        "lines": len(sources),
        "number_bearing_lines": len(bearing),
        "lines_keeping_every_number": kept,
        "share_keeping_every_number": round(kept / max(len(bearing), 1), 4),
        "lines_keeping_every_number_s_digits": same_digits,
        "failing": failing,
    }


def _digits_missing(source: str, output: str) -> bool:
    """Whether a source number's digits (separators removed) are not among the output's."""
    available = Counter(re.sub(r"\D", "", n) for n in numbers_in(output))
    available.subtract(re.sub(r"\D", "", n) for n in numbers_in(source))
    return any(count < 0 for count in available.values())


def translate(args, sources):
    translator = SpecTranslator.from_pretrained(args.model_dir, device="cpu")
    has_repair = "keep_numbers" in inspect.signature(translator.translate).parameters
    options = {"keep_numbers": False} if args.no_number_repair else {}
    start = time.perf_counter()
    outputs = translator.translate(sources, batch_size=args.batch_size, **options)
    seconds = time.perf_counter() - start
    repair = "off" if args.no_number_repair else "on" if has_repair else "absent (before the fix)"
    return outputs, {"number_repair": repair, "decoding_seconds": round(seconds, 1),
                     "batch_size": args.batch_size, "torch_threads": torch.get_num_threads()}


def main(argv=None):
    args = parse_args(argv)
    sources = read_lines(args.src, args.lines)
    if args.hyp:
        outputs, run = read_lines(args.hyp, args.lines), {"hyp": args.hyp}
    else:
        outputs, run = translate(args, sources)
    if args.output:
        Path(args.output).write_text("".join(line + "\n" for line in outputs), encoding="utf-8")
    result = measure(sources, outputs)
    result["run"] = {
        **run, "src": args.src, "model_dir": args.model_dir, "cpu": cpu_model(),
        "commit": commit(), "torch": torch.__version__, "python": platform.python_version(),
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
    }  # fmt: skip
    print(f"{result['lines_keeping_every_number']} of {result['number_bearing_lines']} "
          f"number-bearing lines keep every number ({result['share_keeping_every_number']:.2%}); "
          f"{len(result['failing'])} lose one")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n",
                                   encoding="utf-8")  # fmt: skip


if __name__ == "__main__":
    main()
