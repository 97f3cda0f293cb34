"""Decoding speed on a busy machine (issue 58): ms per output token with torch's CPU threads at 1
and 2 and OpenMP's wait policy unset, ACTIVE or PASSIVE, on an idle machine and beside a
competing CPU-bound process: a torch loop of matrix products on 2 threads (a training run, say)
or a pure-Python loop that keeps one core busy.

    python benchmarks/busy_machine.py data/models/bench-de-en \\
        ../shared/data/bench-de-en/test.de --json benchmarks/results/busy-machine-threads.json

The test set is newstest2014 (``sacrebleu -t wmt14 -l de-en --echo src`` gives it). Each cell
is a process of its own (OpenMP reads its wait policy when it loads, before any decoding): it
loads the pair with ``SpecTranslator.from_pretrained(threads=N)``, translates one line untimed,
then ``--lines`` lines one at a time (batch 1) and ``--batch-lines`` more in batches of
``--batch-size``, each part stopped after ``--seconds`` (a cell that collapses reports the
lines it finished). Cells run in turn, each repeat of the grid after the other, so that
minutes of other load on the machine spread over all of them; the first cells run on the idle
machine, which is where the product kernels of each thread count are timed (in a cache of the
run's own). The competing process is killed when its cells are done, whatever happens.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMPETITORS = {
    "idle": None,
    "torch 2 threads": (
        "import torch\ntorch.set_num_threads(2)\na = torch.randn(512, 512)\n"
        "while True:\n    a = torch.tanh(a @ a)\n"
    ),
    "busy 1 core": "while True:\n    pass\n",
}
WAIT_POLICIES = ("unset", "ACTIVE", "PASSIVE")
WARM_UP_SECONDS = 3  # for the competitor to load torch and reach full speed


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("source", help="German text, one sentence per line")
    parser.add_argument("--lines", type=int, default=20, help="lines decoded at batch 1")
    parser.add_argument("--batch-lines", type=int, default=64,
                        help="lines decoded in batches after those (0: none)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="each part of a cell stops after the line or batch that passes it")
    parser.add_argument("--threads", default="1,2", help="torch thread counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", help="write the cells and their summary here")
    parser.add_argument("--cell", help=argparse.SUPPRESS)  # a child: one cell, JSON on stdout
    return parser.parse_args()


def run_cell(args) -> dict:
    """In the child: decode and time (the translator is imported here, after the environment
    that the parent chose)."""
    from spec_nmt.translator import SpecTranslator

    threads = int(args.cell)
    lines = Path(args.source).read_text(encoding="utf-8").splitlines()
    translator = SpecTranslator.from_pretrained(args.model_dir, device="cpu", threads=threads)
    translator.translate(lines[0])  # untimed: the first call's one-off costs
    batch1 = lines[: args.lines]
    batched = lines[args.lines : args.lines + args.batch_lines]
    chunks = [[line] for line in batch1]
    parts = {"batch 1": timed(translator, chunks, 1, args.seconds)}
    if batched:
        chunks = [batched[i : i + args.batch_size] for i in range(0, len(batched), args.batch_size)]
        parts[f"batch {args.batch_size}"] = timed(translator, chunks, args.batch_size, args.seconds)
    import torch

    return {"torch_threads": torch.get_num_threads(), **parts}


def timed(translator, chunks, batch_size: int, limit: float) -> dict:
    done = tokens = 0
    start = time.perf_counter()
    for chunk in chunks:
        translator.translate(chunk, batch_size=batch_size, split_sentences=False)
        tokens += sum(line["output_tokens"] for line in translator.statistics)
        done += len(chunk)
        if time.perf_counter() - start > limit:
            break
    seconds = time.perf_counter() - start
    return {"lines": done, "output_tokens": tokens, "seconds": round(seconds, 3),
            "ms_per_token": round(1000 * seconds / tokens, 2)}  # fmt: skip


def cell(args, threads: int, policy: str, cache: str) -> dict:
    """One cell in a process of its own; None values if it did not finish in time."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_"))}
    env.update(PYTHONPATH=str(REPO), XDG_CACHE_HOME=cache, PYTHONWARNINGS="ignore")
    if policy != "unset":
        env["OMP_WAIT_POLICY"] = policy
    command = [sys.executable, __file__, args.model_dir, args.source, "--cell", str(threads),
               "--lines", str(args.lines), "--batch-lines", str(args.batch_lines),
               "--batch-size", str(args.batch_size), "--seconds", str(args.seconds)]  # fmt: skip
    limit = 60 + 4 * args.seconds
    try:
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return {"error": f"no result in {limit:.0f} s"}
    if result.returncode != 0:
        return {"error": result.stderr.strip().splitlines()[-1:]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def start_competitor(code):
    if code is None:
        return None
    process = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    time.sleep(WARM_UP_SECONDS)
    return process


def stop(process) -> None:
    if process is not None:
        process.kill()
        process.wait()


def summary(cells) -> list:
    """Per competitor, threads, policy and part: the median ms per token and the range."""
    groups = {}
    for c in cells:
        for part, found in c["result"].items():
            if isinstance(found, dict):
                key = (c["competitor"], c["threads"], c["wait_policy"], part)
                groups.setdefault(key, []).append(found["ms_per_token"])
    return [{"competitor": k[0], "threads": k[1], "wait_policy": k[2], "part": k[3],
             "median_ms_per_token": round(statistics.median(v), 2), "min": min(v), "max": max(v),
             "runs": len(v)} for k, v in groups.items()]  # fmt: skip


def table(rows) -> str:
    lines = ["| competitor | threads | wait policy | part | ms/token, median (range) |",
             "|---|---:|---|---|---:|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['competitor']} | {r['threads']} | {r['wait_policy']} | {r['part']} "
                     f"| {r['median_ms_per_token']:.1f} ({r['min']:.1f}–{r['max']:.1f}) |")
    return "\n".join(lines)


def environment() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                  if line.startswith("Model name")), "unknown")  # fmt: skip
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    return {"cpu": model, "cores": os.cpu_count(), "commit": commit + ("+dirty" if dirty else ""),
            "command": " ".join(["python", *sys.argv])}  # fmt: skip


def main():
    args = parse_args()
    if args.cell:
        print(json.dumps(run_cell(args)))
        return
    threads = [int(n) for n in args.threads.split(",")]
    cells = []
    with tempfile.TemporaryDirectory(prefix="busy-machine-cache-") as cache:
        for name, code in COMPETITORS.items():
            competitor = start_competitor(code)
            try:
                for repeat in range(args.repeats):
                    for n in threads:
                        for policy in WAIT_POLICIES:
                            result = cell(args, n, policy, cache)
                            cells.append({"competitor": name, "threads": n, "wait_policy": policy,
                                          "repeat": repeat, "result": result})  # fmt: skip
                            print(json.dumps(cells[-1]), file=sys.stderr, flush=True)
            finally:
                stop(competitor)
    rows = summary(cells)
    print(table(rows))
    if args.json:
        found = {**environment(), "competitors": COMPETITORS, "cells": cells, "summary": rows}
        Path(args.json).write_text(json.dumps(found, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
