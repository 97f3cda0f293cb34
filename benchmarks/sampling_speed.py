"""Mode sampling: speculative sampling, RSD-C and RSD-S against fairseq's --sampling --beam 1,
per temperature: speed and BLEU of the samples."""

import argparse
import itertools
import json

import torch
from common import (
    MAX_LEN_A,
    MAX_LEN_B,
    beam_shape,
    bleu,
    environment,
    fairseq_sampler,
    load_inputs,
    speculating,
    table,
    timed_runs,
    write_result,
)

from spec_nmt.settings import DraftPlan


def sampling(args):
    """Sampling systems at each temperature: block efficiency and batch-1 wall time."""
    pair, src, refs, tokens = load_inputs(args)
    rows = []
    for temperature in args.temperatures:
        speculative = dict(args.systems)  # name -> decoding settings
        systems = {"fairseq sampling": fairseq_sampler(pair, temperature)}
        systems.update({
            name: speculating(pair, temperature=temperature, **settings)
            for name, settings in speculative.items()
        })
        torch.manual_seed(1)
        batched, single, latency_lines = timed_runs(pair, systems, tokens, args)
        for name, generator in systems.items():
            row = {
                "temperature": temperature, "system": name,
                "drafted_tokens_per_call": tree_nodes(generator.plan) if name in speculative else 0,
                "bleu": bleu(pair, batched[name]["tokens"], refs)[0],
                "batch1_ms_per_sentence": round(1000 * single[name] / latency_lines, 1),
                "batch1_speedup_vs_fairseq": round(single["fairseq sampling"] / single[name], 2),
                f"batch{args.batch_size}_speedup_vs_fairseq": round(
                    batched["fairseq sampling"]["seconds"] / batched[name]["seconds"], 2),
            }
            # Block efficiency over the large-batch run of all lines: the batch-1 runs reset the
            # generator's statistics per sentence.
            fairseq_values = {"tokens_per_verifier_call": 1.0, "mean_accepted_per_iteration": 0.0}
            for key, fairseq_value in fairseq_values.items():
                row[key] = batched[name].get(key, fairseq_value)
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {
        "mode": "sampling", "lines": len(src), "latency_lines": latency_lines,
        "batch_size": args.batch_size, "max_len": f"{MAX_LEN_A}*src_len+{MAX_LEN_B}",
        "environment": environment(args), "rows": rows,
    }
    print(sampling_table(result))
    write_result(args, result)


def sampling_table(result):
    batch = result["batch_size"]
    columns = [
        ("temperature", "T"), ("system", "system"), ("drafted_tokens_per_call", "drafts/call"),
        ("tokens_per_verifier_call", "tokens/verifier call"),
        ("batch1_ms_per_sentence", "batch-1 ms/sent"),
        ("batch1_speedup_vs_fairseq", "batch-1 × fairseq"),
        (f"batch{batch}_speedup_vs_fairseq", f"batch-{batch} × fairseq"), ("bleu", "BLEU"),
    ]
    return table(columns, result["rows"])


def sampling_system(text):
    """chain:K, rsd-c:B1-B2-... or rsd-s:WIDTHxDEPTH → (name, decoding settings)."""
    kind, _, shape = text.partition(":")
    if kind == "chain":
        return f"spec sampling k={shape}", {"verify": "sampling", "block_size": int(shape)}
    if kind == "rsd-c":
        return f"RSD-C {shape}", {"verify": "rsd", "tree_branching": shape.replace("-", ",")}
    if kind == "rsd-s":
        width, depth = beam_shape(shape)
        return f"RSD-S {shape}", {"verify": "rsd", "tree_budget": width * depth, "block_size": depth}
    raise argparse.ArgumentTypeError(f"unknown system {text!r} (chain:K, rsd-c:B-B-..., rsd-s:WxD)")


def tree_nodes(plan: DraftPlan) -> int:
    """Drafted tokens per verifier call (the verifier's budget beyond the pending token)."""
    if plan.beam_width:
        return plan.beam_width * plan.beam_depth
    return sum(itertools.accumulate(plan.branching, lambda a, b: a * b))
