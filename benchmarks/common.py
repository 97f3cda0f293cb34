"""What every benchmark mode shares: the model pair, the systems it compares (fairseq's own
generators, the speculative ones, the oracle), decoding and timing them alike, BLEU, the
environment record and the flag parsers."""

import argparse
import contextlib
import copy
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# first: it imports fairseq without its INFO hints, registers the task and model and lets fairseq
# checkpoints load
import spec_nmt.plugin  # noqa: F401  isort: skip
import sacrebleu
import torch
from fairseq.search import Sampling
from fairseq.sequence_generator import SequenceGenerator

from spec_nmt.decoding.drafter import NoDrafter
from spec_nmt.decoding.loop import DecodingStats, SpeculativeGenerator
from spec_nmt.decoding.tree import chain
from spec_nmt.drafters.twin_drafter import load_twin
from spec_nmt.errors import SpecNmtError
from spec_nmt.settings import DEFAULTS
from spec_nmt.translator import SpecTranslator

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


def speculating(pair: SpecTranslator, drafter: str = "file", **settings) -> SpeculativeGenerator:
    """A generator that drafts in a batch of any size: what the benchmark measures (by default
    the lossless and sampling rules draft for one sentence only, see ``defaults``), with the
    pair's drafter file (``drafter`` "file": the real drafter of every mode) or the verifier's
    twin ("twin"), whichever --drafter auto would pick for the rule."""
    generator = pair.generator(max_draft_batch=0, **settings)
    twin = getattr(pair.drafter, "twin", None)
    if drafter == "file" and twin is not None and generator.drafter is twin:  # (auto's pick)
        generator.drafter = pair.drafter
    elif drafter == "twin" and generator.plan.depth:
        if twin is None:
            raise SystemExit("no twin drafter here (ctranslate2 missing, or a GPU)")
        generator.drafter = twin
    return generator


def twin_engine(pair: SpecTranslator, engine: str) -> SpeculativeGenerator:
    """``speculating`` with a twin of the pair's verifier run by ``engine`` (twin_drafter.ENGINES:
    "process", "worker")."""
    generator = speculating(pair, "twin")
    twin = generator.drafter
    generator.drafter = load_twin(pair.verifier, pair.src_dict, pair.tgt_dict,
                                  twin.max_positions(), twin.directory.parent, engine)
    return generator


def other_loop(pair: SpecTranslator) -> str:
    """The decoding loop the defaults do not take on the pair's device (``--decoding-loop
    auto``: static on a GPU, dynamic on the CPU), timed beside them."""
    return "dynamic" if pair.device.type == "cuda" else "static"


def defaults(pair: SpecTranslator) -> SpeculativeGenerator:
    """The generator with every setting at its default, as ``make translate`` decodes."""
    return pair.generator()


def load_pair(args) -> SpecTranslator:
    return SpecTranslator.from_pretrained(args.model_dir, args.drafter_path, device=args.device,
                                          drafter_precision=args.drafter_precision,
                                          dtype=dtype(args))  # fmt: skip


def load_inputs(args):
    """(pair, source lines, reference lines or None, source token ids): what every mode reads."""
    pair = load_pair(args)
    src = read_lines(args.src, args.lines)
    refs = read_lines(args.ref, args.lines) if args.ref else None
    return pair, src, refs, pair.encode(src)


def write_result(args, result: dict) -> None:
    """The mode's result as JSON to --json, when given."""
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


def commit() -> str:
    """The checkout's commit (with "+changes" when the tree differs from it), or "?"."""
    def git(*command):
        return subprocess.run(["git", *command], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()  # fmt: skip

    found = git("rev-parse", "--short", "HEAD") or "?"
    return found + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def dtype(args) -> torch.dtype:
    return torch.float16 if args.fp16 else torch.float32


def now() -> float:
    """time.perf_counter() once the GPU has done what was queued: CUDA calls return before
    their kernels finish."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def look_ahead(systems, samples) -> None:
    """Tell every speculative system the batches it decodes next, as the translator does (the
    twin drafts first continuations for several sentences at once), each with a drafter state
    of its own: systems that share the pair's twin would otherwise share its drafts ahead."""
    for generator in systems.values():
        if isinstance(generator, SpeculativeGenerator):
            if hasattr(generator.drafter, "draft_ahead"):
                generator.drafter = copy.copy(generator.drafter)  # (draft_ahead resets its own)
            generator.look_ahead(samples)


def decode_all(pair, systems, tokens, batch_size, rotation_offset=0, ahead=True):
    """Run every system on every batch, rotating the order per batch. Returns per system:
    outputs (token tensors by line), seconds in total, and speculative statistics. ``ahead``:
    the systems are told the batches first (``look_ahead``)."""
    results = {name: {"tokens": [None] * len(tokens), "seconds": 0.0} for name in systems}
    for name, generator in systems.items():
        if isinstance(generator, SpeculativeGenerator):
            generator.stats = DecodingStats()
    names = list(systems)
    if not names:
        return results
    batches = list(pair.batches(tokens, batch_size))
    if ahead:
        look_ahead(systems, [sample for _, sample in batches])
    with torch.inference_mode():
        for batch_number, (lines, sample) in enumerate(batches):
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
    return text_bleu(hyps, refs) + (hyps,)


def text_bleu(hyps, refs):
    """(sacreBLEU of detokenized hypotheses, its signature)."""
    metric = sacrebleu.BLEU()
    score = metric.corpus_score(hyps, [refs])
    return round(score.score, 2), str(metric.get_signature())


def read_lines(path, limit=None):
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f]
    except OSError as error:
        raise SpecNmtError(f"cannot read {path}: {error.strerror}") from None
    return lines[:limit] if limit else lines


def cpu_model() -> str:
    """The CPU's model name as ``lscpu`` gives it (else what Python knows)."""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        return next(line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                    if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def drafted_in(drafter) -> str:
    """What the drafter drafts in (loading.drafter_precision decided it), and in what the
    relaxed rule's rows drafted where that differs (its fp32 copy, loading.load_drafter)."""
    copy = getattr(drafter, "fp32_copy", None)
    if copy is None:
        return drafter.precision
    return f"{drafter.precision} (relaxed top-beta/tau: {copy.precision})"


def environment(args, pair: SpecTranslator):
    """Where and how a run measured: the machine, the versions, the precisions (the drafter's
    as loaded) and the command."""
    cpu = cpu_model()
    import fairseq

    found = {
        "device": args.device,
        "cpu": cpu,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "fairseq": fairseq.__version__,
        "python": platform.python_version(),
        "dtype": "fp16" if args.fp16 else "fp32",
        "drafter_precision": drafted_in(pair.drafter),
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
    look_ahead(systems, [sample for line in tokens for _, sample in pair.batches([line], 1)])
    for i, line_tokens in enumerate(tokens):
        one = decode_all(pair, systems, [line_tokens], 1, rotation_offset=i, ahead=False)
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


class OracleDrafter(NoDrafter):
    """A drafter that knows the verifier's greedy translation of every sentence and proposes its
    next k tokens. Every draft passes the lossless rule and drafting costs next to nothing, so
    speculative decoding with it measures the ceiling of the loop itself. Like ``NoDrafter`` it
    reads no source and keeps nothing at commit."""

    def __init__(self, continuations, dictionary, max_positions: int):
        super().__init__(max_positions, len(dictionary))
        self.continuations = continuations  # source tokens (tuple) -> greedy output with EOS
        self.pad, self.eos = dictionary.pad(), dictionary.eos()

    def start(self, net_input, verifier_encoder_out, verifier_state=None):
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

    # its static form (drafter.StaticDrafter): the same drafts from a buffer
    def static_form(self):
        return self

    def buffers(self, batch, source_length: int, masked_source: bool):
        return torch.full_like(batch.tokens, self.eos)

    def fill(self, batch, net_input, encoder_out):
        known = self.start(net_input, encoder_out)["outputs"]
        width = min(known.size(1), batch.drafter.size(1))
        batch.drafter.fill_(self.eos)
        batch.drafter[:, :width] = known[:, :width]

    def draft(self, batch):
        index = batch.lengths.unsqueeze(1) + batch.offsets[: batch.k]
        return batch.drafter.gather(1, index.clamp(max=batch.drafter.size(1) - 1))

    def observe(self, batch, states, emitted, counts):
        """Nothing: it knows the outputs."""

    def current(self):
        return True  # (it has no weights)


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


def oracle(pair, tokens, alone, block: int, whole: bool = False,
           **settings) -> SpeculativeGenerator:  # fmt: skip
    """Lossless decoding with the OracleDrafter of these sentences' greedy translations: k
    drafts per iteration, or (``whole``) the rest of the sentence, as the twin drafts."""
    generator = speculating(pair, block_size=block, **settings)
    continuations = {tuple(t.tolist()): out for t, out in zip(tokens, alone)}
    generator.drafter = OracleDrafter(continuations, pair.tgt_dict,
                                      pair.verifier.decoder.max_positions())  # fmt: skip
    generator.drafter.drafts_continuations = whole
    return generator


def table(columns, rows):
    """Markdown table of ``rows`` (dicts) with ``columns`` [(key, title)]; "–" where a row has no
    value."""
    lines = ["| " + " | ".join(title for _, title in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(key, "–")) for key, _ in columns) + " |")
    return "\n".join(lines)


def comma_list(kind):
    """An argparse type: comma-separated values of ``kind``."""

    def parse(text):
        return [kind(x) for x in text.split(",")]

    parse.__name__ = f"comma-separated {kind.__name__}"  # argparse names it in its errors
    return parse


def setting(text):
    """K:BETA:TAU (e.g. 10:3:1.0) → (k, beta, tau)."""
    try:
        k, beta, tau = text.split(":")
        return int(k), int(beta), float(tau)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not K:BETA:TAU (e.g. 10:3:1.0)") from None


def stopped_chain(text):
    """K:P (e.g. 8:0.5) → (k, draft stop p)."""
    try:
        k, stop = text.split(":")
        return int(k), float(stop)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not K:P (e.g. 8:0.5)") from None


def beam_shape(text):
    """WIDTHxDEPTH (e.g. 3x4, both at least 1) → (width, depth)."""
    try:
        width, depth = (int(x) for x in text.split("x"))
    except ValueError:
        width = depth = 0
    if min(width, depth) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not WIDTHxDEPTH (e.g. 3x4)")
    return width, depth


@contextlib.contextmanager
def ctranslate2_verifier(model_dir: Path):
    """The directory of the verifier converted by CTranslate2's fairseq converter, for the
    duration of the block."""
    converter = Path(sys.executable).parent / "ct2-fairseq-converter"
    with tempfile.TemporaryDirectory() as converted:
        subprocess.run(
            [str(converter), "--model_path", str(model_dir / "verifier.pt"),
             "--data_dir", str(model_dir), "--source_lang", "de", "--target_lang", "en",
             "--output_dir", converted, "--force"],
            check=True, capture_output=True,
        )  # fmt: skip
        yield converted


def ctranslate2_timed(args, converted: str, src, lines, batch_sizes, compute_type: str,
                      temperature: float = 0.0) -> dict:  # fmt: skip
    """CTranslate2 decoding of the first ``lines`` of ``src`` (all: None) at each batch size,
    greedy or (``temperature`` > 0) sampling, timed by benchmarks/ctranslate2_decoding.py in a
    process of its own (never beside torch), with --warmup-lines untimed first. Each batch size
    keeps its faster thread count, 1 or torch's: on two vCPUs one thread can win at batch 1.
    Returns {"ctranslate2": version, "BATCH SIZE": {seconds, output_tokens, outputs, threads}}."""
    best = {}
    for threads in sorted({1, torch.get_num_threads()}):
        out = subprocess.run(
            [sys.executable, str(Path(__file__).parent / "ctranslate2_decoding.py"), converted,
             str(args.model_dir / "spm.model"), "--src", str(src), "--lines", str(lines or 10**9),
             "--warmup-lines", str(args.warmup_lines),
             "--batch-sizes", ",".join(map(str, batch_sizes)), "--compute-type", compute_type,
             "--threads", str(threads), "--max-len-a", str(MAX_LEN_A),
             "--max-len-b", str(MAX_LEN_B), "--sampling-temperature", str(temperature)],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        report = json.loads(out)
        best.setdefault("ctranslate2", report["ctranslate2"])
        for batch_size in map(str, batch_sizes):
            run_ = dict(report[batch_size], threads=threads)
            if batch_size not in best or run_["seconds"] < best[batch_size]["seconds"]:
                best[batch_size] = run_
    return best
