"""Mode sampling: speculative sampling, RSD-C and RSD-S against fairseq's --sampling --beam 1,
the drafter-less loop sampling and (--ctranslate2) CTranslate2 int8 sampling, per temperature:
speed and BLEU of the samples."""

import argparse
import contextlib
import itertools
import json
import tempfile

import spec_nmt.plugin  # noqa: F401  isort: skip  (first: fairseq quiet, the plugin registered)
import torch
from common import (
    MAX_LEN_A,
    MAX_LEN_B,
    beam_shape,
    bleu,
    ctranslate2_timed,
    ctranslate2_verifier,
    environment,
    fairseq_sampler,
    load_inputs,
    speculating,
    table,
    text_bleu,
    timed_runs,
    write_result,
)

from spec_nmt.settings import DraftPlan
from spec_nmt.text import join_pieces


def sampling(args):
    """Sampling systems at each temperature: block efficiency and batch-1 wall time."""
    pair, src, refs, tokens = load_inputs(args)
    rows = []
    with contextlib.ExitStack() as cleanup:  # the converted model, the batch-1 lines' file
        if args.ctranslate2:
            converted = cleanup.enter_context(ctranslate2_verifier(args.model_dir))
            # the lines timed at batch 1 (see timed_runs), as a file of their own
            latency_src = cleanup.enter_context(
                tempfile.NamedTemporaryFile("w", suffix=".de", encoding="utf-8"))
            timed = src[args.warmup_lines : args.warmup_lines + args.latency_lines]
            latency_src.write("".join(line + "\n" for line in timed))
            latency_src.flush()
        for temperature in args.temperatures:
            batched, single, latency_lines = torch_rows(args, pair, tokens, refs, temperature,
                                                        rows)  # fmt: skip
            if args.ctranslate2:
                rows.append(ctranslate2_row(args, converted, latency_src.name, refs, temperature,
                                            batched, single, latency_lines))  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    result = {
        "mode": "sampling", "lines": len(src), "latency_lines": latency_lines,
        "batch_size": args.batch_size, "max_len": f"{MAX_LEN_A}*src_len+{MAX_LEN_B}",
        "environment": environment(args, pair), "rows": rows,
    }
    print(sampling_table(result))
    write_result(args, result)


def torch_rows(args, pair, tokens, refs, temperature, rows):
    """fairseq's sampling, the drafter-less loop and the --systems at ``temperature``: a row each
    appended to ``rows``. Returns timed_runs' (large-batch results, batch-1 seconds, lines)."""
    speculative = dict(args.systems)  # name -> decoding settings
    systems = {"fairseq sampling": fairseq_sampler(pair, temperature),
               "spec-nmt sampling (no drafts)": speculating(
                   pair, temperature=temperature, verify="sampling", block_size=0)}  # fmt: skip
    for name, settings in speculative.items():
        settings = dict(settings)
        systems[name] = speculating(pair, settings.pop("drafter", "file"),
                                    temperature=temperature, **settings)  # fmt: skip
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
    return batched, single, latency_lines


def ctranslate2_row(args, converted, latency_src, refs, temperature, batched, single,
                    latency_lines) -> dict:  # fmt: skip
    """CTranslate2 int8 sampling at ``temperature`` against fairseq's: all lines in batches of
    --batch-size, and the batch-1 lines one at a time."""
    whole = ctranslate2_timed(args, converted, args.src, args.lines, [args.batch_size], "int8",
                              temperature)  # fmt: skip
    alone = ctranslate2_timed(args, converted, latency_src, None, [1], "int8", temperature)["1"]
    in_batches = whole[str(args.batch_size)]
    hyps = [join_pieces(pieces) for pieces in in_batches["outputs"]]
    return {
        "temperature": temperature, "system": f"CTranslate2 {whole['ctranslate2']} int8 sampling",
        "drafted_tokens_per_call": 0, "bleu": text_bleu(hyps, refs)[0],
        "batch1_ms_per_sentence": round(1000 * alone["seconds"] / latency_lines, 1),
        "batch1_speedup_vs_fairseq": round(single["fairseq sampling"] / alone["seconds"], 2),
        f"batch{args.batch_size}_speedup_vs_fairseq": round(
            batched["fairseq sampling"]["seconds"] / in_batches["seconds"], 2),
        "ctranslate2_threads": f"{alone['threads']} / {in_batches['threads']}",
    }  # fmt: skip


def sampling_table(result):
    batch = result["batch_size"]
    columns = [
        ("temperature", "T"), ("system", "system"), ("drafted_tokens_per_call", "drafts/call"),
        ("tokens_per_verifier_call", "tokens/verifier call"),
        ("batch1_ms_per_sentence", "batch-1 ms/sent"),
        ("batch1_speedup_vs_fairseq", "batch-1 × fairseq"),
        (f"batch{batch}_speedup_vs_fairseq", f"batch-{batch} × fairseq"), ("bleu", "BLEU"),
        ("ctranslate2_threads", "CT2 threads (batch 1 / batched)"),
    ]
    return table(columns, result["rows"])


def sampling_system(text):
    """chain:K, rsd-c:B1-B2-..., rsd-s:WIDTHxDEPTH or twin (speculative sampling of the
    twin's whole continuations) → (name, decoding settings, with the drafter to use)."""
    kind, _, shape = text.partition(":")
    if kind == "twin":
        return "spec sampling, twin drafter", {"verify": "sampling", "drafter": "twin"}
    if kind == "chain":
        return f"spec sampling k={shape}", {"verify": "sampling", "block_size": int(shape)}
    if kind == "rsd-c":
        return f"RSD-C {shape}", {"verify": "rsd", "tree_branching": shape.replace("-", ",")}
    if kind == "rsd-s":
        width, depth = beam_shape(shape)
        return f"RSD-S {shape}", {"verify": "rsd", "tree_budget": width * depth, "block_size": depth}
    raise argparse.ArgumentTypeError(
        f"unknown system {text!r} (chain:K, rsd-c:B-B-..., rsd-s:WxD, twin)")


def tree_nodes(plan: DraftPlan) -> int:
    """Drafted tokens per verifier call (the verifier's budget beyond the pending token)."""
    if plan.beam_width:
        return plan.beam_width * plan.beam_depth
    return sum(itertools.accumulate(plan.branching, lambda a, b: a * b))
