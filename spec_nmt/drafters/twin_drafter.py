"""The verifier's own twin as its drafter: the verifier converted by CTranslate2 (int8 weights),
which drafts the greedy continuation of every row's verified prefix to the end of the sentence
in one call; the verifier then checks the whole continuation in one pass. The twin agrees with
the verifier on almost every token, so a sentence takes one or two iterations, and nothing is
trained: any fairseq Transformer a user brings has a twin (BENCHMARKS.md, "The twin drafter").

The twin is made once per verifier and kept under ``CACHE_DIR/twins/FINGERPRINT``, the
fingerprint hashing the verifier's weights, dictionaries, CTranslate2's version and the
quantization: a changed verifier gets a new twin, an unchanged one is never converted again.
A twin directory is trusted only when its manifest's hash of ``model.bin`` matches; a corrupt or
half-written one is made again.

The rules take its drafts as they take any chain. Its draft distribution is one-hot on its
token: top-beta/tau judges the tokens; speculative sampling accepts a draft with the verifier's
probability of it and otherwise samples the verifier's distribution without it (the residual),
so samples stay exact. RSD draws several distinct children per node from the drafter, which a
one-hot distribution cannot give: RSD and draft trees keep the drafter file.

CTranslate2 runs on the CPU only here (its wheel links CUDA 12's cuBLAS): a GPU keeps the
trained drafters.
"""

import copy
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import weakref
from collections import deque
from pathlib import Path
from typing import Deque, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from spec_nmt.decoding.drafter import finished_rows, pending_tokens
from spec_nmt.decoding.tree import DraftTree, chain
from spec_nmt.drafters.twin_worker import greedy_continuations
from spec_nmt.errors import SpecNmtError
from spec_nmt.files import CACHE_DIR
from spec_nmt.settings import DraftPlan

logger = logging.getLogger(__name__)

TWINS_DIR = CACHE_DIR / "twins"
QUANTIZATION = "int8"
MANIFEST = "spec-nmt-twin.json"


class TwinUnavailable(SpecNmtError):
    """The twin cannot be made or loaded here; the message is one line saying why."""


def fingerprint(model, source_dictionary, target_dictionary, quantization: str) -> str:
    """A hash of everything a twin is made from: the verifier's weights (names, dtypes, shapes
    and bytes), both dictionaries' symbols, CTranslate2's version and the quantization."""
    import ctranslate2

    digest = hashlib.sha256(f"{ctranslate2.__version__} {quantization}".encode())
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    for dictionary in (source_dictionary, target_dictionary):
        digest.update("\n".join(dictionary.symbols).encode())
    return digest.hexdigest()[:32]


def _file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def intact(directory: Path, key: str) -> bool:
    """Whether ``directory`` holds the whole twin of fingerprint ``key``."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        return manifest["fingerprint"] == key and manifest["model_sha256"] == _file_hash(
            directory / "model.bin")
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _converter(model, source_dictionary, target_dictionary):
    """CTranslate2's fairseq converter fed with a model in memory (its own reads a checkpoint
    file): the same specification, from a copy, since quantizing rewrites the tensors it was
    given in place."""
    from ctranslate2.converters import fairseq as fairseq_converter
    from ctranslate2.converters.converter import Converter

    class VerifierConverter(Converter):
        def _load(self):
            # (not .eval(): after fairseq's make_generation_fast_ it returns None)
            verifier = copy.deepcopy(model).float().cpu()
            args = getattr(verifier, "args", None) or verifier.cfg
            spec = fairseq_converter._get_model_spec(args)
            fairseq_converter.set_transformer_encoder(spec.encoder, verifier.encoder)
            fairseq_converter.set_transformer_decoder(spec.decoder, verifier.decoder)
            spec.register_source_vocabulary(fairseq_converter._get_vocab(source_dictionary))
            spec.register_target_vocabulary(fairseq_converter._get_vocab(target_dictionary))
            # fairseq starts the decoder with EOS and ends every source with one
            spec.config.decoder_start_token = spec.config.eos_token
            spec.config.add_source_eos = True
            return spec

    return VerifierConverter()


def twin_directory(model, source_dictionary, target_dictionary, twins: Optional[Path] = None,
                   quantization: str = QUANTIZATION) -> Path:  # fmt: skip
    """The directory of the verifier's twin under ``twins`` (default TWINS_DIR), converted now
    if it is missing or not whole."""
    twins = twins or TWINS_DIR
    key = fingerprint(model, source_dictionary, target_dictionary, quantization)
    directory = twins / key
    if intact(directory, key):
        return directory
    twins.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=twins))
    try:
        with torch.no_grad():
            _converter(model, source_dictionary, target_dictionary).convert(
                str(partial / "twin"), quantization=quantization, force=True)
        made = partial / "twin"
        manifest = {"fingerprint": key, "model_sha256": _file_hash(made / "model.bin")}
        (made / MANIFEST).write_text(json.dumps(manifest))
        shutil.rmtree(directory, ignore_errors=True)  # (a corrupt one)
        os.replace(made, directory)
    except (ValueError, NotImplementedError, KeyError, AttributeError, RuntimeError) as error:
        reason = " ".join(str(error).split())  # (CTranslate2 lists its reasons on lines)
        raise TwinUnavailable(f"CTranslate2 cannot convert this verifier: {reason}") from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    logger.info("made the verifier's CTranslate2 twin in %s", directory)
    return directory


# Runs of this many threads or more put CTranslate2 in a worker process of its own: in one
# process with torch, its OpenMP runtime and torch's slow each other down from two threads on
# (BENCHMARKS.md, "The twin drafter"); at one thread the process of its own only adds the pipe.
WORKER_FROM_THREADS = 2
WORKER_SCRIPT = Path(__file__).with_name("twin_worker.py")


class InProcess:
    """CTranslate2 in this process, beside torch."""

    def __init__(self, directory: Path, threads: int):
        import ctranslate2

        self.translator = ctranslate2.Translator(str(directory), device="cpu",
                                                 compute_type=QUANTIZATION, intra_threads=threads)

    def continuations(self, sources, prefixes, max_length: int) -> List[List[str]]:
        return greedy_continuations(self.translator, sources, prefixes, max_length)


class WorkerProcess:
    """CTranslate2 in a process of its own (twin_worker.py), asked over a pipe."""

    def __init__(self, directory: Path, threads: int):
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER_SCRIPT), str(directory), QUANTIZATION, str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "OMP_NUM_THREADS": str(threads)})  # fmt: skip
        weakref.finalize(self, _stop, self.process)
        if self.process.stdout.readline().strip() != "ready":
            raise TwinUnavailable("the twin's worker process did not start (its error is above)")

    def continuations(self, sources, prefixes, max_length: int) -> List[List[str]]:
        request = {"sources": sources, "prefixes": prefixes, "max_length": max_length}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise SpecNmtError("the twin's worker process ended (its error is above)")
        answer = json.loads(line)
        if isinstance(answer, dict):
            raise SpecNmtError(f"the twin's worker process: {answer['error']}")
        return answer


def _stop(process: subprocess.Popen) -> None:
    process.stdin.close()  # (it ends at the end of its input)
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()


ENGINES = {"process": InProcess, "worker": WorkerProcess}
# Sentences the twin drafts a first continuation for in one call when they are known ahead
# (TwinDrafter.draft_ahead): in batches of 4 to 16 a token cost it less than half what it costs
# one sentence at a time (BENCHMARKS.md, "The twin drafter").
DRAFT_AHEAD_ROWS = 8
# TwinDrafter.default_draft_batch per torch.backends.cpu.get_cpu_capability(); 4 on the others
DRAFT_BATCH_BY_CPU = {"AVX512": 8}


def load_twin(model, source_dictionary, target_dictionary, max_positions: int,
              twins: Optional[Path] = None,
              engine: Optional[str] = None) -> "TwinDrafter":  # fmt: skip
    """The twin drafter of a verifier model on the CPU, its twin made or taken from ``twins``,
    run with torch's thread count (--threads) in this process or a worker's (``engine``
    "process" or "worker"; by default as WORKER_FROM_THREADS says); TwinUnavailable (one
    line) where it cannot be."""
    if next(model.parameters()).device.type != "cpu":
        raise TwinUnavailable("the twin drafter runs on the CPU only (CTranslate2's wheel needs "
                              "CUDA 12's cuBLAS); the GPU drafts with the drafter file")
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        raise TwinUnavailable("ctranslate2 is not installed (pip install ctranslate2)") from None
    threads = torch.get_num_threads()
    if engine is None:
        engine = "worker" if threads >= WORKER_FROM_THREADS else "process"
    directory = twin_directory(model, source_dictionary, target_dictionary, twins)
    try:
        running = ENGINES[engine](directory, threads)
    except (RuntimeError, ValueError):  # whole by its hash, yet unreadable: made again
        shutil.rmtree(directory, ignore_errors=True)
        directory = twin_directory(model, source_dictionary, target_dictionary, twins)
        running = ENGINES[engine](directory, threads)
    return TwinDrafter(running, source_dictionary, target_dictionary, max_positions, directory)


class TwinState:
    """A batch's source pieces, one list per state row (what the twin translates)."""

    def __init__(self, sources: List[List[str]]):
        self.sources = sources


class TwinDrafter:
    """The decoding loop's drafter (decoding/drafter.py's contract) over a CTranslate2 twin.
    ``drafts_continuations``: it drafts to the end of the sentence, so the loop makes its
    chain as long as what is left of each batch's length limit."""

    drafts_continuations = True
    precision = "int8"
    chosen_by_name = False  # --drafter twin (not auto): the relaxed rule drafts with it too
    # the most sentences a batch drafts for by default (settings.draft_batch_limit), by the
    # CPU's vector unit, on which CTranslate2's int8 products depend more than the verifier's
    # fp32 ones: with AVX-512 the twin's drafts beat the drafter-less loop up to batches of 8
    # and tied at 16; with AVX2 they won at 2, tied at 4 and lost at 8 (BENCHMARKS.md, "The
    # twin drafter")
    default_draft_batch = DRAFT_BATCH_BY_CPU.get(torch.backends.cpu.get_cpu_capability(), 4)

    def __init__(self, engine, source_dictionary, target_dictionary, max_positions: int,
                 directory: Path):  # fmt: skip
        self.engine = engine  # InProcess or WorkerProcess
        self.source_symbols = source_dictionary.symbols
        self.target_symbols = target_dictionary.symbols
        self.target_index = target_dictionary.indices
        self.source_pad = source_dictionary.pad()
        self.source_eos = source_dictionary.eos()
        self.pad, self.eos = target_dictionary.pad(), target_dictionary.eos()
        self.symbols = len(target_dictionary)
        self._max_positions = max_positions
        self.directory = directory
        self.description = f"the verifier's CTranslate2 {QUANTIZATION} twin (--drafter twin)"
        # the sentences to come (draft_ahead): (source pieces, length limit) in decoding order,
        # and the first continuations drafted for them, by source
        self._upcoming: Deque[Tuple[Tuple[str, ...], int]] = deque()
        self._drafted: Dict[Tuple[str, ...], List[str]] = {}

    def max_positions(self) -> int:
        return self._max_positions

    def max_source_positions(self) -> int:
        return sys.maxsize  # (any source the verifier takes)

    def start(self, net_input: Dict[str, Tensor], verifier_encoder_out: Dict,
              verifier_state=None) -> TwinState:  # fmt: skip
        return TwinState([self._pieces(row) for row in net_input["src_tokens"].tolist()])

    def _pieces(self, row: List[int]) -> List[str]:
        """A source row's pieces, as the twin reads them: no padding, no EOS (it adds its own)."""
        row = [token for token in row if token != self.source_pad]
        if row and row[-1] == self.source_eos:
            row = row[:-1]
        return [self.source_symbols[token] for token in row]

    def draft_ahead(self, sources: List[List[int]], limits: List[int]) -> None:
        """The source rows (token ids) of the sentences the next batches decode, in decoding
        order, and their length limits: a first continuation is drafted for several of them
        at once (``DRAFT_AHEAD_ROWS``) when the first of them is drafted for, since a batch
        of sentences costs the twin less per token than one at a time."""
        self._upcoming = deque((tuple(self._pieces(row)), limit)
                               for row, limit in zip(sources, limits))  # fmt: skip
        self._drafted = {}

    def _first_continuations(self, sources: List[List[str]], max_length: int) -> List[List[str]]:
        """The twin's translations of ``sources`` (rows with nothing verified yet): those drafted
        ahead, the others now with the next sentences to come."""
        keys = [tuple(source) for source in sources]
        missing = [key for key in dict.fromkeys(keys) if key not in self._drafted]
        if missing:
            wanted = set(missing)
            # (what comes before them was decoded without drafts; without them in the queue,
            # the queue is not what is decoded, and goes)
            while self._upcoming and self._upcoming[0][0] not in wanted:
                self._upcoming.popleft()
            limits = dict.fromkeys(missing, max_length)
            while self._upcoming and len(limits) < max(len(missing), DRAFT_AHEAD_ROWS):
                key, limit = self._upcoming.popleft()
                limits[key] = max(limit, limits.get(key, 0))
            drafting = list(limits)
            hypotheses = self.engine.continuations([list(key) for key in drafting],
                                                   [[] for _ in drafting], max(limits.values()))
            self._drafted.update(zip(drafting, hypotheses))
        found = [self._drafted[key] for key in keys]
        for key in set(keys):
            del self._drafted[key]
        return found

    def propose(self, state: TwinState, tokens: Tensor, lengths: Tensor, plan: DraftPlan,
                generator: Optional[torch.Generator]) -> DraftTree:  # fmt: skip
        """Each unfinished row's greedy continuation after its verified prefix, at most
        ``plan.depth`` drafts; all rows in one CTranslate2 call."""
        if not plan.is_chain:
            raise SpecNmtError("the twin drafter drafts chains: a draft tree (--verify rsd, "
                               "--tree-branching, --tree-budget) needs the drafter file")
        finished = finished_rows(pending_tokens(tokens, lengths), lengths, self.eos).tolist()
        rows = [row for row, done in enumerate(finished) if not done]
        row_lengths = lengths.tolist()
        prefixes = [[self.target_symbols[token] for token in tokens[row, 1 : row_lengths[row] + 1]
                     .tolist()] for row in rows]  # fmt: skip
        drafts = [[] for _ in finished]
        if rows and plan.depth:
            sources = [state.sources[row] for row in rows]
            if any(prefixes):
                hypotheses = self.engine.continuations(sources, prefixes,
                                                       max(map(len, prefixes)) + plan.depth)
            else:  # a batch's first drafts
                hypotheses = self._first_continuations(sources, plan.depth)
            unk = self.target_index.get("<unk>", self.pad)
            for row, prefix, hypothesis in zip(rows, prefixes, hypotheses):
                continuation = hypothesis[len(prefix) : len(prefix) + plan.depth]
                drafts[row] = [self.target_index.get(piece, unk) for piece in continuation]
        return self.chain(drafts, tokens.device, plan.sample)

    def chain(self, drafts: List[List[int]], device: torch.device, sample: bool) -> DraftTree:
        """The chain of each row's ``drafts`` (as long as the longest; the rest of a row's slots
        hold no draft), with one-hot draft distributions for a sampling rule."""
        width = max(map(len, drafts), default=0)
        block = torch.full((len(drafts), width), self.pad, dtype=torch.long)
        for row, row_drafts in enumerate(drafts):
            block[row, : len(row_drafts)] = torch.tensor(row_drafts, dtype=torch.long)
        block = block.to(device)
        valid = block.ne(self.pad)
        probs = None
        if sample:  # entry i's child is draft i; the last entry has none
            probs = torch.zeros(len(drafts), width + 1, self.symbols, device=device)
            probs[:, :width].scatter_(2, block.unsqueeze(2), valid.unsqueeze(2).float())
        return chain(block, probs, valid)

    def commit(self, state: TwinState, keep: Optional[Tensor], n_keep: Tensor) -> None:
        """Nothing to keep: every call drafts from the whole verified prefix."""

    def select_rows(self, state: TwinState, rows: Tensor) -> None:
        state.sources = [state.sources[row] for row in rows.tolist()]

    def check_depth(self, depth: int) -> None:
        """It drafts chains of any depth."""
