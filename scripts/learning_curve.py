#!/usr/bin/env python3
"""The validations of fairseq-train logs as a markdown table: the learning curve of a model card.

    python scripts/learning_curve.py ../runs/verifier/train.log [more logs of the same run] \
        [--metrics loss,ppl,bleu] [--epoch-ends]

One row per validation (epoch, update, then each metric as logged); a run resumed several times
has several logs: give them in order, and a validation logged twice (a resumed run repeats the
one of its checkpoint) appears once. --epoch-ends keeps the validation with the most updates of
each epoch only. For a drafter: --metrics loss,acc,accepted_lossless,accepted_top_beta.
"""

import argparse
import re
from pathlib import Path

VALIDATION = re.compile(r"\| valid \| epoch (\d+) \| valid on '[^']*' subset \| (.*)")


def validations(paths):
    """{update: (epoch, {metric: value text})} over the logs, in update order."""
    found = {}
    for path in paths:
        for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
            match = VALIDATION.search(line)
            if not match:
                continue
            fields = dict(field.strip().split(" ", 1) for field in match.group(2).split(" | "))
            found[int(fields["num_updates"])] = (int(match.group(1)), fields)
    return dict(sorted(found.items()))


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("logs", nargs="+", type=Path, help="fairseq-train logs, oldest first")
    parser.add_argument("--metrics", default="loss,ppl,bleu",
                        help="comma-separated metrics to show (missing ones show as –)")
    parser.add_argument("--epoch-ends", action="store_true",
                        help="one row per epoch: its last validation")
    args = parser.parse_args()
    rows = validations(args.logs)
    if args.epoch_ends:
        last_of_epoch = {epoch: update for update, (epoch, _) in rows.items()}
        rows = {update: rows[update] for update in last_of_epoch.values()}
    metrics = args.metrics.split(",")
    print("| epoch | update | " + " | ".join(metrics) + " |")
    print("|---|---|" + "---|" * len(metrics))
    for update, (epoch, fields) in rows.items():
        values = " | ".join(fields.get(metric, "–") for metric in metrics)
        print(f"| {epoch} | {update} | {values} |")


if __name__ == "__main__":
    main()
