#!/usr/bin/env python3
"""Greedy decoding or sampling of a converted verifier with CTranslate2, timed in a process of
its own.

    python benchmarks/ctranslate2_decoding.py CT2_MODEL_DIR SPM_MODEL --src valid.de --lines 64 \
        --batch-sizes 1,32,64 --compute-type int8 --threads 2 --max-len-a 1.2 --max-len-b 10

(--sampling-temperature T samples from the whole distribution at temperature T instead.)

CTranslate2 is what speed-minded CPU users run instead of fairseq, so it is the bar for speed.
It must never share a process with torch (it runs much slower that way on a CPU), so this script
imports neither torch nor fairseq; benchmarks/benchmark.py ceiling and sampling --ctranslate2
convert the verifier (ct2-fairseq-converter) and run it with its own output limit (--max-len-a x
source tokens + --max-len-b). Sentences are sorted by length and batched as the benchmark batches
them, and the first --warmup-lines sentences are decoded once, untimed. Prints one JSON object:
per batch size, seconds, output tokens (EOS counted, as fairseq counts it) and the output pieces
per line.
"""

import argparse
import json
import time

import ctranslate2
import sentencepiece


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model_dir", help="output of ct2-fairseq-converter")
    parser.add_argument("spm_model", help="sentencepiece model of the verifier's data")
    parser.add_argument("--src", required=True, help="raw source sentences, one per line")
    parser.add_argument("--lines", type=int, default=None, help="use only the first N lines")
    parser.add_argument("--batch-sizes", default="1", help="comma-separated batch sizes")
    parser.add_argument("--compute-type", default="float32", help="float32, int8, ...")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads")
    parser.add_argument("--warmup-lines", type=int, default=5, help="untimed sentences first")
    parser.add_argument("--max-len-a", type=float, required=True, help="output limit: a x source length")
    parser.add_argument("--max-len-b", type=int, required=True, help="output limit: ... + b")
    parser.add_argument("--sampling-temperature", type=float, default=0.0,
                        help="sample at this temperature from every token (0: greedy)")
    parser.add_argument("--seed", type=int, default=1, help="the sampling's random seed")
    args = parser.parse_args()

    spm = sentencepiece.SentencePieceProcessor(model_file=args.spm_model)
    with open(args.src, encoding="utf-8") as handle:
        lines = [line.rstrip("\n") for line in handle][: args.lines]
    pieces = [spm.encode(line.strip(), out_type=str) for line in lines]
    ctranslate2.set_random_seed(args.seed)
    # sampling_topk 0: from the whole distribution, as fairseq's --sampling
    sampling = ({"sampling_topk": 0, "sampling_temperature": args.sampling_temperature}
                if args.sampling_temperature > 0 else {})  # fmt: skip
    translator = ctranslate2.Translator(
        args.model_dir, device="cpu", compute_type=args.compute_type, intra_threads=args.threads
    )

    def translate(batch):
        if not batch:
            return []
        # fairseq counts the source's EOS in its length: so does the limit here
        limit = int(args.max_len_a * max(len(p) + 1 for p in batch) + args.max_len_b)
        results = translator.translate_batch(batch, beam_size=1, max_decoding_length=limit,
                                             **sampling)  # fmt: skip
        return [result.hypotheses[0] for result in results]

    translate(pieces[: args.warmup_lines])
    order = sorted(range(len(pieces)), key=lambda i: len(pieces[i]))
    report = {"compute_type": args.compute_type, "ctranslate2": ctranslate2.__version__}
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        outputs = [None] * len(pieces)
        seconds = 0.0
        for start in range(0, len(order), batch_size):
            indices = order[start : start + batch_size]
            begin = time.perf_counter()
            hypotheses = translate([pieces[i] for i in indices])
            seconds += time.perf_counter() - begin
            for i, hypothesis in zip(indices, hypotheses):
                outputs[i] = hypothesis
        report[str(batch_size)] = {
            "seconds": seconds,
            "output_tokens": sum(len(o) + 1 for o in outputs),
            "outputs": [" ".join(o) for o in outputs],
        }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
