"""Shared fixtures: a toy corpus, a verifier and an autoregressive drafter trained with stock
fairseq, Spec-Drafters and a cached drafter trained through the plugin, all made once per test
session by the command-line tools' code (run in the building worker's process). `make test`
runs the tests on every core (pytest-xdist); the workers share each of these builds."""

import contextlib
import importlib
import importlib.util
import io
import logging
import os
import pickle
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from unittest import mock

import pytest
from filelock import FileLock

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One worker per core: a second intra-op thread per process (the fairseq tools the tests run
    # inherit this) would only contend for the other worker's core.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# The product kernels each machine chose (spec_nmt/decoding/linears.py) are recorded under the
# cache directory: the tests and the tools they run keep theirs apart from the user's.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="spec-nmt-test-cache-")

import numpy as np
import torch
from fairseq import checkpoint_utils
from fairseq.logging import metrics

from spec_nmt.errors import SpecNmtError
from spec_nmt.files import written_whole
from tests.toy_corpus import write_corpus

REPO = Path(__file__).resolve().parent.parent
USER_DIR = str(REPO / "spec_nmt")
BUNDLED_MODEL_DIR = REPO / "data" / "models" / "bench-de-en"
BIN = Path(sys.executable).parent

TINY_TRANSFORMER = (
    "--share-all-embeddings --encoder-layers 2 --decoder-layers 2 "
    "--encoder-embed-dim 64 --decoder-embed-dim 64 --encoder-ffn-embed-dim 128 "
    "--decoder-ffn-embed-dim 128 --encoder-attention-heads 4 --decoder-attention-heads 4"
).split()
TINY_DRAFTER = (
    "--arch spec_drafter --share-all-embeddings --encoder-layers 2 --decoder-layers 1 "
    "--encoder-embed-dim 64 --decoder-embed-dim 64 --encoder-ffn-embed-dim 128 "
    "--decoder-ffn-embed-dim 128 --encoder-attention-heads 4 --decoder-attention-heads 4"
).split()
OPTIMIZATION = (
    "--optimizer adam --lr 0.003 --lr-scheduler inverse_sqrt --warmup-updates 50 "
    "--max-tokens 2000 --dropout 0.0 --no-epoch-checkpoints --log-format simple "
    "--log-interval 25 --cpu --seed 1 --num-workers 0 --data-buffer-size 0"
).split()
# --data-buffer-size 0: fairseq's batch prefetch thread can still be running torch code when a
# short training run exits, which once aborted the process ("terminate called ...").
BLOCK_SIZE = 5


def fairseq(tool, *args, input_text=None, check=True):
    """Run a fairseq console script of this environment; returns the CompletedProcess."""
    result = subprocess.run(
        [str(BIN / f"fairseq-{tool}"), *map(str, args)],
        input=input_text,
        stdin=None if input_text is not None else subprocess.DEVNULL,
        capture_output=True,
        text=not isinstance(input_text, bytes),  # bytes in, bytes out
        timeout=600,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"fairseq-{tool} {' '.join(map(str, args))} exited with {result.returncode}:\n"
            f"{result.stderr[-4000:]!s}"
        )
    return result


# fairseq's console log lines, which the tests read (fairseq_cli's logging.basicConfig)
FAIRSEQ_LOG_FORMAT = "%(asctime)s | %(levelname)s | %(name)s | %(message)s"
FAIRSEQ_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


@contextlib.contextmanager
def as_in_a_process_of_its_own(cli):
    """What a fairseq tool's ``cli`` module leaves behind in this process, undone: fairseq-train
    keeps the best validation so far and the patience count on two functions, seeds the global
    random generators and may leave the metrics' aggregators half entered (a refusal raised
    while validating); fairseq-preprocess adds a log file handler at each run."""
    for function in (checkpoint_utils.save_checkpoint, getattr(cli, "should_stop_early", None)):
        for attribute in ("best", "num_runs"):
            if hasattr(function, attribute):
                delattr(function, attribute)
    tool_logger = logging.getLogger(cli.__name__)
    handlers = list(tool_logger.handlers)
    random_states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        metrics.reset()
        for handler in tool_logger.handlers[:]:
            if handler not in handlers:
                tool_logger.removeHandler(handler)
                handler.close()
        random.setstate(random_states[0])
        np.random.set_state(random_states[1])
        torch.set_rng_state(random_states[2])


def fairseq_in_process(tool, *args) -> str:
    """What fairseq-TOOL prints for ``args``, its output and its log, its ``cli_main`` run in
    this process, then what it registered to run at exit: the console script's code without an
    interpreter start of its own (the scripts themselves run in test_stock_fairseq,
    test_sampling_cli, test_bad_input...). Batches are loaded in this process (--num-workers 0):
    a loader's worker process would outlive the call until a garbage collection waits it out."""
    cli = importlib.import_module(f"fairseq_cli.{tool}")
    # --user-dir imports spec_nmt only where no module of it is imported yet, as in a process of
    # its own: here another test may have imported one, so the plugin registers as it would
    importlib.import_module("spec_nmt.plugin")
    output = io.StringIO()
    handler, root = logging.StreamHandler(output), logging.getLogger()
    handler.setFormatter(logging.Formatter(FAIRSEQ_LOG_FORMAT, FAIRSEQ_DATE_FORMAT))
    # INFO and up as in a fresh process (a SpecTranslator of another test quiets these two)
    loggers = [root, logging.getLogger("fairseq"), logging.getLogger("spec_nmt")]
    levels = [logger.level for logger in loggers]
    for logger, level in zip(loggers, [logging.INFO, logging.NOTSET, logging.NOTSET]):
        logger.setLevel(level)
    root.addHandler(handler)
    at_exit = []
    try:
        argv = [f"fairseq-{tool}", *map(str, args)]
        if tool != "preprocess":  # the tools that load batches
            argv += ["--num-workers", "0"]
        with mock.patch.object(sys, "argv", argv), \
                mock.patch("atexit.register", lambda *call: at_exit.append(call)), \
                contextlib.redirect_stdout(output), as_in_a_process_of_its_own(cli):  # fmt: skip
            cli.cli_main()
            for function, *arguments in at_exit:
                function(*arguments)
    finally:
        root.removeHandler(handler)
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
    return output.getvalue()


def fairseq_error(tool, *args) -> str:
    """The message of the SpecNmtError that fairseq-TOOL raises for ``args``, run in this
    process (fairseq_in_process; that the console prints it as one line: test_errors.py's runs
    of the commands)."""
    with pytest.raises(SpecNmtError) as raised:
        fairseq_in_process(tool, *args)
    message = str(raised.value)
    assert "\n" not in message, message
    return message


def script_module(name, folder="scripts"):
    """FOLDER/NAME.py imported as a module (scripts/ and benchmarks/ are no packages); its
    folder is on the import path meanwhile, as when it runs as a script."""
    spec = importlib.util.spec_from_file_location(name, REPO / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(REPO / folder))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(REPO / folder))
    return module


def preprocess(raw_dir, dest_dir):
    fairseq_in_process(
        "preprocess", "--source-lang", "de", "--target-lang", "en",
        "--trainpref", raw_dir / "train", "--validpref", raw_dir / "valid",
        "--testpref", raw_dir / "test", "--destdir", dest_dir,
        "--joined-dictionary", "--workers", "1",
    )  # fmt: skip
    return dest_dir


def drafter_training(data_bin, save_dir, max_update, *extra):
    """fairseq-train's arguments for a toy Spec-Drafter, ``extra`` last (so they win)."""
    return [
        data_bin, "--user-dir", USER_DIR, "--task", "spec_translation",
        "--block-size", BLOCK_SIZE, "--criterion", "spec_drafter_loss",
        *TINY_DRAFTER, *OPTIMIZATION, "--max-update", max_update, "--save-dir", save_dir, *extra,
    ]  # fmt: skip


def train_drafter(data_bin, save_dir, max_update, *extra) -> str:
    """A toy drafter trained in this process (fairseq_in_process); its log."""
    return fairseq_in_process("train", *drafter_training(data_bin, save_dir, max_update, *extra))


def train_losses(log):
    return [float(x) for x in re.findall(r"train_inner .* loss=([0-9.]+)", log)]


def pytest_collection_modifyitems(items):
    """The slowest build first: `make test` hands whole modules to its workers in collection
    order, so one worker runs the toy campaign of test_pipeline.py while another builds the toy
    models."""
    items.sort(key=lambda item: item.path.name != "test_pipeline.py")


def built_once(tmp_path_factory, name, build):
    """build(root) once per test run and its result. Under pytest-xdist the first worker to ask
    builds it in the run's shared directory while the others wait on its lock and then read the
    result it left there."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return build(tmp_path_factory.mktemp(name))
    shared = tmp_path_factory.getbasetemp().parent
    root, result_file = shared / name, shared / f"{name}.pickle"
    with FileLock(str(shared / f"{name}.lock")):
        if result_file.exists():
            return pickle.loads(result_file.read_bytes())
        if root.exists():
            pytest.fail(f"building {name} failed in another worker: see its error")
        root.mkdir()
        result = build(root)
        with written_whole(result_file) as partial:
            partial.write_bytes(pickle.dumps(result))
        return result


@pytest.fixture(scope="session")
def toy(tmp_path_factory):
    """Paths of the toy data-bin, the verifier and the drafters trained for it."""
    return built_once(tmp_path_factory, "toy", build_toy)


def build_toy(root):
    raw = write_corpus(root / "raw")
    data_bin = preprocess(raw, root / "bin")
    fairseq_in_process(
        "train", data_bin, "--user-dir", USER_DIR, "--task", "translation", "--arch",
        "transformer", *TINY_TRANSFORMER, *OPTIMIZATION, "--max-update", 300,
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", 0.1,
        "--save-dir", root / "verifier",
    )  # fmt: skip
    drafter_log = train_drafter(data_bin, root / "drafter", 300)
    fairseq_in_process(
        "train", data_bin, "--task", "translation", "--arch", "transformer",
        *TINY_TRANSFORMER, "--decoder-layers", 1, *OPTIMIZATION, "--max-update", 200,
        "--criterion", "label_smoothed_cross_entropy", "--save-dir", root / "ar_drafter",
    )  # fmt: skip
    train_drafter(data_bin, root / "untrained_drafter", 1)
    verifier = root / "verifier" / "checkpoint_last.pt"
    cached_log = train_drafter(
        data_bin, root / "cached_drafter", 300, "--arch", "cached_drafter",
        "--cuts-per-sentence", 3, "--init-from-verifier", verifier,
        "--eval-acceptance-verifier", verifier, "--beta", 3, "--tau", 1,
        "--best-checkpoint-metric", "accepted_lossless", "--maximize-best-checkpoint-metric",
    )  # fmt: skip
    feature_log = fairseq_in_process(
        "train", data_bin, "--user-dir", USER_DIR, "--task", "translation",
        "--arch", "feature_drafter", "--verifier-path", verifier, "--unroll-steps", 3,
        "--criterion", "feature_drafter_loss", *OPTIMIZATION, "--max-update", 150,
        "--save-dir", root / "feature_drafter",
    )  # fmt: skip
    return {
        "root": root,
        "raw": raw,
        "bin": data_bin,
        "verifier": verifier,
        "cached_drafter": root / "cached_drafter" / "checkpoint_last.pt",
        "cached_drafter_best": root / "cached_drafter" / "checkpoint_best.pt",
        "cached_drafter_log": cached_log,
        "drafter": root / "drafter" / "checkpoint_last.pt",
        "drafter_dir": root / "drafter",
        "drafter_log": drafter_log,
        "untrained_drafter": root / "untrained_drafter" / "checkpoint_last.pt",
        "ar_drafter": root / "ar_drafter" / "checkpoint_last.pt",
        "feature_drafter": root / "feature_drafter" / "checkpoint_last.pt",
        "feature_drafter_log": feature_log,
    }
