"""Modes sweep and run: BLEU and speed of speculative decoding against fairseq greedy and beam 5
(sweep chooses k, beta and tau on the validation set; run measures them on test)."""

import itertools
import json
from pathlib import Path

import spec_nmt.plugin  # noqa: F401  isort: skip  (first: fairseq quiet, the plugin registered)
import torch
from common import (
    MAX_LEN_A,
    MAX_LEN_B,
    batch1_seconds,
    bleu,
    decode_all,
    defaults,
    environment,
    fairseq_generator,
    load_inputs,
    speculating,
    table,
    timed_runs,
    write_result,
)


def sweep(args):
    pair, src, refs, tokens = load_inputs(args)
    decode_all(pair, {"warm-up": fairseq_generator(pair, 1)}, tokens[: args.warmup_lines], 1)
    baseline = {"fairseq greedy": fairseq_generator(pair, 1), "fairseq beam5": fairseq_generator(pair, 5)}
    base = decode_all(pair, baseline, tokens, args.batch_size)
    rows = []
    for name in baseline:
        rows.append({"system": name, "bleu": bleu(pair, base[name]["tokens"], refs)[0]})
        print(json.dumps(rows[-1]), flush=True)
    latency_tokens = tokens[: args.latency_lines]
    greedy_one = fairseq_generator(pair, 1)
    settings = args.settings or [
        # with beta 1 only the best token can pass: tau changes nothing
        (k, beta, tau) for k, beta, tau in itertools.product(args.blocks, args.betas, args.taus)
        if beta > 1 or tau == args.taus[0]
    ]
    for block, beta, tau in settings:
        name = f"spec k={block} beta={beta} tau={tau}"
        spec = speculating(pair, block_size=block, beta=beta, tau=tau)
        out = decode_all(pair, {name: spec}, tokens, args.batch_size)[name]
        # Batch-1 time relative to fairseq greedy, alternated sentence by sentence.
        single = batch1_seconds(pair, {"greedy": greedy_one, name: spec}, latency_tokens)
        rows.append({
            "system": name, "block": block, "beta": beta, "tau": tau,
            "bleu": bleu(pair, out["tokens"], refs)[0],
            "mean_accepted_per_iteration": out["mean_accepted_per_iteration"],
            "verifier_calls_per_sentence": out["verifier_calls_per_sentence"],
            "batch1_speedup_vs_greedy": round(single["greedy"] / single[name], 2),
        })
        print(json.dumps(rows[-1]), flush=True)
    # The rule: the fastest setting within 0.3 BLEU of beam 5 (else the best BLEU), and
    # the fastest k for lossless decoding.
    beam_bleu = rows[1]["bleu"]
    spec_rows = [r for r in rows[2:] if r["beta"] > 1] or rows[2:]
    close = [r for r in spec_rows if r["bleu"] >= beam_bleu - 0.3]
    best = (max(close, key=lambda r: r["batch1_speedup_vs_greedy"]) if close
            else max(spec_rows, key=lambda r: r["bleu"]))
    lossless = max((r for r in rows[2:] if r["beta"] == 1),
                   key=lambda r: r["batch1_speedup_vs_greedy"], default=None)
    print("best top-beta/tau setting:", json.dumps(best))
    print("best lossless setting:", json.dumps(lossless))
    result = {"mode": "sweep", "lines": len(src), "latency_lines": len(latency_tokens),
              "environment": environment(args, pair), "rows": rows, "best": best,
              "best_lossless": lossless}
    write_result(args, result)


def run(args):
    pair, src, refs, tokens = load_inputs(args)
    lossless = f"spec lossless k={args.lossless_block}"
    top_beta = f"spec k={args.block} beta={args.beta} tau={args.tau}"
    systems = {
        "fairseq greedy": fairseq_generator(pair, 1),
        "fairseq beam5": fairseq_generator(pair, 5),
        lossless: speculating(pair, block_size=args.lossless_block),
        top_beta: speculating(pair, block_size=args.block, beta=args.beta, tau=args.tau),
        "spec-nmt defaults": defaults(pair),
    }
    if args.tree_branching:  # the same rules over a greedy draft tree
        tree = args.tree_branching
        systems[f"spec lossless tree {tree}"] = speculating(pair, tree_branching=tree)
        systems[f"spec tree {tree} beta={args.beta} tau={args.tau}"] = speculating(
            pair, tree_branching=tree, beta=args.beta, tau=args.tau
        )
    for width, depth in args.beam_trees:  # ... and over the drafter's most probable sequences
        shape = {"block_size": depth, "tree_budget": width * depth}
        systems[f"spec lossless beam tree {width}x{depth}"] = speculating(pair, **shape)
        systems[f"spec beam tree {width}x{depth} beta={args.beta} tau={args.tau}"] = (
            speculating(pair, **shape, beta=args.beta, tau=args.tau)
        )
    batched, single, latency_lines = timed_runs(pair, systems, tokens, args)
    # The reference for "identical": stock greedy one sentence at a time. In a batch,
    # SequenceGenerator caps every row's length by the longest source; speculative decoding caps
    # each sentence by its own, so it never depends on its batch.
    greedy_tokens = decode_all(pair, {"greedy": fairseq_generator(pair, 1)}, tokens, 1)["greedy"]["tokens"]
    rows = []
    for name in systems:
        score, signature, hyps = bleu(pair, batched[name]["tokens"], refs)
        row = {
            "system": name, "bleu": score,
            "batch1_ms_per_sentence": round(1000 * single[name] / latency_lines, 1),
            "batch1_speedup_vs_greedy": round(single["fairseq greedy"] / single[name], 2),
            "batch1_speedup_vs_beam5": round(single["fairseq beam5"] / single[name], 2),
            f"batch{args.batch_size}_sentences_per_s": round(len(src) / batched[name]["seconds"], 1),
            f"batch{args.batch_size}_speedup_vs_greedy": round(
                batched["fairseq greedy"]["seconds"] / batched[name]["seconds"], 2),
            f"batch{args.batch_size}_speedup_vs_beam5": round(
                batched["fairseq beam5"]["seconds"] / batched[name]["seconds"], 2),
            "identical_to_greedy": sum(
                torch.equal(a, b) for a, b in zip(batched[name]["tokens"], greedy_tokens)),
        }
        for key in ("mean_accepted_per_iteration", "batch1_mean_accepted_per_iteration",
                    "verifier_calls_per_sentence"):  # fmt: skip
            if key in batched[name]:
                row[key] = batched[name][key]
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.output_dir:
            out = Path(args.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / (name.replace(" ", "_").replace("=", "") + ".en")).write_text("\n".join(hyps) + "\n")
    result = {
        "mode": "run", "lines": len(src), "latency_lines": latency_lines,
        "warmup_lines": args.warmup_lines, "batch_size": args.batch_size,
        "sacrebleu_signature": signature, "max_len": f"{MAX_LEN_A}*src_len+{MAX_LEN_B}",
        "environment": environment(args, pair), "rows": rows,
    }
    print("sacreBLEU signature:", signature)
    print(markdown_table(result))
    write_result(args, result)


def markdown_table(result):
    """The run's rows as a Markdown table, for BENCHMARKS.md."""
    batch = result["batch_size"]
    columns = [
        ("system", "system"), ("bleu", "BLEU"),
        ("batch1_ms_per_sentence", "batch-1 ms/sent"),
        ("batch1_speedup_vs_greedy", "batch-1 × greedy"),
        ("batch1_speedup_vs_beam5", "batch-1 × beam5"),
        (f"batch{batch}_sentences_per_s", f"batch-{batch} sent/s"),
        (f"batch{batch}_speedup_vs_greedy", f"batch-{batch} × greedy"),
        (f"batch{batch}_speedup_vs_beam5", f"batch-{batch} × beam5"),
        ("batch1_mean_accepted_per_iteration", "batch-1 accepted/iter"),
        ("mean_accepted_per_iteration", f"batch-{batch} accepted/iter"),
        ("verifier_calls_per_sentence", "verifier calls/sent"),
        ("identical_to_greedy", f"= greedy (of {result['lines']})"),
    ]
    return table(columns, result["rows"])
