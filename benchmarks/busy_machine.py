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
lines it finished). For each competitor, the grid runs ``--repeats`` times, one repeat after
the other, so that minutes of other load spread over all cells; the idle cells come first, and
there the product kernels of each thread count are timed (in a cache of the run's own). The
competing process is killed when its cells are done, whatever happens. On a machine shared with
other work each cell first waits a little for quiet and records the cores other processes used
while it ran (``other_processes_cores``); the summary keeps the quiet cells where there are any.
"""

import argparse
import json
import os
import resource
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
# Other people's work on the machine: a cell waits (at most QUIET_WAIT_SECONDS) until the
# processes that are not this run's use less than QUIET_CORES, and records what they used
# during the cell; the summary takes the cells below QUIET_CORES where there are any.
QUIET_CORES = 0.25
QUIET_WAIT_SECONDS = 20
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


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
    parser.add_argument("--competitors", default=",".join(COMPETITORS),
                        help="which of them, comma-separated (default: %(default)s)")
    parser.add_argument("--json", help="write the cells and their summary here; an existing "
                        "file keeps its cells, and the summary covers them all")
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


def busy_seconds() -> float:
    """CPU seconds all processes of the machine have used (user, system, interrupts, steal)."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS


def own_seconds(competitor) -> float:
    """CPU seconds of this run: this process, its finished cells and the competitor."""
    used = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        used += usage.ru_utime + usage.ru_stime
    if competitor is not None:
        with open(f"/proc/{competitor.pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        used += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
    return used


def others_cores(competitor, work=lambda: time.sleep(1)):
    """What ``work`` returns, and the cores that other processes used meanwhile."""
    start = time.perf_counter(), busy_seconds(), own_seconds(competitor)
    result = work()
    wall = time.perf_counter() - start[0]
    others = busy_seconds() - start[1] - (own_seconds(competitor) - start[2])
    return result, max(others, 0.0) / wall


def wait_until_quiet(competitor) -> float:
    deadline = time.perf_counter() + QUIET_WAIT_SECONDS
    while True:
        _, others = others_cores(competitor)
        if others < QUIET_CORES or time.perf_counter() > deadline:
            return others
        time.sleep(4)


def cell(args, threads: int, policy: str, cache: str) -> dict:
    """One cell in a process of its own, or an error if it did not finish in time."""
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
    """Per competitor, threads, policy and part: the median ms per token and the range, of the
    cells during which other processes stayed below QUIET_CORES (of all, where none did)."""
    groups = {}
    for c in cells:
        for part, found in c["result"].items():
            if isinstance(found, dict):
                key = (c["competitor"], c["threads"], c["wait_policy"], part)
                quiet = c["other_processes_cores"] < QUIET_CORES
                groups.setdefault(key, []).append((found["ms_per_token"], quiet))
    rows = []
    for key, runs in groups.items():
        kept = [ms for ms, quiet in runs if quiet] or [ms for ms, _ in runs]
        rows.append({"competitor": key[0], "threads": key[1], "wait_policy": key[2],
                     "part": key[3], "median_ms_per_token": round(statistics.median(kept), 2),
                     "min": min(kept), "max": max(kept), "runs": len(kept),
                     "runs_with_other_load": len(runs) - sum(q for _, q in runs)})  # fmt: skip
    return rows


def table(rows) -> str:
    lines = ["| competitor | threads | wait policy | part | ms/token, median (range) | runs |",
             "|---|---:|---|---|---:|---:|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['competitor']} | {r['threads']} | {r['wait_policy']} | {r['part']} "
                     f"| {r['median_ms_per_token']:.1f} ({r['min']:.1f}–{r['max']:.1f}) "
                     f"| {r['runs']} |")
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
    earlier = json.loads(Path(args.json).read_text()) if args.json and Path(args.json).exists() \
        else {"runs": [], "cells": []}  # fmt: skip
    run = len(earlier["runs"])
    cells = []
    with tempfile.TemporaryDirectory(prefix="busy-machine-cache-") as cache:
        for name in args.competitors.split(","):
            competitor = start_competitor(COMPETITORS[name])
            try:
                for repeat in range(args.repeats):
                    for n in threads:
                        for policy in WAIT_POLICIES:
                            wait_until_quiet(competitor)
                            result, others = others_cores(
                                competitor, lambda: cell(args, n, policy, cache))  # fmt: skip
                            cells.append({"run": run, "competitor": name, "threads": n,
                                          "wait_policy": policy, "repeat": repeat,
                                          "other_processes_cores":
                                          round(others, 2), "result": result})  # fmt: skip
                            print(json.dumps(cells[-1]), file=sys.stderr, flush=True)
            finally:
                stop(competitor)
    cells = earlier["cells"] + cells
    rows = summary(cells)
    print(table(rows))
    if args.json:
        found = {"runs": earlier["runs"] + [environment()], "competitors": COMPETITORS,
                 "quiet_cores": QUIET_CORES, "cells": cells, "summary": rows}  # fmt: skip
        Path(args.json).write_text(json.dumps(found, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
