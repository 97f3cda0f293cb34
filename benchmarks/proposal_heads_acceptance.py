"""Lossless acceptance of a verifier's proposal heads, replayed on its own greedy translations.

The lossless loop's output is the verifier's greedy translation y, and the verifier state that
chose y_t is the same whether computed incrementally or in one teacher-forced pass over y. So
one pass gives every state, the heads' proposals from it, and the whole loop can be replayed:
after a block drafted from the state that chose y_p, the first a proposals that equal
y_{p+1} .. y_{p+a} are accepted, the verifier adds y_{p+a+1}, and the next block is drafted from
the state that chose it. The first iteration (the verifier's call on BOS alone) drafts nothing
and is not counted. Prints JSON: accepted drafts per iteration for each k, and
P(position i accepted | position i - 1 accepted) at the largest k.

  python benchmarks/proposal_heads_acceptance.py CHECKPOINT --data-bin DATA_BIN --lines 500
"""

import argparse
import json
from argparse import Namespace

import torch
from fairseq import checkpoint_utils
from fairseq.data.data_utils import collate_tokens

import spec_nmt  # noqa: F401  (registers the model)
from spec_nmt.settings import DEFAULTS


def replay(targets, proposals, block: int):
    """Accepted drafts, iterations, and per position (judged, accepted) for one sentence:
    targets [L] (ending in EOS), proposals [L, heads] from the state that chose each target."""
    accepted = iterations = 0
    judged, right = [0] * block, [0] * block
    last = len(targets) - 1
    position = 0
    while position < last:
        iterations += 1
        run = 0
        for offset in range(1, min(block, last - position) + 1):
            judged[offset - 1] += 1
            if int(proposals[position, offset - 1]) != int(targets[position + offset]):
                break
            right[offset - 1] += 1
            run += 1
        accepted += run
        position += run + 1
    return accepted, iterations, judged, right


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--data-bin", required=True, help="binarized data with the valid split")
    parser.add_argument("--split", default="valid")
    parser.add_argument("--lines", type=int, default=500, help="the split's first N sentences")
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [args.checkpoint], arg_overrides={"data": args.data_bin}
    )
    model = models[0].eval()
    heads = model.proposal_heads.count
    task.load_dataset(args.split)
    dataset = task.dataset(args.split)
    generator = task.build_generator(models, Namespace(
        beam=1, max_len_a=DEFAULTS.max_len_a, max_len_b=DEFAULTS.max_len_b))  # fmt: skip
    totals = {k: [0, 0] for k in range(1, heads + 1)}
    judged, right = [0] * heads, [0] * heads
    indices = list(range(min(args.lines, len(dataset))))
    with torch.inference_mode():
        for start in range(0, len(indices), args.batch_size):
            sample = dataset.collater(
                [dataset[i] for i in indices[start : start + args.batch_size]]
            )
            hypotheses = [hypos[0]["tokens"] for hypos in task.inference_step(generator, models,
                                                                              sample)]  # fmt: skip
            pad, eos = task.target_dictionary.pad(), task.target_dictionary.eos()
            targets = collate_tokens(hypotheses, pad)
            previous = collate_tokens(hypotheses, pad, eos, move_eos_to_beginning=True)
            _, extra = model(sample["net_input"]["src_tokens"], sample["net_input"]["src_lengths"],
                             previous)  # fmt: skip
            proposals = model.proposal_logits(extra["states"], targets).argmax(dim=-1)
            for row, hypothesis in enumerate(hypotheses):
                length = len(hypothesis)
                for k, total in totals.items():
                    accepted, iterations, *_ = replay(hypothesis, proposals[row, :length], k)
                    total[0] += accepted
                    total[1] += iterations
                *_, row_judged, row_right = replay(hypothesis, proposals[row, :length], heads)
                judged = [a + b for a, b in zip(judged, row_judged)]
                right = [a + b for a, b in zip(right, row_right)]
    print(json.dumps({
        "checkpoint": args.checkpoint, "lines": len(indices),
        "accepted_per_iteration": {k: round(a / max(n, 1), 3) for k, (a, n) in totals.items()},
        "by_position": [round(r / max(j, 1), 3) for r, j in zip(right, judged)],
        "judged": judged,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
