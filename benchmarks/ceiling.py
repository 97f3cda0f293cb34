"""Modes ceiling and block-cost: the loop's ceiling (the oracle drafter), the real drafter and
CTranslate2 per batch size with each iteration's cost split into phases, and what scoring a
block of W entries costs the verifier."""

import copy
import json
import time
from pathlib import Path

import spec_nmt.plugin  # noqa: F401  isort: skip  (first: fairseq quiet, the plugin registered)
import torch
from common import (
    MAX_LEN_A,
    MAX_LEN_B,
    PhaseTimer,
    bleu,
    commit,
    ctranslate2_timed,
    ctranslate2_verifier,
    decode_all,
    defaults,
    environment,
    fairseq_generator,
    greedy_alone,
    greedy_steps,
    load_inputs,
    load_pair,
    now,
    oracle,
    other_loop,
    read_lines,
    speculating,
    table,
    twin_engine,
    write_result,
)

from spec_nmt.decoding import scripted_layers
from spec_nmt.decoding.loop import SpeculativeGenerator
from spec_nmt.decoding.linears import PackedLinears
from spec_nmt.decoding.scorer import BlockScorer


def ceiling_systems(args, pair, tokens, alone, greedy):
    """The systems the ceiling mode times at one batch size, by name."""
    systems = {"fairseq greedy": greedy,
               "spec-nmt greedy (no drafts)": pair.generator(block_size=0),
               "spec lossless, oracle drafter": oracle(pair, tokens, alone, args.block),
               "spec lossless, real drafter": speculating(pair, block_size=args.block),
               "spec-nmt defaults": defaults(pair)}
    if getattr(pair.drafter, "twin", None) is not None:
        systems["spec lossless, oracle of whole continuations"] = oracle(
            pair, tokens, alone, args.block, whole=True)
        systems["spec lossless, twin drafter"] = speculating(pair, "twin")
        other = "worker" if type(pair.drafter.twin.engine).__name__ == "InProcess" else "process"
        systems[f"spec lossless, twin drafter, {other} engine"] = twin_engine(pair, other)
    # the loop the defaults do not take here, beside them: on a GPU what removing the host
    # earns, on the CPU what it costs
    other = other_loop(pair)
    systems[f"spec-nmt greedy (no drafts), {other} loop"] = pair.generator(
        block_size=0, decoding_loop=other)
    systems[f"spec-nmt defaults, {other} loop"] = pair.generator(decoding_loop=other)
    if args.stock_modules:
        systems["spec-nmt greedy (no drafts), stock decoder modules"] = through_modules(
            pair.generator(block_size=0))
        systems["spec-nmt defaults, stock decoder modules"] = through_modules(defaults(pair))
    if args.beam5:
        systems["fairseq beam5"] = fairseq_generator(pair, 5)
    for block in args.lossless_blocks:
        systems[f"spec lossless, real drafter k={block}"] = speculating(pair, block_size=block)
    for block, stop in args.draft_stops:
        systems[f"spec lossless, real drafter k={block}, draft stop {stop}"] = speculating(
            pair, block_size=block, draft_stop=stop)
    if args.top_beta:
        block, beta, tau = args.top_beta
        systems[f"spec k={block} beta={beta} tau={tau}"] = speculating(
            pair, block_size=block, beta=beta, tau=tau
        )
        for stop in sorted({stop for _, stop in args.draft_stops}):
            systems[f"spec k={block} beta={beta} tau={tau}, draft stop {stop}"] = speculating(
                pair, block_size=block, beta=beta, tau=tau, draft_stop=stop)
    if args.tree_branching:
        systems[f"spec lossless, real drafter, tree {args.tree_branching}"] = speculating(
            pair, tree_branching=args.tree_branching
        )
    for width, depth in args.beam_trees:
        systems[f"spec lossless, real drafter, beam tree {width}x{depth}"] = speculating(
            pair, block_size=depth, tree_budget=width * depth
        )
    return systems


def through_modules(generator: SpeculativeGenerator) -> SpeculativeGenerator:
    """The generator with its verifier's and drafter's decoder layers run through the stock
    fairseq modules instead of the scripted layers (the encoder and the products' kernels stay
    as they are)."""
    generator.verifier.layers_function = None
    scorer = getattr(generator.drafter, "scorer", None)
    if scorer is not None:  # the pair's drafter adapter is shared: change a copy
        generator.drafter = copy.copy(generator.drafter)
        generator.drafter.scorer = copy.copy(scorer)
        generator.drafter.scorer.layers_function = None
    return generator


def ctranslate2_row(report, compute_type: str, batch_size: int, fairseq_ms: float,
                    greedy_text) -> dict:  # fmt: skip
    """A CTranslate2 run's row beside fairseq greedy's ms per token and translations."""
    run_ = report[str(batch_size)]
    ms = 1000 * run_["seconds"] / run_["output_tokens"]
    return {"batch_size": batch_size,
            "system": f"CTranslate2 {report['ctranslate2']} greedy {compute_type}",
            "ctranslate2_threads": run_["threads"], "ms_per_output_token": round(ms, 2),
            "speedup_vs_greedy": round(fairseq_ms / ms, 2),
            "identical_to_greedy": sum(a == b for a, b in zip(run_["outputs"], greedy_text))}  # fmt: skip


def ceiling(args):
    """Fairseq greedy against speculative lossless decoding with the oracle drafter (the ceiling
    of the loop) and with the real drafter, per batch size, with each iteration's cost in greedy
    steps split into draft, score, accept and commit; with --ref, each system's BLEU."""
    pair, src, refs, tokens = load_inputs(args)
    greedy = fairseq_generator(pair, 1)
    alone = greedy_alone(pair, tokens)
    dictionary = pair.tgt_dict
    ctranslate2 = ctranslate2_runs(args) if args.ctranslate2 else {}
    greedy_text = [dictionary.string(t) for t in alone]  # CTranslate2 gives pieces, not ids
    rows = []
    for batch_size in args.batch_sizes:
        systems = ceiling_systems(args, pair, tokens, alone, greedy)
        decode_all(pair, systems, tokens[: args.warmup_lines], batch_size)  # warm-up, untimed
        speculative = [name for name, g in systems.items() if isinstance(g, SpeculativeGenerator)]
        # every graph the timed run replays captured before it (CUDA)
        prepared = [name for name in speculative
                    if systems[name].on_static_loop and pair.device.type == "cuda"]
        if prepared:
            decode_all(pair, {name: systems[name] for name in prepared}, tokens, batch_size)
        # On a GPU the phase timers wait for the GPU at every phase, which would slow the timed
        # run: there the breakdown comes from a second run of the speculative systems. The
        # static loop's iteration is one call (one graph on a GPU): it has no phases to time.
        phased = [name for name in speculative
                  if not systems[name].on_static_loop and args.phases]
        separate = pair.device.type == "cuda"
        timers = {}
        if not separate:
            timers = {name: PhaseTimer(systems[name]) for name in phased}
        results = decode_all(pair, systems, tokens, batch_size)
        broken_down = results
        if separate and phased:
            timers = {name: PhaseTimer(systems[name]) for name in phased}
            broken_down = decode_all(pair, {name: systems[name] for name in phased}, tokens,
                                     batch_size)  # fmt: skip
        base = results["fairseq greedy"]
        step = base["seconds"] / greedy_steps(pair, base["tokens"], tokens, batch_size)
        output_tokens = sum(t.numel() for t in base["tokens"])
        for name, result in results.items():
            row = {"batch_size": batch_size, "system": name, "block": args.block,
                   "ms_per_output_token": round(1000 * result["seconds"] / output_tokens, 2),
                   "speedup_vs_greedy": round(base["seconds"] / result["seconds"], 2),
                   "identical_to_greedy": sum(torch.equal(a, b) for a, b in zip(result["tokens"], alone))}  # fmt: skip
            if refs:
                row["bleu"] = bleu(pair, result["tokens"], refs)[0]
            if name in speculative:
                calls = systems[name].stats.batched_verifier_calls
                row["tokens_per_verifier_call"] = result["tokens_per_verifier_call"]
                row["greedy_steps_per_iteration"] = round(result["seconds"] / calls / step, 2)
            if name in timers:
                for phase, seconds in timers[name].seconds.items():
                    row[f"{phase}_greedy_steps"] = round(seconds / calls / step, 2)
                untimed = broken_down[name]["seconds"] - sum(timers[name].seconds.values())
                row["other_greedy_steps"] = round(untimed / calls / step, 2)
            elif name == "fairseq greedy":
                row["greedy_step_ms"] = round(1000 * step, 2)
            static = getattr(systems[name], "static", None)
            if static is not None and static.captures:
                row["graph_captures"] = static.captures
                row["capture_seconds"] = round(static.capture_seconds, 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
        fairseq_ms = 1000 * base["seconds"] / output_tokens
        for compute_type, report in ctranslate2.items():
            rows.append(ctranslate2_row(report, compute_type, batch_size, fairseq_ms, greedy_text))
            print(json.dumps(rows[-1]), flush=True)
    result = {"mode": "ceiling", "lines": len(src), "max_len": f"{MAX_LEN_A}*src_len+{MAX_LEN_B}",
              "environment": environment(args, pair), "rows": rows}  # fmt: skip
    print(ceiling_table(result))
    write_result(args, result)
    if args.headline:
        write_headline(args.headline, result)


def write_headline(path, result) -> None:
    """The batch-1 figures of this run into ``path`` ({"gpu": RUN, "cpu": RUN}), replacing the
    run of the same kind: fairseq greedy, the drafter-less loop and the defaults in ms per
    token, and how many lines the defaults gave as fairseq greedy did."""
    rows = {row["system"]: row for row in result["rows"] if row["batch_size"] == 1}
    if not rows:
        return
    environment = result["environment"]
    on_gpu = environment["device"] == "cuda"
    systems = {"fairseq_greedy": "fairseq greedy", "drafter_less": "spec-nmt greedy (no drafts)",
               "defaults": "spec-nmt defaults"}  # fmt: skip
    run_ = {"device": environment["gpu"] if on_gpu else environment["cpu"],
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "commit": commit(),
            "precision": environment["dtype"], "lines": result["lines"],
            "identical_lines": rows["spec-nmt defaults"]["identical_to_greedy"],
            "ms_per_token": {key: rows[name]["ms_per_output_token"]
                             for key, name in systems.items()}}  # fmt: skip
    path = Path(path)
    headline = json.loads(path.read_text()) if path.exists() else {}
    headline["gpu" if on_gpu else "cpu"] = run_
    path.write_text(json.dumps(headline, indent=1) + "\n")


def ceiling_table(result):
    columns = [
        ("batch_size", "batch"), ("system", "system"), ("ms_per_output_token", "ms/token"),
        ("speedup_vs_greedy", "× greedy"), ("tokens_per_verifier_call", "tokens/iteration"),
        ("greedy_steps_per_iteration", "iteration (greedy steps)"), ("encode_greedy_steps", "encode"),
        ("draft_greedy_steps", "draft"),
        ("score_greedy_steps", "score"), ("accept_greedy_steps", "accept"),
        ("commit_greedy_steps", "commit"), ("other_greedy_steps", "other"),
        ("identical_to_greedy", f"= greedy (of {result['lines']})"), ("bleu", "BLEU"),
        ("ctranslate2_threads", "CT2 threads"),
    ]  # fmt: skip
    return table(columns, result["rows"])


# decoder inputs committed before the timed blocks: a sentence part-way through
BLOCK_COST_PREFIX = 20


# how the verifier's decoder layers run, per --engines name (BlockScorer.layers_function)
LAYER_ENGINES = {
    "modules": lambda: None,  # through the stock fairseq modules (block_forward)
    "eager": lambda: scripted_layers.decoder_layers,  # one function of plain tensor operations
    "scripted": lambda: scripted_layers.decoder_layers_scripted,  # that function in TorchScript
    # that function compiled by inductor (dynamic: slots and spans change from call to call),
    # with the layers' own products: inductor cannot trace the packed oneDNN ones
    "compiled": lambda: without_packed(
        torch.compile(scripted_layers.decoder_layers, dynamic=True)),
}


def without_packed(layers_function):
    """``layers_function`` called with no packed product (each layer's own)."""

    def call(x, layers, packed, *rest):
        return layers_function(x, layers, [[None] * len(row) for row in packed], *rest)

    return call


def block_cost(args):
    """Seconds per verifier call scoring W new entries after a committed prefix, per batch size
    (the first batch-size lines of --src), relative to W = 1, for each of --engines (how the
    decoder layers run; the calls alternate between them), the first one the reference for
    the others' time and logits."""
    unknown = [engine for engine in args.engines if engine not in LAYER_ENGINES]
    if unknown:
        raise SystemExit(f"--engines: unknown {', '.join(unknown)} (choose from "
                         f"{', '.join(LAYER_ENGINES)})")  # fmt: skip
    pair = load_pair(args)
    tokens = pair.encode(read_lines(args.src, args.lines))
    scorers = {}
    project = PackedLinears(pair.verifier)  # one kernel choice for every engine
    for engine in args.engines:
        scorers[engine] = BlockScorer(pair.verifier, project=project)
        scorers[engine].layers_function = LAYER_ENGINES[engine]()
    reference = args.engines[0]
    symbols = (pair.tgt_dict.nspecial, len(pair.tgt_dict))
    rows = []
    with torch.inference_mode():
        for batch_size in args.batch_sizes:
            if batch_size > len(tokens):
                raise SystemExit(f"--batch-sizes {batch_size}: --src has only {len(tokens)} lines")
            _, sample = next(pair.batches(tokens[:batch_size], batch_size))
            prefix = torch.randint(*symbols, (batch_size, BLOCK_COST_PREFIX))
            order = torch.arange(BLOCK_COST_PREFIX).expand(batch_size, -1)
            states = {}
            for name, scorer in scorers.items():
                states[name] = scorer.start(sample["net_input"])
                scorer.score_logits(states[name], prefix)
                scorer.commit(states[name], order, torch.full((batch_size,), BLOCK_COST_PREFIX))
            nothing = (order[:, :0], torch.zeros(batch_size, dtype=torch.long))

            def call(name, block):  # the next block sees the same prefix
                start = now()
                logits = scorers[name].score_logits(states[name], block)
                scorers[name].commit(states[name], *nothing)
                return now() - start, logits

            seconds, first_call, difference = {}, {}, {}
            for width in args.widths:
                block = torch.randint(*symbols, (batch_size, width))
                first = {name: call(name, block) for name in scorers}
                first_call[width] = {name: first[name][0] for name in scorers}
                difference[width] = {name: float((first[name][1] - first[reference][1]).abs().max())
                                     for name in scorers}  # fmt: skip
                for _ in range(2):  # warm-up calls
                    for name in scorers:
                        call(name, block)
                seconds[width] = dict.fromkeys(scorers, 0.0)
                for _ in range(args.repeats):
                    for name in scorers:
                        seconds[width][name] += call(name, block)[0]
            for width, total in seconds.items():
                row = {"batch_size": batch_size, "width": width}
                for name in scorers:
                    row[f"{name}_ms_per_call"] = round(1000 * total[name] / args.repeats, 3)
                    row[f"{name}_cost_vs_narrowest"] = round(
                        total[name] / seconds[min(args.widths)][name], 2)
                    if name != reference:
                        row[f"{name}_vs_{reference}"] = round(total[name] / total[reference], 2)
                        row[f"{name}_first_call_s"] = round(first_call[width][name], 2)
                        row[f"{name}_max_abs_logit_difference"] = difference[width][name]
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {"mode": "block-cost", "prefix": BLOCK_COST_PREFIX, "repeats": args.repeats,
              "engines": args.engines, "environment": environment(args, pair),
              "rows": rows}  # fmt: skip
    columns = [("batch_size", "batch"), ("width", "W")]
    for name in scorers:
        columns += [(f"{name}_ms_per_call", f"{name}: ms per call"),
                    (f"{name}_cost_vs_narrowest", f"{name}: × narrowest W")]  # fmt: skip
        if name != reference:
            columns += [(f"{name}_vs_{reference}", f"{name} ÷ {reference}"),
                        (f"{name}_max_abs_logit_difference", f"{name}: largest logit difference")]
    print(table(columns, rows))
    write_result(args, result)


def ctranslate2_runs(args):
    """The verifier converted with CTranslate2's fairseq converter, greedy in fp32 and int8 at
    each batch size."""
    with ctranslate2_verifier(args.model_dir) as converted:
        return {compute_type: ctranslate2_timed(args, converted, args.src, args.lines,
                                                args.batch_sizes, compute_type)
                for compute_type in ("float32", "int8")}  # fmt: skip
