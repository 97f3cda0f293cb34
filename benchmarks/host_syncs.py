"""Mode syncs: where decoding makes the host wait for the GPU. CUDA's sync debug mode warns at
every operation that does (a .item(), a bool() or int() of a tensor, a copy to the host, a
nonzero); each warning is counted at its calling line, the innermost one outside torch, per
system and batch size, against the system's verifier calls and output tokens. A CPU never makes
the host wait: there the mode runs the same decoding and counts nothing."""

import traceback
import warnings
from collections import Counter
from pathlib import Path

import spec_nmt.plugin  # noqa: F401  isort: skip  (first: fairseq quiet, the plugin registered)
import torch
from common import (
    environment,
    fairseq_generator,
    greedy_steps,
    load_inputs,
    speculating,
    table,
    write_result,
)

from spec_nmt.decoding.loop import DecodingStats, SpeculativeGenerator

# what torch's sync debug mode says at each synchronising operation
SYNC_WARNING = "called a synchronizing CUDA operation"
TORCH_DIR = str(Path(torch.__file__).parent)
# call sites reported per row, the most frequent first
SITES_PER_ROW = 12


def calling_line(stack) -> str:
    """FILE:LINE FUNCTION of the innermost frame outside torch and the warnings machinery, the
    file's path from its package folder on (spec_nmt/..., fairseq/...)."""
    for frame in reversed(stack):
        if frame.filename.startswith(TORCH_DIR) or frame.filename == warnings.__file__:
            continue
        if frame.filename == __file__ and frame.name == "_show":
            continue
        path = Path(frame.filename)
        parts = path.parts
        for package in ("spec_nmt", "fairseq", "benchmarks", "tests"):
            if package in parts:
                path = Path(*parts[len(parts) - 1 - parts[::-1].index(package):])
                break
        return f"{path}:{frame.lineno} {frame.name}"
    return "?"


class SyncCounter:
    """While active, counts the sync debug mode's warnings by calling line (``sites``); other
    warnings pass on as before. ``on_gpu`` False: the mode stays off (a CPU has none)."""

    def __init__(self, on_gpu: bool):
        self.on_gpu = on_gpu
        self.sites = Counter()
        self._catch = warnings.catch_warnings()

    def __enter__(self):
        self._catch.__enter__()
        # every occurrence, not once per line, whatever -W or PYTHONWARNINGS say
        warnings.filterwarnings("always", message=SYNC_WARNING)
        self._show_other = warnings.showwarning
        warnings.showwarning = self._show
        if self.on_gpu:
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if self.on_gpu:
            torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)
        return False

    def _show(self, message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING in str(message):
            self.sites[calling_line(traceback.extract_stack())] += 1
        else:
            self._show_other(message, category, filename, lineno, file, line)


def sync_systems(args, pair):
    """fairseq greedy, the drafter-less loop and drafting in every batch at --block (at batch 1
    the defaults' decoding; in batches the defaults decode as the drafter-less loop), on the
    static loop (the default on a GPU) and on the dynamic one."""
    drafting = f"spec lossless, drafting in every batch, k={args.block}"
    return {"fairseq greedy": fairseq_generator(pair, 1),
            "spec-nmt greedy (no drafts)": pair.generator(block_size=0, decoding_loop="static"),
            drafting: speculating(pair, block_size=args.block, decoding_loop="static"),
            "spec-nmt greedy (no drafts), dynamic loop": pair.generator(
                block_size=0, decoding_loop="dynamic"),
            f"{drafting}, dynamic loop": speculating(pair, block_size=args.block,
                                                     decoding_loop="dynamic")}  # fmt: skip


def decode(pair, system, batches, lines):
    """Every line's output ids from ``batches`` (``pair.batches``' (lines, sample) pairs, made
    beforehand: moving the inputs to the device is not decoding), kept where the system left
    them (a copy to the host would be counted)."""
    outputs = [None] * lines
    with torch.inference_mode():
        for rows, sample in batches:
            hypos = system.generate([pair.verifier], sample)
            for row, line in enumerate(rows):
                outputs[line] = hypos[row][0]["tokens"]
    return outputs


def host_syncs(args):
    """Host synchronisations per verifier call (fairseq: per decoder step) and per output token
    of each of sync_systems, per batch size, with the lines that cause them."""
    pair, src, _, tokens = load_inputs(args)
    on_gpu = pair.device.type == "cuda"
    rows = []
    for batch_size in args.batch_sizes:
        systems = sync_systems(args, pair)
        warmup = list(pair.batches(tokens[: args.warmup_lines], batch_size))
        batches = list(pair.batches(tokens, batch_size))
        for name, system in systems.items():
            decode(pair, system, warmup, args.warmup_lines)  # warm-up, uncounted
            if isinstance(system, SpeculativeGenerator):
                system.stats = DecodingStats()
            with SyncCounter(on_gpu) as counter:
                outputs = decode(pair, system, batches, len(tokens))
            if isinstance(system, SpeculativeGenerator):
                calls = system.stats.batched_verifier_calls
            else:
                calls = greedy_steps(pair, outputs, tokens, batch_size)
            syncs = sum(counter.sites.values())
            output_tokens = sum(t.numel() for t in outputs)
            row = {"batch_size": batch_size, "system": name, "syncs": syncs,
                   "verifier_calls": calls, "syncs_per_verifier_call": round(syncs / calls, 2),
                   "syncs_per_output_token": round(syncs / output_tokens, 3),
                   "sites": dict(counter.sites.most_common(SITES_PER_ROW))}  # fmt: skip
            rows.append(row)
            print(row, flush=True)
    result = {"mode": "syncs", "lines": len(src), "counted": on_gpu,
              "environment": environment(args, pair), "rows": rows}  # fmt: skip
    columns = [("batch_size", "batch"), ("system", "system"), ("syncs", "host syncs"),
               ("verifier_calls", "verifier calls (fairseq: steps)"),
               ("syncs_per_verifier_call", "per call"), ("syncs_per_output_token", "per token")]  # fmt: skip
    print(table(columns, rows))
    for row in rows:
        print(f"batch {row['batch_size']}, {row['system']}:")
        for site, count in row["sites"].items():
            print(f"  {count:>7}  {site}")
    write_result(args, result)
