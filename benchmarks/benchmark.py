#!/usr/bin/env python3
r"""BLEU and speed of speculative decoding against fairseq's own decoding of the same verifier.

Choose the setting on the validation set (never on test):

    python benchmarks/benchmark.py sweep MODEL_DIR --src valid.de --ref valid.en \
        --blocks 2,3,5,10 --betas 1,3,5 --taus 0,1,2,3 --lines 500 --latency-lines 100

then measure it on test:

    python benchmarks/benchmark.py run MODEL_DIR --src test.de --ref test.en \
        --lossless-block 3 --block 5 --beta 3 --tau 1 --latency-lines 200 \
        --json benchmarks/results/run-newstest2014.json

Sampling (speculative sampling vs RSD-C vs RSD-S vs fairseq's --sampling --beam 1 and the
drafter-less loop; --ctranslate2 adds CTranslate2 int8 sampling), per temperature, with systems
named kind:shape (chain:K, rsd-c:B1-B2-..., rsd-s:WIDTHxDEPTH):

    python benchmarks/benchmark.py sampling MODEL_DIR --src test.de --ref test.en \
        --temperatures 1.0,0.7 --systems chain:6,rsd-c:2-1-1,rsd-s:2x3 --json benchmarks/results/sampling.json

The ceiling of the loop (an oracle drafter that proposes the verifier's own greedy translation,
so every draft is accepted), the real drafter, and each iteration's cost in greedy steps split into
draft, score, accept and commit, per batch size:

    python benchmarks/benchmark.py ceiling MODEL_DIR --src valid.de --lines 64 --block 10 \
        --batch-sizes 1,32,64 --ctranslate2 --json benchmarks/results/ceiling.json

(--ctranslate2 adds the verifier converted with CTranslate2, greedy in fp32 and int8, each run in
a process of its own by benchmarks/ctranslate2_decoding.py.) On a GPU, with beam 5, lossless at
several k, top-beta/tau and BLEU (what scripts/gpu_check.sh runs):

    python benchmarks/benchmark.py ceiling MODEL_DIR --src test.de --ref test.en --lines 256 \
        --batch-sizes 8,32,128 --device cuda --fp16 --beam5 --lossless-blocks 2,5,10 --top-beta 5:3:1

What scoring a block of W entries costs the verifier against scoring one (a greedy step of the
same scorer), per batch size; if every draft were accepted, an iteration of k drafts would emit
k + 1 tokens for the cost of W = k + 1:

    python benchmarks/benchmark.py block-cost MODEL_DIR --src valid.de --widths 1,2,4,8,11,16,26 \
        --batch-sizes 1,32,64 --json benchmarks/results/block-cost.json

(--engines modules,eager,scripted,compiled: how the decoder layers run, timed in turn.)

Speed by verifier size (the bundled one, random transformer-base and -big), oracle drafters
accepting exactly a drafts per iteration, and batch size, at a fixed output length:

    python benchmarks/benchmark.py sizes MODEL_DIR --src test.de --lines 16 --batch-sizes 1,8 \
        --oracle-accepts 1,2,3,5 --json benchmarks/results/model-sizes-cpu.json

Where the static loop's time goes at batch 1 (each iteration timed alone, the rest per sentence,
and the device's work of eager iterations by operation), without drafts, with the oracle and with
the real drafter at each k:

    python benchmarks/benchmark.py static-cost MODEL_DIR --src test.de --lines 32 --device cuda \
        --blocks 3,5,10 --json benchmarks/results/static-cost.json

The products' kernels chosen as decoding runs them (each weight read from memory, the
default) against chosen with each weight in cache (CPU):

    python benchmarks/benchmark.py kernel-choice MODEL_DIR --src test.de --lines 100 --rounds 4 \
        --batch-sizes 1,8 --threads 1 --json benchmarks/results/kernel-choice.json

Where decoding makes the host wait for the GPU (CUDA's sync debug mode), per verifier call and
output token, with the lines that do it:

    python benchmarks/benchmark.py syncs MODEL_DIR --src test.de --lines 64 --device cuda \
        --batch-sizes 1,32 --json benchmarks/results/syncs.json

MODEL_DIR holds verifier.pt, drafter.pt, dict.{de,en}.txt and spm.model (scripts/export_model.py);
--drafter-path PATH replaces drafter.pt (e.g. an autoregressive drafter), as in spec-nmt-translate.
Systems: fairseq greedy and beam 5 (stock SequenceGenerator), speculative lossless (beta 1,
tau 0) and speculative top-beta/tau. BLEU is sacreBLEU on detokenized, cased output of the
large-batch run. Timing: each batch (or, for latency, each sentence) runs every system in a
rotating order, so slow phases of a noisy machine hit all systems alike; --warmup-lines
sentences are decoded untimed first (run, ceiling and sampling: the first ones of the latency
run; sweep: fairseq greedy on them before anything is timed). Ratios are speculative time over
fairseq time from the same process.
"""

import argparse
from pathlib import Path

import spec_nmt.plugin  # noqa: F401  isort: skip  (first: fairseq quiet, the plugin registered)
import torch
from ceiling import block_cost, ceiling
from common import beam_shape, comma_list, setting, stopped_chain
from diagnosis import acceptance
from host_syncs import host_syncs
from kernel_choice import kernel_choice
from model_sizes import ARCHITECTURES, model_sizes
from sampling_speed import sampling, sampling_system
from speed_quality import run, sweep
from static_cost import static_cost

from spec_nmt.options import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_DRAFTER_PRECISION,
    DRAFTER_PRECISION_HELP,
    DRAFTER_PRECISION_NAMES,
)
from spec_nmt.settings import DEFAULTS, REFERENCE_TOP_BETA


def common_flags() -> argparse.ArgumentParser:
    """The flags of every mode."""
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("model_dir", type=Path, help="verifier.pt, drafter.pt, dict.*.txt, spm.model")
    flags.add_argument("--src", required=True, help="raw source sentences, one per line")
    flags.add_argument("--lines", type=int, default=None, help="use only the first N lines")
    flags.add_argument("--drafter-path", default=None,
                       help="drafter checkpoint instead of MODEL_DIR/drafter.pt")
    flags.add_argument("--drafter-precision", choices=DRAFTER_PRECISION_NAMES,
                       default=DEFAULT_DRAFTER_PRECISION,
                       help=DRAFTER_PRECISION_HELP)
    flags.add_argument("--threads", type=int, default=None,
                       help="torch threads (default: all cores)")
    flags.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                       help="where the models run (timings wait for the GPU to finish)")
    flags.add_argument("--fp16", action="store_true",
                       help="the models in fp16, as fairseq's --fp16 (with --device cuda)")
    flags.add_argument("--json", default=None, help="write the results as JSON to this file")
    return flags


def add_modes(parser: argparse.ArgumentParser) -> None:
    modes = parser.add_subparsers(dest="mode", required=True, metavar="MODE")
    common = common_flags()

    def mode(name: str, function, help_text: str, ref: bool = False, batches: bool = False,
             latency: bool = False) -> argparse.ArgumentParser:  # fmt: skip
        sub = modes.add_parser(name, parents=[common], help=help_text, description=help_text)
        sub.set_defaults(function=function)
        sub.add_argument("--ref", required=ref, default=None,
                         help="raw reference translations" + ("" if ref else " (adds BLEU)"))
        if batches:
            sub.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                             help="sentences per batch in the throughput run")
        if latency:
            sub.add_argument("--latency-lines", type=int, default=100,
                             help="timed batch-1 sentences")
        sub.add_argument("--warmup-lines", type=int, default=5,
                         help="untimed sentences decoded first")
        return sub

    def reference_rule(sub, what: str) -> None:
        sub.add_argument("--block", type=int, default=DEFAULTS.block_size, help=f"{what}: k")
        sub.add_argument("--beta", type=int, default=REFERENCE_TOP_BETA.beta,
                         help="beta of the top-beta/tau system")
        sub.add_argument("--tau", type=float, default=REFERENCE_TOP_BETA.tau,
                         help="tau of the top-beta/tau system, in nats")

    def trees(sub) -> None:
        sub.add_argument("--tree-branching", default=None,
                         help="also decode with a greedy draft tree of this shape (e.g. 3,1,1)")
        sub.add_argument("--beam-trees", type=comma_list(beam_shape), default=[],
                         help="also decode with greedy draft trees grown by beam search, "
                         "WIDTHxDEPTH each (e.g. 3x4: --block-size 4 --tree-budget 12)")

    sub = mode("sweep", sweep, "choose k, beta and tau on the validation set", ref=True,
               batches=True, latency=True)
    sub.add_argument("--blocks", type=comma_list(int), default=[2, 3, 5, 10], help="block sizes k")
    sub.add_argument("--betas", type=comma_list(int), default=[1, 3, 5], help="beta values")
    sub.add_argument("--taus", type=comma_list(float), default=[0.0, 1.0, 2.0], help="tau values")
    sub.add_argument("--settings", type=comma_list(setting), default=None,
                     help="explicit k:beta:tau list instead of the product, e.g. 5:1:0,10:3:1")
    sub = mode("run", run, "BLEU and speed on test against fairseq greedy and beam 5", ref=True,
               batches=True, latency=True)
    reference_rule(sub, "the top-beta/tau system")
    sub.add_argument("--lossless-block", type=int, default=DEFAULTS.block_size,
                     help="k of the lossless system")
    trees(sub)
    sub.add_argument("--output-dir", default=None, help="write each system's translations here")
    sub = mode("sampling", sampling, "exact sampling rules against fairseq --sampling", ref=True,
               batches=True, latency=True)
    sub.add_argument("--temperatures", type=comma_list(float), default=[1.0, 0.7],
                     help="temperatures")
    sub.add_argument("--systems", type=comma_list(sampling_system),
                     default=[sampling_system(x) for x in ("chain:6", "rsd-c:2-1-1", "rsd-s:2x3")],
                     help="chain:K, rsd-c:B1-B2-..., rsd-s:WIDTHxDEPTH, twin (the twin's "
                     "continuations)")
    sub.add_argument("--ctranslate2", action="store_true",
                     help="add CTranslate2 int8 sampling of the same verifier")
    sub = mode("ceiling", ceiling, "the loop's ceiling, the iteration's cost and CTranslate2")
    reference_rule(sub, "the oracle and the real drafter")
    trees(sub)
    sub.add_argument("--batch-sizes", type=comma_list(int), default=[1, 32, 64],
                     help="batch sizes to measure")
    sub.add_argument("--beam5", action="store_true", help="add fairseq beam 5")
    sub.add_argument("--stock-modules", action="store_true",
                     help="add the drafter-less loop and the defaults with the decoder layers "
                     "run through fairseq's modules instead of the scripted layers (the "
                     "encoder stays scripted)")
    sub.add_argument("--lossless-blocks", type=comma_list(int), default=[],
                     help="add the real drafter, lossless, at each of these k")
    sub.add_argument("--top-beta", type=setting, default=None,
                     help="add the real drafter with this K:BETA:TAU (e.g. 5:3:1)")
    sub.add_argument("--draft-stops", type=comma_list(stopped_chain), default=[],
                     help="add the real drafter, lossless, at each K:P: at most k drafts, "
                     "--draft-stop P (e.g. 8:0.5); and at P with --top-beta's rule")
    sub.add_argument("--ctranslate2", action="store_true",
                     help="add CTranslate2 greedy rows (fp32, int8) of the same verifier")
    sub.add_argument("--no-phases", dest="phases", action="store_false",
                     help="no breakdown of the dynamic loop's iterations into phases (on a GPU "
                     "it takes a second run of those systems)")
    sub.add_argument("--headline", default=None,
                     help="write the batch-1 figures into this JSON (benchmarks/results/"
                     "headline.json: {\"gpu\": RUN, \"cpu\": RUN}), replacing this kind's run")
    sub = mode("block-cost", block_cost, "what scoring a block of W entries costs the verifier")
    sub.add_argument("--batch-sizes", type=comma_list(int), default=[1, 32, 64],
                     help="batch sizes to measure")
    sub.add_argument("--widths", type=comma_list(int), default=[1, 2, 4, 8, 11, 16, 26],
                     help="block widths W (entries scored per verifier call)")
    sub.add_argument("--repeats", type=int, default=50, help="timed calls per width")
    sub.add_argument("--engines", type=comma_list(str), default=["modules", "scripted"],
                     help="how the decoder layers run, each timed in turn: modules (the stock "
                     "fairseq modules), eager (one function of plain tensor operations), "
                     "scripted (that function in TorchScript: the default), compiled (that "
                     "function by torch.compile); the first is the reference. On a GPU every "
                     "engine runs the modules: decoding scripts the layers on the CPU only")
    sub = mode("syncs", host_syncs, "where decoding makes the host wait for the GPU (CUDA)")
    sub.add_argument("--block", type=int, default=DEFAULTS.block_size, help="the real drafter's k")
    sub.add_argument("--batch-sizes", type=comma_list(int), default=[1, 32],
                     help="batch sizes to measure")
    sub = mode("static-cost", static_cost, "where the static loop's time goes at batch 1")
    reference_rule(sub, "the oracle")
    sub.add_argument("--blocks", type=comma_list(int), default=[3, 5, 10],
                     help="the real drafter's k, each a system")
    sub = mode("kernel-choice", kernel_choice, "decoding with the products' kernels timed as "
               "decoding reads the weights against timed in cache")
    sub.add_argument("--blocks", type=comma_list(int), default=[0, 3],
                     help="k of each system (0: no drafts)")
    sub.add_argument("--rounds", type=int, default=4, help="timed rounds (the median counts)")
    sub.add_argument("--batch-sizes", type=comma_list(int), default=[1],
                     help="batch sizes to measure")
    sub = mode("sizes", model_sizes, "speed by verifier size, accepted drafts and batch size")
    sub.add_argument("--sizes", type=comma_list(str), default=["bundled", *ARCHITECTURES],
                     help=f"verifiers: bundled, and random ones of {', '.join(ARCHITECTURES)}")
    sub.add_argument("--oracle-accepts", type=comma_list(int), default=[1, 2, 3, 5],
                     help="oracle drafters getting exactly this many drafts accepted per iteration")
    sub.add_argument("--output-length", type=int, default=32,
                     help="tokens every sentence is decoded to, then EOS")
    sub.add_argument("--batch-sizes", type=comma_list(int), default=[1, 8],
                     help="batch sizes to measure")
    sub = mode("acceptance", acceptance, "where draft chains break: acceptance by position",
               batches=True)
    reference_rule(sub, "the drafts")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_modes(parser)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    args.function(args)


if __name__ == "__main__":
    main()
