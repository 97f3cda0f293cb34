"""The whole recipe on the toy corpus, through the real scripts: raw text -> sentencepiece +
fairseq-preprocess -> scripts/campaign.sh (verifier, its averaged final model, distillation, the
cached drafter, then for comparison the Spec-Drafter, the short-block and the 1-layer cached
drafters, all started from the verifier) -> compact model directory ->
`make translate` and benchmarks/benchmark.py."""

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.data import data_utils

from spec_nmt.drafters.twin_drafter import TwinDrafter
from spec_nmt.settings import DEFAULTS
from tests.conftest import BIN, REPO, TINY_TRANSFORMER, built_once, fairseq, script_module
from tests.toy_corpus import make_pairs, write_corpus

TINY_OVERRIDES = [
    "--cpu", "--max-tokens", "2000", "--lr", "0.003", "--warmup-updates", "50", "--dropout", "0.0",
    "--num-workers", "0", "--data-buffer-size", "0", "--log-interval", "25",
]  # fmt: skip


def run(*command, env_update=None, **kwargs):
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", **(env_update or {}))
    result = subprocess.run(
        [str(c) for c in command], cwd=REPO, env=env, capture_output=True, text=True, check=False,
        stdin=subprocess.DEVNULL if "input" not in kwargs else None, timeout=900, **kwargs,
    )  # fmt: skip
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """scripts/campaign.sh on the toy corpus, the verifier and the cached drafter 250 updates,
    the comparison drafters COMPARISON_EPOCHS (PATIENCE keeps the toy runs from stopping at a
    plateau, so every stage ends where its limit is), then the export."""
    return built_once(tmp_path_factory, "pipeline", build_pipeline)


# the output length limits of every decoder the project runs
LENGTH_FLAGS = DEFAULTS.fairseq_flags(["max_len_a", "max_len_b"])


def stock_greedy(model_dir, text):
    """Stock fairseq-interactive's greedy translations of the lines of ``text``, in order, one
    sentence at a time."""
    output = fairseq(
        "interactive", model_dir, "--path", model_dir / "verifier.pt",
        "--user-dir", REPO / "spec_nmt", "--source-lang", "de", "--target-lang", "en",
        "--bpe", "sentencepiece", "--sentencepiece-model", model_dir / "spm.model",
        "--beam", 1, *LENGTH_FLAGS, "--batch-size", 1, "--buffer-size", 1, "--cpu",
        input_text=text,
    ).stdout  # fmt: skip
    return [line.split("\t")[2] for line in output.splitlines() if line.startswith("D-")]


# the verifier's decoder depth, which the campaign's drafters (2, 2, 1 and 2 layers) do not take
VERIFIER_DECODER_LAYERS = 3
# the comparison drafters' epochs (about 14 updates each on the toy corpus): fewer than 250
# updates, and a multiple of --validate-interval, so that the last epoch is validated
COMPARISON_EPOCHS = 2


def build_pipeline(root):
    raw = write_corpus(root / "raw", n_train=1000)
    py = sys.executable
    run(py, "scripts/prepare_data.py", raw, root / "data", "--vocab-size", 40)
    data_bin, spm_model = root / "data" / "bin", root / "data" / "spm.model"
    campaign = ["scripts/campaign.sh", data_bin, spm_model, raw, root / "campaign",
                *TINY_TRANSFORMER, *TINY_OVERRIDES, "--max-update", 250,
                "--save-interval-updates", 50, "--validate-interval", COMPARISON_EPOCHS,
                "--decoder-layers", VERIFIER_DECODER_LAYERS]  # fmt: skip
    limits = {"PATIENCE": "1000", "COMPARISON_EPOCHS": str(COMPARISON_EPOCHS)}
    campaign_log = run(*campaign, env_update=limits).stdout
    verifier = root / "campaign" / "verifier" / "checkpoint_final.pt"
    # a model directory with each drafter kind
    exports = (("model", "drafter-spec"), ("cached_model", "drafter-cached"))
    for model_dir, stage in exports:
        drafter = root / "campaign" / stage / "checkpoint_last.pt"
        run(py, "scripts/export_model.py", root / model_dir, "--verifier", verifier,
            "--drafter", drafter, "--data-bin", data_bin, "--spm-model", spm_model)  # fmt: skip
    return {"raw": raw, "data": root / "data", "campaign": root / "campaign",
            "campaign_command": campaign, "campaign_log": campaign_log, "verifier": verifier,
            "model": root / "model", "cached_model": root / "cached_model"}


def test_prepared_data_keeps_valid_and_test_complete(pipeline):
    data = pipeline["data"]
    assert (data / "spm.model").is_file()
    for split, n in (("valid", 100), ("test", 60)):
        assert len((data / "spm" / f"{split}.en").read_text().splitlines()) == n
        assert (data / "bin" / f"{split}.de-en.de.bin").is_file()
    assert (data / "bin" / "dict.de.txt").read_text() == (data / "bin" / "dict.en.txt").read_text()


def test_distilled_targets_are_the_verifier_outputs(pipeline):
    """Distilled train targets must differ from the references somewhere and keep the dictionary."""
    distilled, original = pipeline["campaign"] / "distilled", pipeline["data"] / "bin"
    assert (distilled / "dict.en.txt").read_text() == (original / "dict.en.txt").read_text()
    assert (distilled / "valid.de-en.en.bin").read_bytes() == (original / "valid.de-en.en.bin").read_bytes()
    assert (distilled / "train.de-en.en.bin").read_bytes() != (original / "train.de-en.en.bin").read_bytes()


def test_campaign_finished_the_verifier_by_averaging_keeping_the_better_and_scoring(pipeline):
    """finish_verifier.py, as the campaign ran it: the last 5 interval checkpoints averaged, the
    better of average and best kept by validation BLEU, the test set scored."""
    run_dir = pipeline["campaign"] / "verifier"
    data = pipeline["data"]
    result = json.loads((run_dir / "final.json").read_text())
    updates = [int(re.fullmatch(r"checkpoint_\d+_(\d+)\.pt", name).group(1))
               for name in result["averaged"]]  # fmt: skip
    assert updates == [50, 100, 150, 200, 250]  # the last five

    def weights(name):
        return torch.load(run_dir / name, weights_only=False)["model"]

    parts = [weights(name) for name in result["averaged"]]
    averaged = weights("checkpoint_avg5.pt")
    for name, tensor in averaged.items():
        torch.testing.assert_close(tensor, sum(p[name] for p in parts) / 5, rtol=1e-6, atol=1e-7)
    tied = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
            "decoder.output_projection.weight")  # --share-all-embeddings: stored once
    assert len({averaged[name].data_ptr() for name in tied}) == 1
    valid = result["valid_greedy_bleu"]
    assert set(valid) == {"checkpoint_best.pt", "checkpoint_avg5.pt"}
    assert valid[result["kept"]] == max(valid.values())
    for name, tensor in weights("checkpoint_final.pt").items():
        assert torch.equal(tensor, weights(result["kept"])[name])
    # fairseq's own sacreBLEU scorer (references decoded from the data-bin, which for the toy
    # words are the raw ones) gives the same greedy test score. Batch sizes must not be rounded
    # to multiples of 8: fairseq then drops the last batch (fairseq issue #5036).
    stock = fairseq(
        "generate", data / "bin", "--path", run_dir / "checkpoint_final.pt", "--beam", 1,
        *LENGTH_FLAGS, "--bpe", "sentencepiece", "--sentencepiece-model",
        data / "spm.model", "--scoring", "sacrebleu", "--gen-subset", "test", "--cpu",
        "--required-batch-size-multiple", 1,
    ).stdout  # fmt: skip
    stock_bleu = float(re.search(r"BLEU = ([0-9.]+)", stock).group(1))
    assert result["test_bleu"]["beam 1"] == pytest.approx(stock_bleu, abs=0.01)
    assert result["test_bleu"]["beam 1"] > 10 and result["test_bleu"]["beam 5"] > 10


def shard_pairs(shard_dir):
    paths = shard_dir.glob("shard-*.tsv")
    lines = [line for path in paths for line in path.read_text().splitlines()]
    return {int(line.split("\t")[0]): line for line in lines}


def test_distillation_goes_on_where_it_stopped_shard_by_shard(pipeline, tmp_path):
    out = tmp_path / "distilled"
    command = [sys.executable, "scripts/distill.py", pipeline["data"] / "bin", pipeline["verifier"],
               out, "--beam", 5, "--cpu", "--num-shards", 2]  # fmt: skip
    run(*command, "--shard-id", 1)  # as if stopped after one shard
    shards = sorted(p.name for p in (out / "shards").iterdir())
    assert shards == ["settings.json", "shard-1-of-2.tsv"]
    log = run(*command).stderr
    assert "shard-1-of-2.tsv is done: not translated again" in log
    assert len(re.findall(r"running \S+ -m fairseq_cli.generate", log)) == 1  # shard 0
    # together, the shards are the distillation of the whole training set in one piece
    whole = shard_pairs(pipeline["campaign"] / "distilled" / "shards")
    training_pairs = (pipeline["data"] / "spm" / "train.de").read_text().splitlines()
    assert shard_pairs(out / "shards") == whole and len(whole) == len(training_pairs)
    assert (out / "train.de-en.en.bin").read_bytes() == (
        pipeline["campaign"] / "distilled" / "train.de-en.en.bin"
    ).read_bytes()
    other_beam = subprocess.run([str(c) for c in command[:-2]] + ["--beam", "2"], cwd=REPO,
                                capture_output=True, text=True)  # fmt: skip
    assert other_beam.returncode != 0
    refusal = "holds translations made with other settings (beam, num_shards differ)"
    assert refusal in other_beam.stderr


DRAFTER_STAGES = ("drafter-cached", "drafter-spec", "drafter-short", "drafter-cached-1layer")


def test_campaign_ran_every_stage_and_a_second_run_does_nothing(pipeline):
    campaign = pipeline["campaign"]
    for stage in DRAFTER_STAGES:
        log = (campaign / stage / "train.log").read_text()
        assert "initialised" in log and "from the verifier" in log  # started from checkpoint_final
        curve = (campaign / stage / "FINISHED").read_text()  # its learning curve
        # the first drafter to its --max-update, the comparisons to their epoch limit
        last = r"\d+ \| 250" if stage == "drafter-cached" else rf"{COMPARISON_EPOCHS} \| \d+"
        last_row = rf"^\| {last} \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|\Z"  # 4 metrics
        assert re.search(last_row, curve.split("\n\n")[0].strip(), re.M), curve
        assert re.search(r"best accepted_lossless [0-9.]+ at update \d+", curve)
        cfg = torch.load(campaign / stage / "checkpoint_last.pt", weights_only=False)["cfg"]
        model, task = cfg["model"], cfg["task"]
        assert model.decoder_layers == (1 if stage.endswith("1layer") else 2)
        blocks = {"drafter-spec": (10, 3), "drafter-short": (5, 8)}.get(stage, (10, 4))
        assert (task["block_size"], task["cuts_per_sentence"]) == blocks  # k, cuts per sentence
    verifier = torch.load(pipeline["verifier"], weights_only=False)["cfg"]["model"]
    assert verifier.decoder_layers == VERIFIER_DECODER_LAYERS
    assert "distilling the training set in 1 shard(s)" in pipeline["campaign_log"]
    # the bundle's drafter first, then the comparisons
    log = pipeline["campaign_log"]
    starts = [log.index(f"{campaign / stage}: training") for stage in DRAFTER_STAGES]
    assert starts == sorted(starts)
    logs = {path: path.read_bytes() for path in campaign.glob("*/train.log")}
    again = run(*pipeline["campaign_command"]).stdout
    for stage in ("verifier", *DRAFTER_STAGES):
        assert f"{campaign / stage}: finished before" in again
    assert "averaging" not in again and "distilling" not in again
    assert {path: path.read_bytes() for path in logs} == logs


@pytest.mark.parametrize("model", ["model", "cached_model"])
def test_exported_models_are_fp16_without_optimizer_state(pipeline, model):
    model_dir = pipeline[model]
    for name in ("verifier.pt", "drafter.pt"):
        state = torch.load(model_dir / name, weights_only=True)
        assert state["last_optimizer_state"] is None
        assert all(t.dtype == torch.float16 for t in state["model"].values() if t.is_floating_point())
        assert state["cfg"]["task"]["data"] == "."
        # half the fp32 weights (tied ones stored once) and a configuration of a few KiB,
        # nothing else of size
        stored = {t.untyped_storage().data_ptr(): t for t in state["model"].values()}
        fp32_bytes = sum(4 * t.numel() for t in stored.values())
        assert (model_dir / name).stat().st_size < 0.5 * fp32_bytes + 64 * 1024
    for name in ("dict.de.txt", "dict.en.txt", "spm.model"):
        assert (model_dir / name).is_file()
    # the drafter drafts over the symbols of the training targets (the default size is larger
    # than the toy vocabulary); the verifier scores every symbol
    vocabulary = torch.load(model_dir / "drafter.pt", weights_only=True)["draft_vocabulary"]
    targets = data_utils.load_indexed_dataset(
        str(pipeline["data"] / "bin" / "train.de-en.en"), None
    )
    used = torch.unique(torch.cat([targets[i] for i in range(len(targets))]))
    assert torch.equal(vocabulary, used)
    assert "draft_vocabulary" not in torch.load(model_dir / "verifier.pt", weights_only=True)


@pytest.mark.parametrize("model", ["model", "cached_model"])
def test_make_translate_gives_greedy_output_line_by_line(pipeline, model):
    lines = [line.replace(" ", "") for line in (pipeline["raw"] / "test.de").read_text().splitlines()[:8]]
    # Words glued together exercise sentencepiece on text it must split itself; an empty line too.
    lines.insert(3, "")
    text = "\n".join(lines) + "\n"
    model_dir = pipeline[model]
    split = "SPLIT=0" if model == "cached_model" else "SPLIT=1"  # each way once
    spec = run("make", "-s", "translate", f"MODEL_DIR={model_dir}", "BLOCK_SIZE=5",
               "BETA=1", "TAU=0", split, input=text).stdout.splitlines()  # fmt: skip
    greedy_lines = stock_greedy(model_dir, text)
    assert len(spec) == len(lines) == len(greedy_lines)
    # The plugin translates an empty line as empty; stock fairseq decodes the bare EOS source.
    assert spec[3] == ""
    assert spec[:3] + spec[4:] == greedy_lines[:3] + greedy_lines[4:]


def test_make_translate_decodes_a_file_in_batches_as_greedy(pipeline, tmp_path):
    lines = [source for source, _ in make_pairs(160, seed=11)]  # three batches
    lines[100] = ""
    text = "\n".join(lines) + "\n"
    path = tmp_path / "file.de"
    path.write_text(text)
    batched = run("make", "-s", "translate", f"MODEL_DIR={pipeline['model']}", "BLOCK_SIZE=5",
                  "BETA=1", "TAU=0", f"INPUT={path}", "BATCH_SIZE=64")  # fmt: skip
    spec = batched.stdout.splitlines()
    assert len(spec) == 160 and spec[100] == ""
    # one sentence at a time: in a batch, fairseq's length limit follows the longest source
    greedy_lines = stock_greedy(pipeline["model"], text)
    assert spec[:100] + spec[101:] == greedy_lines[:100] + greedy_lines[101:]
    # (the progress bar shows after a second of decoding: test_cli_modes.py, without timing)
    assert re.search(r"160 lines, 159 sentences, \d+ target tokens in [0-9.]+ s of decoding: "
                     r"[0-9.]+ sentences/s, \d+ tokens/s", batched.stderr)  # fmt: skip


def test_benchmark_ceiling_mode_accepts_every_oracle_draft(pipeline, tmp_path):
    out = tmp_path / "ceiling.json"
    run(sys.executable, "benchmarks/benchmark.py", "ceiling", pipeline["model"],
        "--src", pipeline["raw"] / "test.de", "--lines", 12, "--block", 5, "--batch-sizes", "1,4",
        "--warmup-lines", 1, "--ctranslate2", "--json", out)  # fmt: skip
    rows = {(row["batch_size"], row["system"]): row for row in json.loads(out.read_text())["rows"]}
    for batch in (1, 4):
        oracle = rows[(batch, "spec lossless, oracle drafter")]
        real = rows[(batch, "spec lossless, real drafter")]
        own_greedy = rows[(batch, "spec-nmt greedy (no drafts)")]
        assert oracle["identical_to_greedy"] == real["identical_to_greedy"] == 12
        # the loop without drafts: greedy decoding, one token per verifier call
        assert own_greedy["identical_to_greedy"] == 12
        assert own_greedy["tokens_per_verifier_call"] == 1
        # every draft accepted: k accepted + 1 bonus token per iteration, less at sentence ends
        assert oracle["tokens_per_verifier_call"] > max(real["tokens_per_verifier_call"], 3)
        # the static loop's iteration is one call; the dynamic loop's (the CPU's default) is
        # split into phases (this pipeline's drafter has no static form: the drafter-less row)
        static = rows[(batch, "spec-nmt greedy (no drafts), static loop")]
        assert static["identical_to_greedy"] == 12 and "score_greedy_steps" not in static
        dynamic = rows[(batch, "spec-nmt defaults")]
        phases = ("encode", "draft", "score", "accept", "commit", "other")
        total = sum(dynamic[f"{phase}_greedy_steps"] for phase in phases)
        assert abs(total - dynamic["greedy_steps_per_iteration"]) < 0.05
        assert rows[(batch, "fairseq greedy")]["greedy_step_ms"] > 0
    # the same verifier converted with CTranslate2 translates alike (fp32, one sentence at a time)
    assert rows[(1, "CTranslate2 4.8.5 greedy float32")]["identical_to_greedy"] >= 11
    assert rows[(4, "CTranslate2 4.8.5 greedy int8")]["ms_per_output_token"] > 0


def test_benchmark_sampling_mode_keeps_the_drafter_less_loop_and_ctranslate2(pipeline, tmp_path):
    out = tmp_path / "sampling.json"
    run(sys.executable, "benchmarks/benchmark.py", "sampling", pipeline["model"],
        "--src", pipeline["raw"] / "test.de", "--ref", pipeline["raw"] / "test.en", "--lines", 12,
        "--batch-size", 4, "--latency-lines", 3, "--warmup-lines", 1, "--temperatures", "1.0",
        "--systems", "chain:3", "--ctranslate2", "--json", out)  # fmt: skip
    rows = {row["system"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["fairseq sampling", "spec-nmt sampling (no drafts)",
                          "spec sampling k=3", "CTranslate2 4.8.5 int8 sampling"]  # fmt: skip
    assert rows["spec-nmt sampling (no drafts)"]["tokens_per_verifier_call"] == 1
    assert rows["spec sampling k=3"]["tokens_per_verifier_call"] > 1
    for row in rows.values():
        assert row["batch1_ms_per_sentence"] > 0 and row["batch4_speedup_vs_fairseq"] > 0
        assert 0 <= row["bleu"] <= 100


def test_ctranslate2_samples_at_a_temperature_and_is_greedy_without_one(pipeline):
    common = script_module("common", folder="benchmarks")
    args = argparse.Namespace(model_dir=Path(pipeline["model"]), warmup_lines=0)
    src = pipeline["raw"] / "test.de"
    with common.ctranslate2_verifier(args.model_dir) as converted:
        runs = [common.ctranslate2_timed(args, converted, src, 12, [4], "float32", temperature)
                for temperature in (0.0, 0.0, 1.0)]  # fmt: skip
    greedy, again, sampled = (run_["4"]["outputs"] for run_ in runs)
    assert greedy == again and sampled != greedy


def test_benchmark_block_cost_mode_times_every_width_and_batch(pipeline, tmp_path):
    out = tmp_path / "block-cost.json"
    run(sys.executable, "benchmarks/benchmark.py", "block-cost", pipeline["model"],
        "--src", pipeline["raw"] / "test.de", "--widths", "1,6", "--batch-sizes", "1,3",
        "--repeats", 2, "--json", out)  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [(row["batch_size"], row["width"]) for row in rows] == [(1, 1), (1, 6), (3, 1), (3, 6)]
    for engine in ("modules", "scripted"):  # the default engines, the stock modules first
        assert all(row[f"{engine}_ms_per_call"] > 0 for row in rows)
        narrowest = [row[f"{engine}_cost_vs_narrowest"] for row in rows if row["width"] == 1]
        assert narrowest == [1.0, 1.0]
    assert all(row["scripted_vs_modules"] > 0 for row in rows)
    assert all(row["scripted_max_abs_logit_difference"] < 1e-4 for row in rows)


def test_benchmark_script_reports_lossless_identity(pipeline, tmp_path):
    out = tmp_path / "bench.json"
    # the cached drafter's pair: the Spec-Drafter trains only COMPARISON_EPOCHS; beta and tau
    # are the benchmark's defaults, the reference setting
    run(sys.executable, "benchmarks/benchmark.py", "run", pipeline["cached_model"],
        "--src", pipeline["raw"] / "test.de", "--ref", pipeline["raw"] / "test.en", "--lines", 16,
        "--batch-size", 16, "--latency-lines", 4, "--warmup-lines", 1, "--lossless-block", 5,
        "--block", 5, "--json", out)  # fmt: skip
    result = json.loads(out.read_text())
    rows = {row["system"]: row for row in result["rows"]}
    assert set(rows) == {"fairseq greedy", "fairseq beam5", "spec lossless k=5", "spec k=5 beta=3 tau=1.0",
                         "spec-nmt defaults"}
    # the reference is greedy of each sentence alone: batched stock greedy caps a row's length
    # by the batch's longest source, speculative decoding by the sentence's own
    assert rows["spec lossless k=5"]["identical_to_greedy"] == 16
    assert rows["spec lossless k=5"]["mean_accepted_per_iteration"] > 0.5
    # the defaults draft for a sentence alone (batch 1), not in a batch of 16 (over the twin's
    # limit)
    assert TwinDrafter.default_draft_batch < 16
    assert rows["spec-nmt defaults"]["identical_to_greedy"] == 16
    assert rows["spec-nmt defaults"]["mean_accepted_per_iteration"] == 0
    assert rows["spec-nmt defaults"]["batch1_mean_accepted_per_iteration"] > 0
    assert "nrefs:1|case:mixed|eff:no|tok:13a" in result["sacrebleu_signature"]
    assert result["environment"]["torch"] == torch.__version__


def test_a_drafter_from_a_pre_norm_verifier_computes_the_verifiers_encoder(pipeline):
    """The small recipe's verifier is pre-norm, the drafter presets are not: started from it, the
    cached drafter takes its layout, so the frozen encoder it trains on computes exactly what the
    verifier's computes at decoding time."""
    (drafter,), _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(pipeline["campaign"] / "drafter-cached" / "checkpoint_last.pt")],
        arg_overrides={"data": str(pipeline["data"] / "bin")},
    )
    (verifier,), _ = checkpoint_utils.load_model_ensemble([str(pipeline["verifier"])], task=task)
    assert verifier.encoder.layer_norm is not None  # pre-norm
    assert drafter.encoder.layer_norm is not None and drafter.decoder.layers[0].normalize_before
    drafter.check_verifier_matches(verifier)
    task.load_dataset("valid")
    sources = [task.datasets["valid"][i]["source"] for i in range(8)]
    batch = data_utils.collate_tokens(sources, task.source_dictionary.pad(), left_pad=True)
    lengths = batch.ne(task.source_dictionary.pad()).sum(1)
    with torch.no_grad():
        ours = drafter.eval().encoder(batch, src_lengths=lengths)["encoder_out"][0]
        theirs = verifier.eval().encoder(batch, src_lengths=lengths)["encoder_out"][0]
    assert torch.equal(ours, theirs)


def test_benchmark_sweep_picks_settings_by_the_rule(pipeline, tmp_path):
    out = tmp_path / "sweep.json"
    run(sys.executable, "benchmarks/benchmark.py", "sweep", pipeline["model"],
        "--src", pipeline["raw"] / "valid.de", "--ref", pipeline["raw"] / "valid.en", "--lines", 12,
        "--latency-lines", 3, "--warmup-lines", 1, "--settings", "3:1:0,5:1:0,5:3:1.0", "--json", out)  # fmt: skip
    result = json.loads(out.read_text())
    systems = [row["system"] for row in result["rows"]]
    assert systems == ["fairseq greedy", "fairseq beam5", "spec k=3 beta=1 tau=0.0",
                       "spec k=5 beta=1 tau=0.0", "spec k=5 beta=3 tau=1.0"]  # fmt: skip
    assert result["best"]["beta"] == 3  # the only top-beta/tau row
    assert result["best_lossless"]["beta"] == 1
    lossless = [row for row in result["rows"][2:] if row["beta"] == 1]
    assert len({row["bleu"] for row in lossless}) == 1  # the same output whatever k
