#!/usr/bin/env python3
r"""The end of a verifier run: average its last interval checkpoints, keep the averaged model or
the best single one (whichever scores higher BLEU on the validation set), and score the kept one
on the test set with greedy decoding and beam 5.

    python scripts/finish_verifier.py RUN_DIR --data-bin BIN --raw ../shared/data/bench-de-en \
        --spm-model spm.model [--last 5] [--json RUN_DIR/final.json]

RUN_DIR is fairseq-train's --save-dir with interval checkpoints (--save-interval-updates,
--keep-interval-updates at least --last) and checkpoint_best.pt. Writes RUN_DIR/checkpoint_avgN.pt
(the element-wise mean of the last N interval checkpoints' weights) and RUN_DIR/checkpoint_final.pt
(a copy of the kept one). BLEU is sacreBLEU on detokenized, cased output against the raw
references (--raw DIR/{valid,test}.en), decoded by stock fairseq-generate with the length limits
of the decoding settings.
"""

import argparse
import json
import logging
import re
import shutil
from pathlib import Path

import spec_nmt.plugin  # noqa: F401  isort: skip  (first: fairseq quiet, the plugin registered)
import sacrebleu
import sentencepiece
from fairseq import checkpoint_utils

# (importing spec_nmt also lets torch.load read fairseq checkpoints)
from spec_nmt.checkpoint_loading import map_tied, save_checkpoint
from spec_nmt.data_prep import translate_subset
from spec_nmt.errors import SpecNmtError
from spec_nmt.files import written_whole

logger = logging.getLogger("finish_verifier")
INTERVAL_CHECKPOINT = re.compile(r"checkpoint_\d+_(\d+)\.pt")


def last_interval_checkpoints(run_dir: Path, n: int):
    """The n interval checkpoints of the latest updates, oldest first."""
    found = sorted(
        (int(match.group(1)), path)
        for path in run_dir.iterdir()
        if (match := INTERVAL_CHECKPOINT.fullmatch(path.name))
    )
    if len(found) < n:
        raise SpecNmtError(
            f"{run_dir} holds {len(found)} interval checkpoints, --last asks for {n}: train with "
            f"--save-interval-updates and --keep-interval-updates {n} or more"
        )
    return [path for _, path in found[-n:]]


def average_checkpoints(paths, out: Path) -> None:
    """Save the element-wise mean of the checkpoints' weights (accumulated in float64) with the
    newest one's configuration and counters, without optimizer state."""
    total, state = None, None
    for path in paths:
        state = checkpoint_utils.load_checkpoint_to_cpu(str(path))
        weights = state["model"]
        if total is None:
            total = {name: tensor.double() for name, tensor in weights.items()}
        elif weights.keys() != total.keys():
            raise SpecNmtError(f"{path} has other parameters than {paths[0]}: not one run")
        else:
            for name, tensor in weights.items():
                total[name] += tensor.double()
    averaged = {name: (total[name] / len(paths)).to(tensor.dtype)
                for name, tensor in state["model"].items()}  # fmt: skip
    # tied weights have equal averages: stored once
    state["model"] = map_tied(averaged, lambda _, tensor: tensor)
    state["last_optimizer_state"] = None
    save_checkpoint(state, out)


def bleu(checkpoint: Path, subset: str, beam: int, args) -> float:
    """sacreBLEU of the checkpoint's translations of a split against its raw references."""
    reference_file = args.raw / f"{subset}.{args.target_lang}"
    references = reference_file.read_text(encoding="utf-8").splitlines()
    translated = translate_subset(
        args.data_bin, checkpoint, subset, beam, args.max_tokens,
        languages=(args.source_lang, args.target_lang), cpu=args.cpu,
    )  # fmt: skip
    if len(translated) != len(references):
        raise SpecNmtError(
            f"{args.data_bin} has {len(translated)} {subset} sentences, "
            f"{reference_file} {len(references)} lines: not the same split"
        )
    if args.spm_model:
        processor = sentencepiece.SentencePieceProcessor(model_file=str(args.spm_model))
        hypotheses = [processor.decode(h.split()) for _, h in translated.values()]
    else:  # word-level data: the tokens are the words
        hypotheses = [h for _, h in translated.values()]
    score = sacrebleu.corpus_bleu(hypotheses, [references]).score
    logger.info("%s, %s, beam %d: BLEU %.2f", checkpoint.name, subset, beam, score)
    return score


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", type=Path, help="fairseq-train --save-dir of the verifier")
    parser.add_argument("--data-bin", type=Path, required=True, help="the data-bin it trained on")
    parser.add_argument("--raw", type=Path, required=True,
                        help="directory of the raw references: valid.EN and test.EN")
    parser.add_argument("--spm-model", type=Path, default=None,
                        help="sentencepiece model that detokenizes the output (none: word tokens)")
    parser.add_argument("--last", type=int, default=5, help="interval checkpoints to average")
    parser.add_argument("--source-lang", default="de")
    parser.add_argument("--target-lang", default="en")
    parser.add_argument("--max-tokens", type=int, default=6000, help="source tokens per batch")
    parser.add_argument("--cpu", action="store_true", help="translate on the CPU")
    parser.add_argument("--json", type=Path, default=None, help="write the scores here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, force=True,  # fairseq's import configured it already
                        format="%(asctime)s | %(levelname)s | %(message)s")
    best = args.run_dir / "checkpoint_best.pt"
    if not best.is_file():
        raise SpecNmtError(f"{best} is missing: RUN_DIR must be a fairseq-train --save-dir")
    for subset in ("valid", "test"):  # checked now, not after the averaging and decoding
        reference = args.raw / f"{subset}.{args.target_lang}"
        if not reference.is_file():
            raise SpecNmtError(f"{reference} is missing: --raw holds the raw references")

    averaged = args.run_dir / f"checkpoint_avg{args.last}.pt"
    sources = last_interval_checkpoints(args.run_dir, args.last)
    average_checkpoints(sources, averaged)
    logger.info("averaged %s into %s", ", ".join(p.name for p in sources), averaged.name)
    valid = {path.name: bleu(path, "valid", 1, args) for path in (best, averaged)}
    kept = max((best, averaged), key=lambda path: valid[path.name])
    final = args.run_dir / "checkpoint_final.pt"
    with written_whole(final) as partial:
        shutil.copyfile(kept, partial)
    result = {
        "averaged": [p.name for p in sources],
        "valid_greedy_bleu": valid,
        "kept": kept.name,
        "test_bleu": {f"beam {beam}": bleu(final, "test", beam, args) for beam in (1, 5)},
    }
    print(json.dumps(result, indent=2))
    if args.json:  # written last, whole: a campaign takes it as the sign that this step is done
        with written_whole(args.json) as partial:
            partial.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
