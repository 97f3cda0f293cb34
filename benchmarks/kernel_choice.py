"""Mode kernel-choice: decoding with the products' kernels chosen as spec_nmt/decoding/linears.py
times them (each weight read from memory, as decoding reads it) against the choice timed on one
copy of each weight, in cache (how they were timed before): the same lines with each k and
batch size, the systems' order rotating per batch, in one process."""

import contextlib
import statistics
import tempfile
from pathlib import Path
from unittest import mock

import torch
from common import decode_all, environment, load_pair, read_lines, table, write_result

from spec_nmt.decoding import linears


def in_cache_packed_from(outputs: int, inputs: int, dtype: torch.dtype) -> int:
    """The earlier timing: both products on one copy of the weight, which stays in cache (the
    fastest of 3 calls each after one to warm up, where it took the fastest of 7 after two)."""
    return linears.timed_on_copies(outputs, inputs, dtype, 1)


# how each system's kernels are chosen: None, as linears.py does
TIMINGS = {"streamed (default)": None, "in cache": in_cache_packed_from}


def kernel_choice(args):
    """Per kernel choice and k: ms per token (the median of --rounds rounds), its time against
    the default choice's, and the lines equal to its output; with each choice's packed-from row
    counts of the verifier's and the drafter's shapes."""
    src = read_lines(args.src, args.lines)
    systems, chosen = {}, {}
    for name, timing in TIMINGS.items():
        # a record of its own per choice: both are timed now, and neither reads the user's
        with tempfile.TemporaryDirectory() as records, contextlib.ExitStack() as patches:
            patches.enter_context(mock.patch.object(linears, "CHOICES_FILE",
                                                    Path(records) / "kernels.json"))  # fmt: skip
            if timing is not None:
                patches.enter_context(mock.patch.object(linears, "_timed_packed_from", timing))
            pair = load_pair(args)  # (the drafter's products are packed here)
            for block in args.blocks:  # (the verifier's, at its first generator)
                systems[f"{name}, k={block}"] = pair.generator(block_size=block,
                                                               max_draft_batch=0)  # fmt: skip
            projects = {"verifier": systems[f"{name}, k={args.blocks[0]}"].verifier.project,
                        "drafter": getattr(getattr(pair.drafter, "scorer", None), "project",
                                           None)}  # fmt: skip
            chosen[name] = {role: _packed_from_rows(project)
                            for role, project in projects.items() if project is not None}
    tokens = pair.encode(src)
    rows = []
    for batch_size in args.batch_sizes:
        rows += _timed_rows(args, pair, systems, tokens, batch_size)
    result = {"mode": "kernel-choice", "lines": len(src), "rounds": args.rounds,
              "environment": environment(args, pair), "packed_from_rows": chosen,
              "rows": rows}  # fmt: skip
    print(table([("batch_size", "batch"), ("choice", "kernel choice"), ("block", "k"),
                 ("ms_per_output_token", "ms / token"), ("time_vs_default", "time × default"),
                 ("identical_to_default", f"= default (of {len(src)})")], rows))  # fmt: skip
    for name, roles in chosen.items():
        for role, shapes in roles.items():
            print(f"{name}, the {role}'s products packed from rows: "
                  + ", ".join(f"{shape} {rows}" for shape, rows in shapes.items()))
    write_result(args, result)


def _packed_from_rows(project: linears.PackedLinears) -> dict:
    """Per weight shape of a PackedLinears, the fewest rows it runs packed from ("never")."""
    return {f"{o}x{i} {str(d).removeprefix('torch.')}": (
        "never" if packed_from >= linears.NEVER else packed_from)
        for (o, i, d), packed_from in project.packed_from.items()}  # fmt: skip


def _timed_rows(args, pair, systems, tokens, batch_size):
    """The systems' rows at one batch size (drafting in a batch of any size, as --max-draft-batch
    allows: the defaults draft for one sentence only)."""
    decode_all(pair, systems, tokens[: args.warmup_lines], batch_size)
    seconds = {system: [] for system in systems}
    outputs = {}
    for round_ in range(args.rounds):
        for system, result in decode_all(pair, systems, tokens, batch_size, round_).items():
            seconds[system].append(result["seconds"])
            outputs[system] = result["tokens"]
    output_tokens = sum(t.numel() for t in next(iter(outputs.values())))
    default = next(iter(TIMINGS))
    rows = []
    for block in args.blocks:
        reference = f"{default}, k={block}"
        for name in TIMINGS:
            system = f"{name}, k={block}"
            median = statistics.median(seconds[system])
            ratio = median / statistics.median(seconds[reference])
            equal = sum(torch.equal(a, b) for a, b in zip(outputs[system], outputs[reference]))
            rows.append({"batch_size": batch_size, "choice": name, "block": block,
                         "ms_per_output_token": round(1000 * median / output_tokens, 3),
                         "time_vs_default": round(ratio, 3), "identical_to_default": equal})
    return rows
