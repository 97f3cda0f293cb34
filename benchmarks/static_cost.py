"""Mode static-cost: where the static loop's time goes at batch 1, per system (no drafts, the
oracle and the real drafter at each k). Each sentence's time splits into its iterations (each
one timed alone: the device finishes before and after it) and the rest, paid once per sentence
(the encoder, the encoder keys and values, the batch's set-up and the output's read, all eager).
Then torch's profiler times the device's work of a few eager iterations per system: the
operations that take the most device time, and their sum against an iteration's time, which
says whether an iteration is bound by its kernels or by launching them."""

import spec_nmt.plugin  # noqa: F401  isort: skip  (first: fairseq quiet, the plugin registered)
import torch
from common import (
    environment,
    greedy_alone,
    load_inputs,
    now,
    oracle,
    speculating,
    table,
    write_result,
)

from spec_nmt.decoding.loop import DecodingStats

# the profiled operations listed per system, the most device time first
TOP_OPERATIONS = 12
# eager iterations the profiler sees per system
PROFILED_ITERATIONS = 20


class IterationTimer:
    """Times each iteration of a static loop alone (``seconds``, ``count``), by wrapping the
    step its batches get."""

    def __init__(self, loop):
        self.seconds, self.count = 0.0, 0
        self._loop, self._batch = loop, loop._batch
        loop._batch = self._timed_batch

    def stop(self) -> None:
        """The loop's own iterations again."""
        del self._loop._batch  # (the instance's wrapper: the class's method shows through)

    def _timed_batch(self, *args, **kwargs):
        batch, step = self._batch(*args, **kwargs)

        def timed():
            start = now()
            step()
            self.seconds += now() - start
            self.count += 1

        return batch, timed


def cost_systems(args, pair, tokens, alone):
    """The drafter-less static loop, the oracle at --block and the real drafter at each of
    --blocks, all lossless at batch 1 (drafting for every batch)."""
    static = {"decoding_loop": "static"}  # (the CPU's default loop is the dynamic one)
    systems = {"no drafts": pair.generator(block_size=0, **static),
               f"oracle k={args.block}": oracle(pair, tokens, alone, args.block, **static)}
    for block in args.blocks:
        systems[f"real drafter k={block}"] = speculating(pair, block_size=block, **static)
    return systems


def decode(pair, generator, tokens):
    with torch.inference_mode():
        for _, sample in pair.batches(tokens, 1):
            generator.generate([pair.verifier], sample)


def profiled(pair, generator, tokens, device_type: str):
    """(device seconds per iteration, the top operations by device time, profiled operations per
    iteration) over eager iterations of the static loop (its graph's kernels, launched one by
    one)."""
    static = generator.static
    captured, static.capture_graphs = static.capture_graphs, False
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device_type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    generator.stats = DecodingStats()
    with torch.profiler.profile(activities=activities) as profile:
        for line in tokens:  # whole sentences until PROFILED_ITERATIONS iterations
            decode(pair, generator, [line])
            if generator.stats.iterations >= PROFILED_ITERATIONS:
                break
    static.capture_graphs = captured
    iterations = max(generator.stats.iterations, 1)
    key = "self_device_time_total" if device_type == "cuda" else "self_cpu_time_total"
    events = [event for event in profile.key_averages() if getattr(event, key, 0) > 0]
    events.sort(key=lambda event: getattr(event, key), reverse=True)
    total = sum(getattr(event, key) for event in events) / 1e6
    top = {event.key: round(getattr(event, key) / 1e3 / iterations, 4)
           for event in events[:TOP_OPERATIONS]}  # fmt: skip
    return total / iterations, top, sum(event.count for event in events) / iterations


def static_cost(args):
    """Per system: ms per iteration (timed alone), ms per sentence outside the iterations, and
    of the eager iterations' profile the device's ms per iteration and operations per
    iteration, with the top operations."""
    pair, src, _, tokens = load_inputs(args)
    device_type = pair.device.type
    rows = []
    for name, generator in cost_systems(args, pair, tokens, greedy_alone(pair, tokens)).items():
        if generator.static is None or not generator.on_static_loop:
            raise SystemExit(f"static-cost: {name} does not decode on the static loop")
        decode(pair, generator, tokens[: args.warmup_lines])  # captures, untimed
        timer = IterationTimer(generator.static)
        generator.stats = DecodingStats()
        start = now()
        decode(pair, generator, tokens)
        seconds = now() - start
        timer.stop()
        stats = generator.stats
        device_seconds, top, operations = profiled(pair, generator, tokens, device_type)
        row = {"system": name, "sentences": len(tokens), "iterations": timer.count,
               "tokens_per_iteration": round(stats.output_tokens / max(stats.iterations, 1), 3),
               "ms_per_token": round(1000 * seconds / max(stats.output_tokens, 1), 3),
               "ms_per_iteration": round(1000 * timer.seconds / max(timer.count, 1), 3),
               "ms_per_sentence_outside": round(1000 * (seconds - timer.seconds) / len(tokens), 3),
               "eager_device_ms_per_iteration": round(1000 * device_seconds, 3),
               "eager_operations_per_iteration": round(operations, 1),
               "top_operations_ms_per_iteration": top}  # fmt: skip
        rows.append(row)
        print(row, flush=True)
    result = {"mode": "static-cost", "lines": len(src), "environment": environment(args, pair),
              "rows": rows}  # fmt: skip
    columns = [("system", "system"), ("tokens_per_iteration", "tokens / iteration"),
               ("ms_per_token", "ms / token"), ("ms_per_iteration", "ms / iteration"),
               ("ms_per_sentence_outside", "ms / sentence outside iterations"),
               ("eager_device_ms_per_iteration", "eager: device ms / iteration"),
               ("eager_operations_per_iteration", "eager: operations / iteration")]  # fmt: skip
    print(table(columns, rows))
    for row in rows:
        print(f"{row['system']}, top operations (ms per iteration):")
        for operation, ms in row["top_operations_ms_per_iteration"].items():
            print(f"  {ms:>9}  {operation}")
    write_result(args, result)
