#!/usr/bin/env python3
"""Draw the figures of BENCHMARKS.md from the JSON results of benchmarks/benchmark.py.

    python benchmarks/plot.py [--results benchmarks/results] [--out benchmarks/plots]
        [--speed FILE[:KEY]] [--acceptance FILE ...]

Writes, under --out:
- speed-by-batch.png: × fairseq greedy against batch size, one line per system, from a
  `benchmark.py ceiling` result (--speed FILE[:KEY]; KEY picks one run in a file that holds
  several, as draft-batch.json does).
- acceptance-by-position.png: acceptance by draft position, one line per system, from the
  --acceptance files, or from every result under --results, whose rows carry a list under one of
  POSITION_KEYS (entry i: draft position i + 1). Skipped, with a note, while no result has one.

Needs matplotlib (requirements-test.txt). Only reads the JSON files; never runs a model.
"""

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent
# benchmark.py's system names -> the names BENCHMARKS.md uses, in drawing order
SYSTEM_LABELS = {
    "spec lossless, oracle drafter": "oracle drafter (the loop's ceiling)",
    "spec-nmt defaults": "spec-nmt defaults",
    "spec-nmt greedy (no drafts)": "drafter-less loop (k = 0)",
    "spec lossless, real drafter": "drafting in every batch",
    "fairseq greedy": "fairseq greedy",
    "spec-nmt greedy (no drafts), stock modules": "drafter-less loop, stock decoder modules",
    "spec-nmt greedy (no drafts), stock decoder modules": "drafter-less loop, stock decoder modules",
    "spec-nmt defaults, stock modules": "defaults, stock decoder modules",
    "spec-nmt defaults, stock decoder modules": "defaults, stock decoder modules",
}
# the systems that draft the mode's --block masks: their label gets that k
BLOCK_SYSTEMS = ("spec lossless, oracle drafter", "spec lossless, real drafter")
CTRANSLATE2 = "CTranslate2"
# row keys that hold acceptance by draft position (a list, position 1 first)
POSITION_KEYS = ("acceptance_by_position", "accepted_by_position")
# the fewest judged drafts at a position for its acceptance to be drawn
MIN_JUDGED = 30
FIGSIZE, DPI = (6.4, 4.4), 100


def load(spec: str, results: Path) -> dict:
    """One benchmark result: FILE or FILE:KEY (FILE relative to --results unless it exists)."""
    name, _, key = spec.partition(":")
    path = Path(name) if Path(name).is_file() else results / name
    data = json.loads(path.read_text())
    if key:
        data = data[key]
    if "rows" not in data:
        keys = ", ".join(k for k, v in data.items() if isinstance(v, dict) and "rows" in v)
        sys.exit(f"plot.py: {spec} holds several results; name one as FILE:KEY ({keys})")
    return data


def label(system: str) -> str:
    if system.startswith(CTRANSLATE2):
        return "CTranslate2 " + system.rsplit(" ", 1)[-1]  # "… greedy int8" -> "CTranslate2 int8"
    return SYSTEM_LABELS.get(system, system)


def row_label(row: dict):
    """(the row's label, its system's label without k): a drafting row's label names its k, the
    --lossless-blocks rows from their name ("… real drafter k=2"), the others from --block."""
    system, _, block = row["system"].partition(" k=")
    if not block and system in BLOCK_SYSTEMS:
        block = row["block"]
    base = label(system)
    return (f"{base}, k = {block}" if block else base), base


def machine(result: dict) -> str:
    env = result.get("environment", {})
    threads = env.get("torch_threads")
    return f"{env.get('cpu', '?')}, {threads} threads" if threads else env.get("cpu", "?")


def speed_by_batch(result: dict, out: Path) -> Path:
    """× fairseq greedy against batch size, one line per system."""
    series, bases = {}, {}
    for row in result["rows"]:
        point = (row["batch_size"], row["speedup_vs_greedy"])
        name, base = row_label(row)
        series.setdefault(name, []).append(point)
        bases[name] = base
    order = [*SYSTEM_LABELS.values(), "CTranslate2 float32", "CTranslate2 int8"]
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    # tab20 without its greys, which mark fairseq greedy: a colour for each of 18 systems
    colours = iter([plt.cm.tab20(i) for i in range(20) if i not in (14, 15)])
    def rank(name):
        return order.index(bases[name]) if bases[name] in order else len(order)

    for name in sorted(series, key=rank):
        points = sorted(series[name])
        style = "--" if name.startswith(CTRANSLATE2) else ":" if "stock" in name else "-"
        colour = "grey" if name == "fairseq greedy" else next(colours)
        ax.plot(*zip(*points), style, color=colour, marker="o", markersize=4, label=name)
    batches = sorted({row["batch_size"] for row in result["rows"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    finish_axes(ax, "batch size (sentences)", "× fairseq greedy (higher is faster)",
          f"Lossless decoding, {result['lines']} lines, {machine(result)}", columns=2)
    return save(fig, out / "speed-by-batch.png")


def runs(data):
    """Every benchmark result (a dict with rows) in a JSON file, however the file nests them."""
    if isinstance(data, dict) and "rows" in data:
        yield data
    elif isinstance(data, (dict, list)):
        for value in data.values() if isinstance(data, dict) else data:
            yield from runs(value)


def position_rows(results: Path, names=()):
    """(system, [acceptance at position 1, 2, …], result) for every row that has them, in the
    files ``names`` under ``results`` (default: every JSON file there)."""
    paths = [results / name for name in names] if names else sorted(results.glob("*.json"))
    for path in paths:
        for result in runs(json.loads(path.read_text())):
            for row in result["rows"]:
                for key in POSITION_KEYS:
                    if isinstance(row.get(key), list):
                        values = row[key]
                        # benchmark.py acceptance keeps the counts with its groups
                        judged = row.get("judged") or row.get("groups", {}).get("all", {}).get(
                            "judged")
                        if judged:  # positions judged too rarely to give a rate are left out
                            values = values[: sum(1 for n in judged if n >= MIN_JUDGED)]
                        yield f"{row.get('system', path.stem)} ({path.stem})", values, result


def acceptance_by_position(results: Path, out: Path, names=()):
    rows = list(position_rows(results, names))
    if not rows:
        print(f"plot.py: no result under {results} has {' or '.join(POSITION_KEYS)}; "
              "acceptance-by-position.png not drawn", file=sys.stderr)  # fmt: skip
        return None
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    for name, values, _ in rows:
        ax.plot(range(1, len(values) + 1), values, marker="o", markersize=4, label=name)
    longest = max(len(values) for _, values, _ in rows)
    ax.set_xticks(range(1, longest + 1))
    # one column: the labels carry their file names
    finish_axes(ax, "draft position", "acceptance", f"Acceptance by draft position, "
          f"{machine(rows[0][2])}", columns=1)  # fmt: skip
    return save(fig, out / "acceptance-by-position.png")


def finish_axes(ax, xlabel: str, ylabel: str, title: str, columns: int) -> None:
    """Axis labels, a y axis from 0, a light grid, the title, and the legend below the plot in
    ``columns`` columns."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=columns,
              frameon=False)  # fmt: skip


def save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})  # no version stamp: reruns give the same file
    plt.close(fig)
    return path


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--results", type=Path, default=ROOT / "results",
                        help="folder of JSON results")  # fmt: skip
    parser.add_argument("--out", type=Path, default=ROOT / "plots", help="folder for the PNG files")
    parser.add_argument("--speed", default="bench-de-en-v6-speed.json",
                        help="the ceiling result drawn by batch size: FILE[:KEY] "
                        "(default: %(default)s)")  # fmt: skip
    parser.add_argument("--acceptance", nargs="+", default=[], metavar="FILE",
                        help="the results drawn by draft position (default: every result "
                        "under --results that has acceptance by position)")  # fmt: skip
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    written = [speed_by_batch(load(args.speed, args.results), args.out),
               acceptance_by_position(args.results, args.out, args.acceptance)]  # fmt: skip
    for path in filter(None, written):
        print(f"{path} ({path.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()
