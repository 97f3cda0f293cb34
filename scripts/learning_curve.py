#!/usr/bin/env python3
r"""The validations of fairseq-train logs as a markdown table: the learning curve of a model card.

    python scripts/learning_curve.py ../runs/verifier/train.log [more logs of the same run] \
        [--metrics loss,ppl,bleu] [--epoch-ends] \
        [--converged N [--best-metric loss] [--maximize] [--min-delta D]]

One row per validation (epoch, update, then each metric as logged); a run resumed several times
has several logs: give them in order, and a validation logged twice (a resumed run repeats the
one of its checkpoint) appears once. --epoch-ends keeps the validation with the most updates of
each finished epoch only (fairseq also validates at every mid-epoch save). For a drafter:
--metrics loss,acc,accepted_lossless,accepted_top_beta.

After the table, a line says where the best validation was and how many came after it, and one
how long the logged updates took: fairseq's train_wall summed over the logs' train_inner lines
(forward and backward passes, without validation; work a resumed run redid counts again, as it
took the time again). With
--converged N the exit status says whether the run has converged by the rule "the best metric has
not improved over N validations in a row": 0 if so, 1 if not (also before any validation; 2: an
error); with --epoch-ends, N validated epochs. With --min-delta D only a gain of more than D over
the best counts as an improvement (a metric creeping up by thousandths has stopped rising).
fairseq's own --patience cannot say this of a resumed run: it counts from the first validation of
each fairseq-train process.
"""

import argparse
import re
import sys
from pathlib import Path

VALIDATION = re.compile(r"\| valid \| epoch (\d+) \| valid on '[^']*' subset \| (.*)")
# logged after the epoch's last validation and checkpoint saves; the next epoch's start also
# tells, when a stop fell between the saves and that line
EPOCH_END = re.compile(r"\| end of epoch (\d+) \(")
EPOCH_START = re.compile(r"\| begin training epoch (\d+)$")
# every --log-interval updates: the seconds those updates took (train_wall=)
TRAIN_INNER = re.compile(r"\| train_inner \| .*\btrain_wall=(\d+(?:\.\d+)?)")


def validations(paths):
    """({update: (epoch, {metric: value text})} in update order, the set of finished epochs,
    seconds of training steps) over the logs."""
    found, finished, seconds = {}, set(), 0.0
    for path in paths:
        for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
            if match := TRAIN_INNER.search(line):
                seconds += float(match.group(1))
            elif match := EPOCH_END.search(line):
                finished.add(int(match.group(1)))
            elif match := EPOCH_START.search(line):
                finished.add(int(match.group(1)) - 1)
            elif match := VALIDATION.search(line):
                fields = dict(field.strip().split(" ", 1) for field in match.group(2).split(" | "))
                found[int(fields["num_updates"])] = (int(match.group(1)), fields)
    return dict(sorted(found.items())), finished, seconds


def since_best(rows, metric: str, maximize: bool, min_delta: float = 0.0):
    """(update of the best validation, number of validations after it); a validation is the new
    best only when it beats the best by more than ``min_delta`` (so the first of equal values is
    the best, as a later equal one is no improvement)."""
    best_update, best_value, after = None, None, 0
    for update, (_, fields) in rows.items():
        value = float(fields[metric])
        # rounded: logged values have a few decimals, and 1.51 - 1.5 is 0.01000000000000001
        improved = best_value is None or (
            round(value - best_value if maximize else best_value - value, 9) > min_delta
        )
        if improved:
            best_update, best_value, after = update, value, 0
        else:
            after += 1
    return best_update, after


def fail(message: str, status: int = 2) -> None:
    """Say why on stderr and exit; status 2 is an error, which --converged's 1 (not converged)
    must not look like."""
    print(f"learning_curve.py: {message}", file=sys.stderr)
    sys.exit(status)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("logs", nargs="+", type=Path, help="fairseq-train logs, oldest first")
    parser.add_argument("--metrics", default="loss,ppl,bleu",
                        help="comma-separated metrics to show (missing ones show as –)")
    parser.add_argument("--epoch-ends", action="store_true",
                        help="one row per finished epoch: its last validation")
    parser.add_argument("--best-metric", default="loss",
                        help="the metric whose best validation the summary line reports")
    parser.add_argument("--maximize", action="store_true",
                        help="higher --best-metric is better (e.g. accepted_lossless)")
    parser.add_argument("--converged", type=int, metavar="N",
                        help="exit status 0 if the best validation has N or more after it, else 1")
    parser.add_argument("--min-delta", type=float, default=0.0, metavar="D",
                        help="a validation improves on the best only by a gain of more than D")
    args = parser.parse_args()
    if args.min_delta < 0:
        fail(f"--min-delta must be >= 0, got {args.min_delta:g}")
    rows, finished, seconds = validations(args.logs)
    if args.epoch_ends:
        last_of_epoch = {epoch: update for update, (epoch, _) in rows.items() if epoch in finished}
        rows = {update: rows[update] for update in last_of_epoch.values()}
    metrics = args.metrics.split(",")
    print("| epoch | update | " + " | ".join(metrics) + " |")
    print("|---|---|" + "---|" * len(metrics))
    for update, (epoch, fields) in rows.items():
        values = " | ".join(fields.get(metric, "–") for metric in metrics)
        print(f"| {epoch} | {update} | {values} |")
    if not rows:
        # a run that has not validated yet has not converged
        fail("no validations in " + ", ".join(map(str, args.logs)),
             status=2 if args.converged is None else 1)
    if any(args.best_metric not in fields for _, fields in rows.values()):
        fail(f"--best-metric {args.best_metric}: not logged at every validation")
    best_update, after = since_best(rows, args.best_metric, args.maximize, args.min_delta)
    best_epoch, best_fields = rows[best_update]
    print(f"\nbest {args.best_metric} {best_fields[args.best_metric]} at update {best_update} "
          f"(epoch {best_epoch}), {after} validation(s) after it")
    print(f"training steps: {seconds / 3600:.2f} h (train_wall of the logged updates)")
    if args.converged is not None:
        sys.exit(0 if after >= args.converged else 1)


if __name__ == "__main__":
    try:
        main()
    except Exception as error:  # e.g. a truncated log line: an error, not "not converged"
        fail(f"{type(error).__name__}: {error}")
