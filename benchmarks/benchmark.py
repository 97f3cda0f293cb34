#!/usr/bin/env python3
r"""BLEU and speed of speculative decoding against fairseq's own decoding of the same verifier.

Choose the setting on the validation set (never on test):

    python benchmarks/benchmark.py sweep MODEL_DIR --src valid.de --ref valid.en \
        --blocks 2,3,5,10 --betas 1,3,5 --taus 0,1,2,3 --lines 500 --latency-lines 100

then measure it on test:

    python benchmarks/benchmark.py run MODEL_DIR --src test.de --ref test.en \
        --lossless-block 3 --block 5 --beta 3 --tau 1 --latency-lines 200 \
        --json benchmarks/results/run-newstest2014.json

Sampling (speculative sampling vs RSD-C vs RSD-S vs fairseq's --sampling --beam 1), per
temperature, with systems named kind:shape (chain:K, rsd-c:B1-B2-..., rsd-s:WIDTHxDEPTH):

    python benchmarks/benchmark.py sampling MODEL_DIR --src test.de --ref test.en \
        --temperatures 1.0,0.7 --systems chain:6,rsd-c:2-1-1,rsd-s:2x3 --json benchmarks/results/sampling.json

The ceiling of the loop (an oracle drafter that proposes the verifier's own greedy translation,
so every draft is accepted), the real drafter, and each iteration's cost in greedy steps split into
draft, score, accept and commit, per batch size:

    python benchmarks/benchmark.py ceiling MODEL_DIR --src valid.de --lines 64 --block 10 \
        --batch-sizes 1,32,64 --ctranslate2 --json benchmarks/results/ceiling.json

(--ctranslate2 adds the verifier converted with CTranslate2, greedy in fp32 and int8, each run in
a process of its own by benchmarks/ctranslate2_greedy.py.) On a GPU, with beam 5, lossless at
several k, top-beta/tau and BLEU (what scripts/gpu_check.sh runs):

    python benchmarks/benchmark.py ceiling MODEL_DIR --src test.de --ref test.en --lines 256 \
        --batch-sizes 8,32,128 --device cuda --fp16 --beam5 --lossless-blocks 2,5,10 --top-beta 5:3:1

What scoring a block of W entries costs the verifier against scoring one (a greedy step of the
same scorer), per batch size; if every draft were accepted, an iteration of k drafts would emit
k + 1 tokens for the cost of W = k + 1:

    python benchmarks/benchmark.py block-cost MODEL_DIR --src valid.de --widths 1,2,4,8,11,16,26 \
        --batch-sizes 1,32,64 --json benchmarks/results/block-cost.json

(--compile: the same calls of the scorer compiled by torch.compile, alternated with the eager ones.)

MODEL_DIR holds verifier.pt, drafter.pt, dict.{de,en}.txt and spm.model (scripts/export_model.py);
--drafter PATH replaces drafter.pt (e.g. an autoregressive drafter).
Systems: fairseq greedy and beam 5 (stock SequenceGenerator), speculative lossless (beta 1,
tau 0) and speculative top-beta/tau. BLEU is sacreBLEU on detokenized, cased output of the
large-batch run. Timing: each batch (or, for latency, each sentence) runs every system in a
rotating order, so slow phases of a noisy machine hit all systems alike; --warmup-lines
sentences are decoded untimed first (run, ceiling and sampling: the first ones of the latency
run; sweep: fairseq greedy on them before anything is timed). Ratios are speculative time over
fairseq time from the same process.
"""

import argparse
import copy
import itertools
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import sacrebleu
import torch
from fairseq.search import Sampling
from fairseq.sequence_generator import SequenceGenerator

import diagnosis  # benchmarks/diagnosis.py, beside this script
import spec_nmt  # noqa: F401  (registers the task and model, allows loading fairseq checkpoints)
from spec_nmt.settings import DraftPlan
from spec_nmt.decoding.drafter import NoDrafter
from spec_nmt.decoding.loop import DecodingStats, SpeculativeGenerator
from spec_nmt.decoding.tree import chain
from spec_nmt.settings import DEFAULTS, REFERENCE_TOP_BETA
from spec_nmt.decoding.scorer import BlockScorer
from spec_nmt.errors import SpecNmtError
from spec_nmt.loading import DEFAULT_DRAFTER_PRECISION, DRAFTER_PRECISION_NAMES, drafts_in_int8
from spec_nmt.translator import DEFAULT_BATCH_SIZE, SpecTranslator

# the same output length limit for every system: the decoding default
MAX_LEN_A, MAX_LEN_B = DEFAULTS.max_len_a, DEFAULTS.max_len_b


def fairseq_generator(pair: SpecTranslator, beam: int) -> SequenceGenerator:
    return SequenceGenerator(
        [pair.verifier], pair.tgt_dict, beam_size=beam, max_len_a=MAX_LEN_A, max_len_b=MAX_LEN_B
    )


def fairseq_sampler(pair: SpecTranslator, temperature: float) -> SequenceGenerator:
    return SequenceGenerator(
        [pair.verifier], pair.tgt_dict, beam_size=1, max_len_a=MAX_LEN_A, max_len_b=MAX_LEN_B,
        temperature=temperature, search_strategy=Sampling(pair.tgt_dict),
    )


def speculating(pair: SpecTranslator, **settings) -> SpeculativeGenerator:
    """A generator that drafts in a batch of any size: what the benchmark measures (by default
    the lossless and sampling rules draft for one sentence only, see ``defaults``)."""
    return pair.generator(max_draft_batch=0, **settings)


def defaults(pair: SpecTranslator) -> SpeculativeGenerator:
    """The generator with every setting at its default, as ``make translate`` decodes."""
    return pair.generator()


def load_pair(args) -> SpecTranslator:
    return SpecTranslator.from_pretrained(args.model_dir, args.drafter, device=args.device,
                                          drafter_precision=args.drafter_precision,
                                          dtype=dtype(args))  # fmt: skip


def dtype(args) -> torch.dtype:
    return torch.float16 if args.fp16 else torch.float32


def now() -> float:
    """time.perf_counter() once the GPU has done what was queued: CUDA calls return before
    their kernels finish."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def decode_all(pair, systems, tokens, batch_size, rotation_offset=0):
    """Run every system on every batch, rotating the order per batch. Returns per system:
    outputs (token tensors by line), seconds in total, and speculative statistics."""
    results = {name: {"tokens": [None] * len(tokens), "seconds": 0.0} for name in systems}
    for name, generator in systems.items():
        if isinstance(generator, SpeculativeGenerator):
            generator.stats = DecodingStats()
    names = list(systems)
    with torch.inference_mode():
        for batch_number, (lines, sample) in enumerate(pair.batches(tokens, batch_size)):
            rotation = (batch_number + rotation_offset) % len(names)
            for name in names[rotation:] + names[:rotation]:
                start = now()
                hypos = systems[name].generate([pair.verifier], sample)
                elapsed = now() - start
                results[name]["seconds"] += elapsed
                for row, line in enumerate(lines):
                    results[name]["tokens"][line] = hypos[row][0]["tokens"].cpu()
    for name, generator in systems.items():
        if isinstance(generator, SpeculativeGenerator):
            stats = generator.stats
            results[name]["mean_accepted_per_iteration"] = round(stats.mean_accepted_per_iteration, 3)
            results[name]["tokens_per_verifier_call"] = round(
                stats.output_tokens / max(stats.iterations, 1), 3
            )
            results[name]["verifier_calls_per_sentence"] = round(
                stats.iterations / max(stats.sentences, 1), 3
            )
    return results


def bleu(pair, token_lists, refs):
    hyps = [pair.decode(t) for t in token_lists]
    metric = sacrebleu.BLEU()
    score = metric.corpus_score(hyps, [refs])
    return round(score.score, 2), str(metric.get_signature()), hyps


def read_lines(path, limit=None):
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f]
    except OSError as error:
        raise SpecNmtError(f"cannot read {path}: {error.strerror}") from None
    return lines[:limit] if limit else lines


def environment(args):
    cpu = platform.processor() or platform.machine()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        cpu = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                   if line.startswith("Model name"))
    except (OSError, StopIteration):
        pass
    import fairseq

    int8 = drafts_in_int8(args.drafter_precision, args.device, dtype(args))
    found = {
        "device": args.device,
        "cpu": cpu,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "fairseq": fairseq.__version__,
        "python": platform.python_version(),
        "dtype": "fp16" if args.fp16 else "fp32",
        "drafter_precision": "int8" if int8 else "fp16" if args.fp16 else "fp32",
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
    }
    if args.device == "cuda":
        found.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    return found


def batch1_seconds(pair, systems, tokens, untimed=0, accepted=None):
    """Seconds per system decoding ``tokens`` one sentence at a time, the systems' order rotating
    per sentence; the first ``untimed`` sentences are run but not counted (warm-up). A dict
    ``accepted`` receives each speculative system's mean accepted drafts per iteration over the
    timed sentences."""
    seconds = dict.fromkeys(systems, 0.0)
    speculative = [name for name, system in systems.items()
                   if isinstance(system, SpeculativeGenerator)]  # fmt: skip
    counts = {name: [0, 0] for name in speculative}  # accepted drafts, iterations
    for i, line_tokens in enumerate(tokens):
        one = decode_all(pair, systems, [line_tokens], 1, rotation_offset=i)
        if i >= untimed:
            for name in systems:
                seconds[name] += one[name]["seconds"]
            for name in speculative:
                counts[name][0] += systems[name].stats.accepted_tokens
                counts[name][1] += systems[name].stats.iterations
    if accepted is not None:
        accepted.update({name: round(n / max(iterations, 1), 3)
                         for name, (n, iterations) in counts.items()})  # fmt: skip
    return seconds


def timed_runs(pair, systems, tokens, args):
    """(large-batch results over all lines, batch-1 seconds over the first --latency-lines,
    that many lines). The large-batch results also hold each speculative system's accepted
    drafts per iteration at batch 1: the defaults draft for one sentence only, so their
    large-batch figure is 0."""
    decode_all(pair, systems, tokens[: args.warmup_lines], args.batch_size)  # warm-up, untimed
    batched = decode_all(pair, systems, tokens, args.batch_size)
    latency_tokens = tokens[: args.latency_lines + args.warmup_lines]
    accepted = {}
    single = batch1_seconds(pair, systems, latency_tokens, untimed=args.warmup_lines,
                            accepted=accepted)  # fmt: skip
    for name, value in accepted.items():
        batched[name]["batch1_mean_accepted_per_iteration"] = value
    return batched, single, len(latency_tokens) - args.warmup_lines


def sweep(args):
    pair = load_pair(args)
    src = read_lines(args.src, args.lines)
    refs = read_lines(args.ref, args.lines)
    tokens = pair.encode(src)
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
              "environment": environment(args), "rows": rows, "best": best,
              "best_lossless": lossless}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


def run(args):
    pair = load_pair(args)
    src = read_lines(args.src, args.lines)
    refs = read_lines(args.ref, args.lines)
    tokens = pair.encode(src)
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
        "environment": environment(args), "rows": rows,
    }
    print("sacreBLEU signature:", signature)
    print(markdown_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


class OracleDrafter(NoDrafter):
    """A drafter that knows the verifier's greedy translation of every sentence and proposes its
    next k tokens. Every draft passes the lossless rule and drafting costs next to nothing, so
    speculative decoding with it measures the ceiling of the loop itself. Like ``NoDrafter`` it
    reads no source and keeps nothing at commit."""

    def __init__(self, continuations, dictionary, max_positions: int):
        super().__init__(max_positions, len(dictionary))
        self.continuations = continuations  # source tokens (tuple) -> greedy output with EOS
        self.pad, self.eos = dictionary.pad(), dictionary.eos()

    def start(self, net_input, verifier_encoder_out):
        sources = net_input["src_tokens"]
        outputs = [self.continuations[tuple(row[row.ne(self.pad)].tolist())] for row in sources]
        known = sources.new_full((len(outputs), max(map(len, outputs)) + 1), self.eos)
        for row, output in enumerate(outputs):
            known[row, : len(output)] = output
        return {"outputs": known}

    def propose(self, state, tokens, lengths, plan, generator):
        # tokens[b, 1 : lengths[b] + 1] are the first lengths[b] output tokens: draft the next k
        known = state["outputs"]
        index = lengths.unsqueeze(1) + torch.arange(plan.depth, device=lengths.device)
        return chain(known.gather(1, index.clamp(max=known.size(1) - 1)))

    def select_rows(self, state, rows):
        state["outputs"] = state["outputs"].index_select(0, rows)


class PhaseTimer:
    """Seconds spent in each phase of the speculative loop, by wrapping the methods that make up
    each phase on one generator and its verifier and drafter."""

    PHASES = {
        "encode": [("verifier", "encode"), ("verifier", "start"), ("drafter", "start")],
        "draft": [("drafter", "propose")],
        "score": [("verifier", "score_logits")],
        "accept": [("generator", "accept"), ("generator", "constrain")],
        "commit": [("verifier", "commit"), ("drafter", "commit"), ("verifier", "select_rows"),
                   ("drafter", "select_rows")],
    }  # fmt: skip

    def __init__(self, generator: SpeculativeGenerator):
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        # generators of one pair share its drafter adapter: each timer wraps a copy of its own
        generator.drafter = copy.copy(generator.drafter)
        owners = {"generator": generator, "verifier": generator.verifier, "drafter": generator.drafter}
        for phase, methods in self.PHASES.items():
            for owner, method in methods:
                self._wrap(owners[owner], method, phase)

    def _wrap(self, owner, method: str, phase: str):
        original = getattr(owner, method)

        def timed(*args, **kwargs):
            start = now()
            result = original(*args, **kwargs)
            self.seconds[phase] += now() - start
            return result

        setattr(owner, method, timed)


def greedy_steps(pair, outputs, tokens, batch_size) -> int:
    """Decoder steps fairseq's greedy search ran: per batch, the longest output (EOS included)."""
    return sum(max(outputs[line].numel() for line in lines) for lines, _ in pair.batches(tokens, batch_size))


def greedy_alone(pair, tokens):
    """The verifier's greedy translation of each sentence alone: what lossless decoding must
    give."""
    return decode_all(pair, {"greedy": fairseq_generator(pair, 1)}, tokens, 1)["greedy"]["tokens"]


def oracle(pair, tokens, alone, block: int) -> SpeculativeGenerator:
    """Lossless decoding with the OracleDrafter of these sentences' greedy translations."""
    generator = speculating(pair, block_size=block)
    continuations = {tuple(t.tolist()): out for t, out in zip(tokens, alone)}
    generator.drafter = OracleDrafter(continuations, pair.tgt_dict,
                                      pair.verifier.decoder.max_positions())  # fmt: skip
    return generator


def acceptance(args):
    """Where draft chains break: P(position i accepted | position i-1 accepted) for the drafter
    (lossless, and the reference top-beta/tau) and the oracle at k = --block, overall, by source
    length and by the kind of token the verifier wanted (diagnosis.py)."""
    pair = load_pair(args)
    src = read_lines(args.src, args.lines)
    tokens = pair.encode(src)
    systems = {
        "drafter, lossless": speculating(pair, block_size=args.block),
        f"drafter, beta {args.beta} tau {args.tau:g}": speculating(
            pair, block_size=args.block, beta=args.beta, tau=args.tau),
        "oracle, lossless": oracle(pair, tokens, greedy_alone(pair, tokens), args.block),
    }  # fmt: skip
    source_lengths = [t.numel() - 1 for t in tokens]  # without EOS
    eos = pair.tgt_dict.eos()
    tables = {}
    for name, generator in systems.items():
        table = diagnosis.AcceptanceTable()
        with torch.inference_mode():
            for lines, sample in pair.batches(tokens, args.batch_size):
                trace = []
                generator.generate([pair.verifier], sample, trace=trace)
                table.add(trace, [source_lengths[line] for line in lines],
                          pair.tgt_dict.__getitem__, eos)  # fmt: skip
        tables[name] = table.as_dict()
    print("\n".join(diagnosis.markdown(tables, min(args.block, 10))))
    if args.json:
        result = {"environment": environment(args), "block": args.block, "systems": tables}
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


def ceiling(args):
    """Fairseq greedy against speculative lossless decoding with the oracle drafter (the ceiling
    of the loop) and with the real drafter, per batch size, with each iteration's cost in greedy
    steps split into draft, score, accept and commit; with --ref, each system's BLEU."""
    pair = load_pair(args)
    src = read_lines(args.src, args.lines)
    refs = read_lines(args.ref, args.lines) if args.ref else None
    tokens = pair.encode(src)
    greedy = fairseq_generator(pair, 1)
    alone = greedy_alone(pair, tokens)
    dictionary = pair.tgt_dict
    ctranslate2 = ctranslate2_runs(args) if args.ctranslate2 else {}
    greedy_text = [dictionary.string(t) for t in alone]  # CTranslate2 gives pieces, not ids
    rows = []
    for batch_size in args.batch_sizes:
        systems = {"fairseq greedy": greedy,
                   "spec-nmt greedy (no drafts)": pair.generator(block_size=0),
                   "spec lossless, oracle drafter": oracle(pair, tokens, alone, args.block),
                   "spec lossless, real drafter": speculating(pair, block_size=args.block),
                   "spec-nmt defaults": defaults(pair)}  # fmt: skip
        if args.beam5:
            systems["fairseq beam5"] = fairseq_generator(pair, 5)
        for block in args.lossless_blocks:
            systems[f"spec lossless, real drafter k={block}"] = speculating(pair, block_size=block)
        if args.top_beta:
            block, beta, tau = args.top_beta
            systems[f"spec k={block} beta={beta} tau={tau}"] = speculating(
                pair, block_size=block, beta=beta, tau=tau
            )
        if args.tree_branching:
            systems[f"spec lossless, real drafter, tree {args.tree_branching}"] = speculating(
                pair, tree_branching=args.tree_branching
            )
        for width, depth in args.beam_trees:
            systems[f"spec lossless, real drafter, beam tree {width}x{depth}"] = speculating(
                pair, block_size=depth, tree_budget=width * depth
            )
        decode_all(pair, systems, tokens[: args.warmup_lines], batch_size)  # warm-up, untimed
        speculative = [name for name, g in systems.items() if isinstance(g, SpeculativeGenerator)]
        # On a GPU the phase timers wait for the GPU at every phase, which would slow the timed
        # run: there the breakdown comes from a second run of the speculative systems.
        separate = pair.device.type == "cuda"
        if not separate:
            timers = {name: PhaseTimer(systems[name]) for name in speculative}
        results = decode_all(pair, systems, tokens, batch_size)
        broken_down = results
        if separate:
            timers = {name: PhaseTimer(systems[name]) for name in speculative}
            broken_down = decode_all(pair, {name: systems[name] for name in speculative}, tokens,
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
            if name in timers:
                calls = systems[name].stats.batched_verifier_calls
                row["tokens_per_verifier_call"] = result["tokens_per_verifier_call"]
                row["greedy_steps_per_iteration"] = round(result["seconds"] / calls / step, 2)
                for phase, seconds in timers[name].seconds.items():
                    row[f"{phase}_greedy_steps"] = round(seconds / calls / step, 2)
                untimed = broken_down[name]["seconds"] - sum(timers[name].seconds.values())
                row["other_greedy_steps"] = round(untimed / calls / step, 2)
            elif name == "fairseq greedy":
                row["greedy_step_ms"] = round(1000 * step, 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
        fairseq_ms = 1000 * base["seconds"] / output_tokens
        for compute_type, report in ctranslate2.items():
            run_ = report[str(batch_size)]
            ms = 1000 * run_["seconds"] / run_["output_tokens"]
            rows.append({"batch_size": batch_size, "system": f"CTranslate2 {report['ctranslate2']} greedy {compute_type}",
                         "ctranslate2_threads": run_["threads"],
                         "ms_per_output_token": round(ms, 2), "speedup_vs_greedy": round(fairseq_ms / ms, 2),
                         "identical_to_greedy": sum(a == b for a, b in zip(run_["outputs"], greedy_text))})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    result = {"mode": "ceiling", "lines": len(src), "max_len": f"{MAX_LEN_A}*src_len+{MAX_LEN_B}",
              "environment": environment(args), "rows": rows}  # fmt: skip
    print(ceiling_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


# decoder inputs committed before the timed blocks: a sentence part-way through
BLOCK_COST_PREFIX = 20


def block_cost(args):
    """Seconds per verifier call scoring W new entries after a committed prefix, per batch size
    (the first batch-size lines of --src), relative to W = 1. With --compile, the same calls of
    the scorer compiled by torch.compile (inductor) alternate with the eager ones."""
    pair = load_pair(args)
    tokens = pair.encode(read_lines(args.src, args.lines))
    scorers = {"eager": BlockScorer(pair.verifier)}
    if args.compile:
        compiled = BlockScorer(pair.verifier)
        # dynamic: block widths, cache lengths and batch sizes change from call to call
        compiled.score_logits = torch.compile(compiled.score_logits, dynamic=True)
        scorers["compiled"] = compiled
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

            seconds, first_call = {}, {}
            for width in args.widths:
                block = torch.randint(*symbols, (batch_size, width))
                first = {name: call(name, block) for name in scorers}
                first_call[width] = {name: first[name][0] for name in scorers}
                for _ in range(2):  # warm-up calls
                    for name in scorers:
                        call(name, block)
                seconds[width] = dict.fromkeys(scorers, 0.0)
                for _ in range(args.repeats):
                    for name in scorers:
                        seconds[width][name] += call(name, block)[0]
                if args.compile:
                    difference = (first["compiled"][1] - first["eager"][1]).abs().max()
                    first_call[width]["difference"] = float(difference)
            one = seconds[min(args.widths)]["eager"]
            for width, total in seconds.items():
                eager = total["eager"]
                row = {"batch_size": batch_size, "width": width,
                       "ms_per_call": round(1000 * eager / args.repeats, 3),
                       "cost_vs_narrowest": round(eager / one, 2),
                       "entries_per_narrowest_cost": round(width * one / eager, 2)}  # fmt: skip
                if args.compile:
                    row.update({
                        "compiled_ms_per_call": round(1000 * total["compiled"] / args.repeats, 3),
                        "compiled_vs_eager": round(total["compiled"] / eager, 2),
                        "compiled_first_call_s": round(first_call[width]["compiled"], 2),
                        "compiled_max_abs_logit_difference": first_call[width]["difference"],
                    })  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {"mode": "block-cost", "prefix": BLOCK_COST_PREFIX, "repeats": args.repeats,
              "environment": environment(args), "rows": rows}  # fmt: skip
    columns = [("batch_size", "batch"), ("width", "W"), ("ms_per_call", "ms per call"),
               ("cost_vs_narrowest", "cost (× narrowest W)"),
               ("entries_per_narrowest_cost", "entries per narrowest-W cost")]  # fmt: skip
    if args.compile:
        columns += [("compiled_ms_per_call", "compiled: ms per call"),
                    ("compiled_vs_eager", "compiled ÷ eager"),
                    ("compiled_first_call_s", "compiled: first call (s)"),
                    ("compiled_max_abs_logit_difference", "largest logit difference")]  # fmt: skip
    print(table(columns, rows))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


def ctranslate2_runs(args):
    """The verifier converted with CTranslate2's fairseq converter, greedy in fp32 and int8, each
    timed in a process of its own (benchmarks/ctranslate2_greedy.py; never beside torch), with its
    faster thread count (1 or torch's) per batch size."""
    bin_dir = Path(sys.executable).parent
    reports = {}
    with tempfile.TemporaryDirectory() as converted:
        subprocess.run(
            [str(bin_dir / "ct2-fairseq-converter"), "--model_path", str(args.model_dir / "verifier.pt"),
             "--data_dir", str(args.model_dir), "--source_lang", "de", "--target_lang", "en",
             "--output_dir", converted, "--force"],
            check=True, capture_output=True,
        )  # fmt: skip
        for compute_type in ("float32", "int8"):
            # its best thread count per batch size: on 2 vCPUs one intra-op thread was up to 9x
            # faster than two at batch 1
            for threads in sorted({1, torch.get_num_threads()}):
                out = subprocess.run(
                    [sys.executable, str(Path(__file__).parent / "ctranslate2_greedy.py"), converted,
                     str(args.model_dir / "spm.model"), "--src", str(args.src),
                     "--lines", str(args.lines or 10**9), "--warmup-lines", str(args.warmup_lines),
                     "--batch-sizes", ",".join(map(str, args.batch_sizes)),
                     "--compute-type", compute_type, "--threads", str(threads),
                     "--max-len-a", str(MAX_LEN_A), "--max-len-b", str(MAX_LEN_B)],
                    check=True, capture_output=True, text=True,
                ).stdout  # fmt: skip
                report = json.loads(out)
                best = reports.setdefault(compute_type, {"ctranslate2": report["ctranslate2"]})
                for batch_size in map(str, args.batch_sizes):
                    run_ = dict(report[batch_size], threads=threads)
                    if batch_size not in best or run_["seconds"] < best[batch_size]["seconds"]:
                        best[batch_size] = run_
    return reports


def table(columns, rows):
    """Markdown table of ``rows`` (dicts) with ``columns`` [(key, title)]; "–" where a row has no
    value."""
    lines = ["| " + " | ".join(title for _, title in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(key, "–")) for key, _ in columns) + " |")
    return "\n".join(lines)


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


def beam_shape(text):
    """WIDTHxDEPTH (e.g. 3x4, both at least 1) → (width, depth)."""
    try:
        width, depth = (int(x) for x in text.split("x"))
    except ValueError:
        width = depth = 0
    if min(width, depth) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not WIDTHxDEPTH (e.g. 3x4)")
    return width, depth


def tree_nodes(plan: DraftPlan) -> int:
    """Drafted tokens per verifier call (the verifier's budget beyond the pending token)."""
    if plan.beam_width:
        return plan.beam_width * plan.beam_depth
    return sum(itertools.accumulate(plan.branching, lambda a, b: a * b))


def sampling(args):
    """Sampling systems at each temperature: block efficiency and batch-1 wall time."""
    pair = load_pair(args)
    src = read_lines(args.src, args.lines)
    refs = read_lines(args.ref, args.lines)
    tokens = pair.encode(src)
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
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


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


def setting(text):
    """K:BETA:TAU (e.g. 10:3:1.0) → (k, beta, tau)."""
    try:
        k, beta, tau = text.split(":")
        return int(k), int(beta), float(tau)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not K:BETA:TAU (e.g. 10:3:1.0)") from None


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


def comma_list(kind):
    """An argparse type: comma-separated values of ``kind``."""

    def parse(text):
        return [kind(x) for x in text.split(",")]

    parse.__name__ = f"comma-separated {kind.__name__}"  # argparse names it in its errors
    return parse


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["sweep", "run", "sampling", "ceiling", "block-cost",
                                         "acceptance"])  # fmt: skip
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--src", required=True, help="raw source sentences, one per line")
    parser.add_argument("--ref", default=None, help="raw reference translations (not for ceiling)")
    parser.add_argument("--lines", type=int, default=None, help="use only the first N lines")
    parser.add_argument("--drafter-precision", choices=DRAFTER_PRECISION_NAMES,
                        default=DEFAULT_DRAFTER_PRECISION,
                        help="the drafter's feed-forward and output layers in int8 or fp32; "
                        "auto: int8 on the CPU")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help="sentences per batch in the throughput run")
    parser.add_argument("--latency-lines", type=int, default=100, help="timed batch-1 sentences")
    parser.add_argument("--warmup-lines", type=int, default=5, help="untimed batch-1 sentences first")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the models run (timings wait for the GPU to finish)")
    parser.add_argument("--fp16", action="store_true",
                        help="the models in fp16, as fairseq's --fp16 (with --device cuda)")
    parser.add_argument("--blocks", type=comma_list(int), default=[2, 3, 5, 10], help="sweep: block sizes k")
    parser.add_argument("--betas", type=comma_list(int), default=[1, 3, 5], help="sweep: beta values")
    parser.add_argument("--taus", type=comma_list(float), default=[0.0, 1.0, 2.0], help="sweep: tau values")
    parser.add_argument("--settings", type=comma_list(setting), default=None,
                        help="sweep: explicit k:beta:tau list instead of the product, e.g. 5:1:0,10:3:1")
    parser.add_argument("--lossless-block", type=int, default=DEFAULTS.block_size, help="run: k of the lossless system")
    parser.add_argument("--block", type=int, default=DEFAULTS.block_size, help="run: k of the top-beta/tau system; ceiling: k")
    parser.add_argument("--beta", type=int, default=REFERENCE_TOP_BETA.beta, help="run: beta of the top-beta/tau system")
    parser.add_argument("--tau", type=float, default=REFERENCE_TOP_BETA.tau, help="run: tau of the top-beta/tau system")
    parser.add_argument("--tree-branching", default=None,
                        help="run, ceiling: also decode with a greedy draft tree of this shape "
                        "(e.g. 3,1,1), lossless (and in run with --beta/--tau)")
    parser.add_argument("--beam-trees", type=comma_list(beam_shape), default=[],
                        help="run, ceiling: also decode with greedy draft trees grown by beam "
                        "search, WIDTHxDEPTH each (e.g. 3x4: --block-size 4 --tree-budget 12)")
    parser.add_argument("--output-dir", default=None, help="run: write each system's translations here")
    parser.add_argument("--json", default=None, help="write the results as JSON to this file")
    parser.add_argument("--drafter", default=None, help="drafter checkpoint instead of MODEL_DIR/drafter.pt")
    parser.add_argument("--temperatures", type=comma_list(float), default=[1.0, 0.7],
                        help="sampling: temperatures")
    parser.add_argument("--systems", type=comma_list(sampling_system),
                        default=[sampling_system(x) for x in ("chain:6", "rsd-c:2-1-1", "rsd-s:2x3")],
                        help="sampling: chain:K, rsd-c:B1-B2-..., rsd-s:WIDTHxDEPTH")
    parser.add_argument("--batch-sizes", type=comma_list(int), default=[1, 32, 64],
                        help="ceiling, block-cost: batch sizes to measure")
    parser.add_argument("--widths", type=comma_list(int), default=[1, 2, 4, 8, 11, 16, 26],
                        help="block-cost: block widths W (entries scored per verifier call)")
    parser.add_argument("--repeats", type=int, default=50, help="block-cost: timed calls per width")
    parser.add_argument("--compile", action="store_true",
                        help="block-cost: also time the scorer compiled with torch.compile")
    parser.add_argument("--beam5", action="store_true", help="ceiling: add fairseq beam 5")
    parser.add_argument("--lossless-blocks", type=comma_list(int), default=[],
                        help="ceiling: add the real drafter, lossless, at each of these k")
    parser.add_argument("--top-beta", type=setting, default=None,
                        help="ceiling: add the real drafter with this K:BETA:TAU (e.g. 5:3:1)")
    parser.add_argument("--ctranslate2", action="store_true",
                        help="ceiling: add CTranslate2 greedy rows (fp32, int8) of the same verifier "
                        "(pip install ctranslate2)")
    args = parser.parse_args()
    if args.mode not in ("ceiling", "block-cost", "acceptance") and args.ref is None:
        parser.error(f"{args.mode} needs --ref")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    modes = {"sweep": sweep, "run": run, "sampling": sampling, "ceiling": ceiling,
             "block-cost": block_cost, "acceptance": acceptance}  # fmt: skip
    modes[args.mode](args)


if __name__ == "__main__":
    main()
