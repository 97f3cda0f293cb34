#!/usr/bin/env python3
"""Score a raw test set with a model directory, through the plugin and through stock fairseq.

    python scripts/bleu.py --src test.de --ref test.en [--model-dir data/models/bench-de-en]
    make bleu SRC=test.de REF=test.en [MODEL_DIR=...]

The source is encoded with the directory's spm.model and binarized with its dictionaries
(fairseq-preprocess --srcdict/--tgtdict), then translated twice by fairseq-generate: with the
plugin (--user-dir spec_nmt --task spec_translation --drafter-path MODEL_DIR/drafter.pt, the
lossless defaults) and stock (--beam 1). fairseq detokenizes both (--bpe sentencepiece), and
sacreBLEU scores them against the raw references. The lossless output is the verifier's greedy
output, so both scores must agree: the script exits with 1 where they do not.

Without --src/--ref it scores newstest2014, which `sacrebleu -t wmt14/full` downloads. Nothing
is kept unless --work-dir names a directory: then it holds the encoded text (spm/), the data-bin
(bin/, for fairseq-generate commands of your own) and each run's output and log. fairseq's own
BLEU line and its warning that BLEU "is computed on BPE tokens" stay in those logs: the warning
is stock fairseq's, about its own score, not about sacreBLEU's on detokenized text printed here.
"""

import argparse
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # (the checkout's spec_nmt, as --user-dir decodes with it)

from spec_nmt.data_prep import encode_file, run_fairseq_preprocess  # noqa: E402
from spec_nmt.runtime import DEFAULT_THREADS  # noqa: E402
from spec_nmt.settings import DEFAULTS  # noqa: E402

# newstest2014 as sacreBLEU names it; --echo src or ref is appended
FETCH = [sys.executable, "-m", "sacrebleu", "-t", "wmt14/full", "-l", "de-en", "--echo"]
MODEL_FILES = ("verifier.pt", "drafter.pt", "dict.de.txt", "dict.en.txt", "spm.model")


class Refused(Exception):
    """A one-line reason to stop, printed as ``bleu: ...``."""


def raw_test_set(src, ref, work: Path):
    """The source and reference files: those given, else newstest2014 fetched by sacreBLEU."""
    if src and ref:
        return Path(src), Path(ref)
    if src or ref:
        raise Refused("give both --src and --ref (make bleu SRC=test.de REF=test.en), or neither")
    paths = []
    for side in ("src", "ref"):
        fetched = subprocess.run(FETCH + [side], capture_output=True, text=True)
        if fetched.returncode != 0 or not fetched.stdout.strip():
            raise Refused("could not fetch newstest2014 (`sacrebleu -t wmt14/full`, online): "
                          "give a test set instead, make bleu SRC=test.de REF=test.en")  # fmt: skip
        paths.append(work / f"newstest2014.{side}")
        paths[-1].write_text(fetched.stdout, encoding="utf-8")
    return tuple(paths)


def binarize(model_dir: Path, src: Path, ref: Path, work: Path, log) -> Path:
    """``src`` and ``ref`` in the model's pieces and dictionaries, as the data-bin work/bin."""
    import sentencepiece

    pieces = sentencepiece.SentencePieceProcessor(model_file=str(model_dir / "spm.model"))
    (work / "spm").mkdir(exist_ok=True)
    for path, language in ((src, "de"), (ref, "en")):
        encode_file(pieces, path, work / "spm" / f"test.{language}")
    run_fairseq_preprocess("de", "en", work / "bin", testpref=work / "spm" / "test",
                           srcdict=model_dir / "dict.de.txt", workers=1,
                           tgtdict=model_dir / "dict.en.txt", output=log)  # fmt: skip
    return work / "bin"


def translations(data_bin: Path, model_dir: Path, name: str, flags, work: Path, args):
    """fairseq-generate's detokenized translations of the test set, in input order."""
    command = [sys.executable, "-m", "fairseq_cli.generate", str(data_bin),
               "--path", str(model_dir / "verifier.pt"), "--source-lang", "de",
               "--target-lang", "en", "--gen-subset", "test", "--batch-size", str(args.batch_size),
               "--required-batch-size-multiple", "1", "--bpe", "sentencepiece",
               "--sentencepiece-model", str(model_dir / "spm.model"),
               *DEFAULTS.fairseq_flags(["max_len_a", "max_len_b"]), *flags,
               *(["--cpu"] if args.cpu else [])]  # fmt: skip
    # (both runs on the plugin's default thread count: torch's own collapses on a busy machine)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(DEFAULT_THREADS)))
    output = work / f"generate-{name}.txt"
    with open(output, "w") as out, open(work / f"generate-{name}.log", "w") as log:
        result = subprocess.run(command, stdout=out, stderr=log, env=env)
    if result.returncode != 0:
        where = f"see {log.name}" if args.work_dir else "--work-dir DIR keeps its log"
        raise Refused(f"fairseq-generate ({name}) failed; {where}")
    by_id = {}
    for line in output.read_text(encoding="utf-8").splitlines():
        if line.startswith("D-"):
            number, _, text = line[2:].split("\t", 2)
            by_id[int(number)] = text
    return [by_id.get(i, "") for i in range(max(by_id, default=-1) + 1)]


def score(hypotheses, references) -> str:
    """sacreBLEU's score line and signature."""
    from sacrebleu.metrics import BLEU

    bleu = BLEU()
    return f"{bleu.corpus_score(hypotheses, [references])} | {bleu.get_signature()}"


def compared(model_dir: Path, src: Path, ref: Path, work: Path, args) -> int:
    references = ref.read_text(encoding="utf-8").splitlines()
    lines = len(src.read_text(encoding="utf-8").splitlines())
    if lines != len(references):
        raise Refused(f"{src} has {lines} lines but {ref} {len(references)}")
    with open(work / "preprocess.log", "w") as log:
        data_bin = binarize(model_dir, src, ref, work, log)
    runs = {
        "plugin": ["--user-dir", str(REPO / "spec_nmt"), "--task", "spec_translation",
                   "--drafter-path", str(model_dir / "drafter.pt")],
        "stock": ["--beam", "1"],
    }  # fmt: skip
    outputs, scores = {}, {}
    for name, flags in runs.items():
        outputs[name] = translations(data_bin, model_dir, name, flags, work, args)
        if len(outputs[name]) != lines:
            raise Refused(f"fairseq-generate ({name}) gave {len(outputs[name])} translations of "
                          f"{lines} lines")  # fmt: skip
        scores[name] = score(outputs[name], references)
    print(f"spec_nmt plugin, lossless (fairseq-generate --task spec_translation): "
          f"{scores['plugin']}")
    print(f"stock fairseq-generate --beam 1: {scores['stock']}")
    if scores["plugin"] != scores["stock"]:
        differing = sum(a != b for a, b in zip(outputs["plugin"], outputs["stock"]))
        print(f"bleu: the scores differ ({differing} of {lines} translations differ): lossless "
              "decoding must give the verifier's greedy output", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", help="raw German test set, one sentence per line")
    parser.add_argument("--ref", help="its raw English references, line by line")
    parser.add_argument("--model-dir", type=Path, default=REPO / "data" / "models" / "bench-de-en",
                        help="a model directory: " + ", ".join(MODEL_FILES) + " (default: the "
                        "bundled pair)")  # fmt: skip
    parser.add_argument("--work-dir", type=Path,
                        help="keep the encoded text, the data-bin and the outputs here")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="sentences per batch (default: %(default)s)")
    parser.add_argument("--cpu", action="store_true", help="decode on the CPU even with CUDA")
    args = parser.parse_args(argv)
    logging.getLogger().setLevel(logging.WARNING)  # (fairseq's import set it to INFO)
    missing = [name for name in MODEL_FILES if not (args.model_dir / name).is_file()]
    try:
        if missing:
            raise Refused(f"{args.model_dir} holds no {', '.join(missing)}: give --model-dir "
                          "(MODEL_DIR=) a model directory")  # fmt: skip
        with tempfile.TemporaryDirectory(prefix="spec-nmt-bleu-") as scratch:
            work = args.work_dir or Path(scratch)
            work.mkdir(parents=True, exist_ok=True)
            src, ref = raw_test_set(args.src, args.ref, work)
            return compared(args.model_dir, src, ref, work, args)
    except Refused as reason:
        print(f"bleu: {reason}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
