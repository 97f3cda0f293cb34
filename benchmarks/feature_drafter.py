"""Acceptance and drafting cost of a feature drafter (spec_nmt/drafters/feature_drafter.py) from
its training checkpoint alone: lossless decoding is replayed against the verifier's fairseq
greedy translation, which it reproduces by definition (the decoding loop accepts the same, see
tests/test_feature_drafter.py).

Each iteration feeds the drafter the verifier's states for the positions verified since the last
one, drafts k tokens one step at a time and accepts the drafts that equal greedy's tokens; the
verifier's token after them is the next pending token. The first iteration has no verifier state
to draft from, so it scores the first token alone. Drafting cost: the drafter's eager steps at
batch 1 in fairseq greedy steps (fairseq's greedy time per token, same sentences, same run).

    python benchmarks/feature_drafter.py CHECKPOINT --data-bin DATA_BIN --lines 500 --blocks 10,3
"""

import argparse
import json
import sys
import time
from pathlib import Path

import spec_nmt.plugin  # noqa: F401  isort: skip  (first: fairseq quiet, the plugin registered)
import torch
from fairseq import checkpoint_utils
from fairseq.dataclass.configs import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from spec_nmt.decoding.block_forward import position_table  # noqa: E402
from common import cpu_model  # noqa: E402


def greedy_translations(task, model, indices, batch_size: int):
    """fairseq's greedy translation (beam 1) of each source, with its EOS."""
    dataset = task.dataset("valid")
    generator = task.build_generator([model.verifier], GenerationConfig(beam=1))
    translations = {}
    for start in range(0, len(indices), batch_size):
        sample = dataset.collater([dataset[i] for i in indices[start:start + batch_size]])
        hypotheses = task.inference_step(generator, [model.verifier], sample)
        for index, best in zip(sample["id"].tolist(), hypotheses):
            translations[index] = best[0]["tokens"]
    return translations


class Simulation:
    """Lossless drafting with block size ``k`` over greedy translations, with its statistics."""

    def __init__(self, model, k: int, eos: int):
        self.model, self.k, self.eos = model, k, eos
        self.iterations = self.accepted = self.tokens = 0
        self.judged, self.right = [0] * k, [0] * k
        self.drafting_seconds = 0.0

    def sentence(self, source_tokens: torch.Tensor, translation: torch.Tensor) -> None:
        model, length = self.model, translation.numel()
        prev = torch.cat([translation.new_tensor([self.eos]), translation[:-1]]).unsqueeze(0)
        encoder_out, states = model.verifier_states(
            source_tokens.unsqueeze(0), torch.tensor([source_tokens.numel()]), prev)
        # position embeddings past the translation's end, for drafts beyond it
        positions = position_table(model.verifier.decoder, length + self.k + 1).unsqueeze(0)
        tokens = translation.unsqueeze(0)
        self.iterations += 1  # the first token, scored alone
        self.tokens += 1
        verified, fed, cache = 1, 0, None
        started = time.perf_counter()
        source = model.source_keys(encoder_out)
        self.drafting_seconds += time.perf_counter() - started
        while verified < length:  # the pending token translation[verified - 1] is not EOS
            started = time.perf_counter()
            predicted, cache = model.extend(states[:, fed:verified], tokens[:, fed:verified],
                                            positions[:, fed:verified], source, cache)
            fed, drafts, draft_cache = verified, [], cache
            predicted = predicted[:, -1:]
            for step in range(self.k):
                draft = model.logits(predicted).argmax(dim=-1)  # [1, 1]
                drafts.append(int(draft))
                if drafts[-1] == self.eos or step == self.k - 1:
                    break
                where = positions[:, verified + step:verified + step + 1]
                predicted, draft_cache = model.extend(predicted, draft, where, source, draft_cache)
            self.drafting_seconds += time.perf_counter() - started
            accepted = 0
            for step, draft in enumerate(drafts):
                if verified + step >= length:
                    break
                self.judged[step] += 1
                if draft != int(translation[verified + step]):
                    break
                self.right[step] += 1
                accepted += 1
            # the verifier's own token follows unless the accepted drafts ended the sentence
            emitted = accepted + (verified + accepted < length)
            self.iterations += 1
            self.accepted += accepted
            self.tokens += emitted
            verified += emitted

    def summary(self) -> dict:
        return {
            "k": self.k,
            "iterations": self.iterations,
            "accepted_per_iteration": round(self.accepted / self.iterations, 3),
            "tokens_per_iteration": round(self.tokens / self.iterations, 3),
            "position_acceptance": [round(r / j, 3) if j else None
                                    for r, j in zip(self.right, self.judged)],
            "positions_judged": self.judged,
            "drafting_ms_per_iteration": round(1000 * self.drafting_seconds / self.iterations, 3),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a feature drafter's training checkpoint")
    parser.add_argument("--data-bin", required=True, help="data directory; its valid split is read")
    parser.add_argument("--lines", type=int, default=500, help="the valid split's first N lines")
    parser.add_argument("--blocks", default="10,3", help="block sizes k to simulate")
    parser.add_argument("--time-lines", type=int, default=64,
                        help="lines timed at batch 1 (fairseq greedy against drafting; "
                             "0: acceptance only)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.lines < 1 or args.time_lines < 0:
        parser.error(f"--lines must be >= 1 and --time-lines >= 0, got {args.lines} and "
                     f"{args.time_lines}")
    blocks = [int(k) for k in args.blocks.split(",")]
    torch.set_num_threads(args.threads)
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [args.checkpoint], arg_overrides={"data": args.data_bin})
    model = models[0].eval()
    task.load_dataset("valid")
    dataset = task.dataset("valid")
    eos = task.target_dictionary.eos()
    indices = list(range(min(args.lines, len(dataset))))
    results = {"checkpoint": args.checkpoint, "lines": len(indices),
               "cpu": cpu_model(),
               "torch": torch.__version__, "threads": args.threads}
    with torch.no_grad():
        translations = greedy_translations(task, model, indices, batch_size=50)
        for k in blocks:
            simulation = Simulation(model, k, eos)
            for index in indices:
                simulation.sentence(dataset[index]["source"], translations[index])
            results[f"k{k}"] = simulation.summary()
            print(json.dumps(results[f"k{k}"]), flush=True)
        if args.time_lines:
            # batch 1: fairseq greedy's time per token against the drafter's per iteration
            timed = indices[: args.time_lines]
            started = time.perf_counter()
            greedy = greedy_translations(task, model, timed, batch_size=1)
            tokens = sum(t.numel() for t in greedy.values())
            greedy_ms = 1000 * (time.perf_counter() - started) / tokens
            for k in blocks:
                simulation = Simulation(model, k, eos)
                for index in timed:
                    simulation.sentence(dataset[index]["source"], greedy[index])
                cost = simulation.summary()["drafting_ms_per_iteration"]
                results[f"k{k}"]["drafting_greedy_steps_per_iteration"] = round(cost / greedy_ms, 3)
            results["fairseq_greedy_ms_per_token"] = round(greedy_ms, 3)
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
