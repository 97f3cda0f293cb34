"""A cached drafter exported without its copy of the verifier's encoder (scripts/export_model.py)
loads with the copy rebuilt from the verifier: it translates exactly like the full checkpoint,
and a verifier whose encoder differs is refused with one line."""

import re
import shutil

import pytest
import torch
from fairseq import checkpoint_utils

from spec_nmt.checkpoint_loading import save_checkpoint
from spec_nmt.compact_drafter import (
    VERIFIER_COPIES_KEY,
    with_verifier_copies,
    without_verifier_copies,
)
from spec_nmt.errors import SpecNmtError
from spec_nmt.loading import DRAFT_VOCABULARY_KEY
from spec_nmt.translator import SpecTranslator
from tests.conftest import BUNDLED_MODEL_DIR, REPO, script_module, train_drafter

LINES = (REPO / "data" / "examples.de").read_text(encoding="utf-8").splitlines()


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    """(model directory with the full drafter.pt, path of the compact export of it). The full
    one is made from the bundled drafter, which may itself be compact."""
    root = tmp_path_factory.mktemp("compact")
    model_dir = root / "full"
    shutil.copytree(BUNDLED_MODEL_DIR, model_dir)
    verifier = SpecTranslator.from_pretrained(model_dir, device="cpu").verifier
    state = checkpoint_utils.load_checkpoint_to_cpu(str(model_dir / "drafter.pt"))
    state = with_verifier_copies(state, verifier, "drafter.pt")
    state.pop(VERIFIER_COPIES_KEY, None)
    save_checkpoint(state, model_dir / "drafter.pt")
    compact = root / "compact-drafter.pt"
    export_model = script_module("export_model")
    export_model.compact_checkpoint(model_dir / "drafter.pt", compact,
                                    state[DRAFT_VOCABULARY_KEY], model_dir / "verifier.pt")  # fmt: skip
    return model_dir, compact


def test_the_compact_drafter_is_less_than_half_the_full_one(drafters):
    model_dir, compact = drafters
    assert compact.stat().st_size < 0.6 * (model_dir / "drafter.pt").stat().st_size
    state = torch.load(compact, weights_only=False)
    assert not any(name.startswith("encoder.") for name in state["model"])


def test_a_tie_that_saving_from_a_gpu_broke_is_stored_once(drafters, tmp_path):
    """fairseq moves each tensor of a GPU-trained model to the CPU alone when it saves one, so
    the drafter's tied embedding and output projection come back as two equal tensors."""
    model_dir, _ = drafters
    state = checkpoint_utils.load_checkpoint_to_cpu(str(model_dir / "drafter.pt"))
    embedding, projection = "decoder.embed_tokens.weight", "decoder.output_projection.weight"
    exported = {}
    for tie in ("shared", "copied"):
        weights = state["model"][embedding]
        state["model"][projection] = weights if tie == "shared" else weights.clone()
        save_checkpoint(state, tmp_path / f"{tie}.pt")
        exported[tie] = tmp_path / f"exported-{tie}.pt"
        script_module("export_model").compact_checkpoint(
            tmp_path / f"{tie}.pt", exported[tie], state[DRAFT_VOCABULARY_KEY],
            model_dir / "verifier.pt",
        )  # fmt: skip
    weights = torch.load(exported["copied"], weights_only=False)["model"]
    assert weights[embedding].data_ptr() == weights[projection].data_ptr()
    assert abs(exported["copied"].stat().st_size - exported["shared"].stat().st_size) < 4096


@pytest.mark.parametrize("settings", [{"block_size": 3, "max_draft_batch": 0},
                                      {"block_size": 5, "beta": 3, "tau": 1.0, "max_draft_batch": 0}],
                         ids=["lossless", "top-beta"])  # fmt: skip
def test_the_compact_drafter_translates_exactly_like_the_full_one(drafters, settings):
    """Top-beta/tau's output follows the drafts: equal output and equal acceptance mean equal
    drafts."""
    model_dir, compact = drafters
    outputs = []
    for drafter in (None, compact):
        translator = SpecTranslator.from_pretrained(model_dir, drafter, device="cpu", **settings)
        outputs.append((translator.translate(LINES), translator.statistics))
    assert outputs[0] == outputs[1]
    assert sum(s["accepted_tokens"] for s in outputs[0][1]) > 0


def test_a_verifier_with_another_encoder_refuses_the_compact_drafter(drafters):
    model_dir, compact = drafters
    verifier = SpecTranslator.from_pretrained(model_dir, device="cpu").verifier
    state = checkpoint_utils.load_checkpoint_to_cpu(str(compact))
    with_verifier_copies(state, verifier, str(compact))  # the right one passes
    with torch.no_grad():
        verifier.encoder.layers[0].fc1.weight[0, 0] += 0.01
    with pytest.raises(SpecNmtError, match="trained on another verifier's"):
        with_verifier_copies(state, verifier, str(compact))


def test_exporting_against_another_verifier_is_refused(drafters):
    model_dir, _ = drafters
    drafter = checkpoint_utils.load_checkpoint_to_cpu(str(model_dir / "drafter.pt"))["model"]
    verifier = dict(checkpoint_utils.load_checkpoint_to_cpu(str(model_dir / "verifier.pt"))["model"])
    verifier["encoder.layer_norm.bias"] = verifier["encoder.layer_norm.bias"] + 0.01
    with pytest.raises(SpecNmtError, match="encoder.layer_norm.bias is not the verifier's"):
        without_verifier_copies(drafter, verifier, "drafter.pt", {"encoder.": "encoder."})


def valid_losses(log):
    return [float(x) for x in re.findall(r"\| valid on 'valid' subset \| loss ([0-9.]+)", log)]


def test_an_unpacked_drafter_trains_on_from_where_it_was(toy, tmp_path):
    """scripts/unpack_drafter.py: a compact export made trainable again. Fine-tuned from it with
    a vanishing learning rate, the drafter validates as the full checkpoint it came from did."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    shutil.copy(toy["verifier"], model_dir / "verifier.pt")
    for dictionary in toy["bin"].glob("dict.*.txt"):
        shutil.copy(dictionary, model_dir)
    export_model = script_module("export_model")
    export_model.compact_checkpoint(toy["cached_drafter"], model_dir / "drafter.pt",
                                    verifier=model_dir / "verifier.pt")  # fmt: skip
    unpack_drafter = script_module("unpack_drafter")
    state = unpack_drafter.unpacked(model_dir, model_dir / "verifier.pt")
    full = checkpoint_utils.load_checkpoint_to_cpu(str(toy["cached_drafter"]))["model"]
    assert state["model"].keys() == full.keys()
    for name, tensor in full.items():
        assert state["model"][name].dtype == tensor.dtype
        torch.testing.assert_close(state["model"][name], tensor.half().to(tensor.dtype))
    assert VERIFIER_COPIES_KEY not in state and DRAFT_VOCABULARY_KEY not in state
    save_checkpoint(state, tmp_path / "unpacked.pt")

    log = train_drafter(
        toy["bin"], tmp_path / "fine-tuned", 1, "--arch", "cached_drafter",
        "--cuts-per-sentence", 3, "--init-from-verifier", toy["verifier"],
        "--finetune-from-model", tmp_path / "unpacked.pt", "--lr", 1e-9, "--warmup-updates", 1,
    )  # fmt: skip
    fine_tuned = valid_losses(log)
    trained = valid_losses(toy["cached_drafter_log"])
    assert fine_tuned and trained
    assert abs(fine_tuned[-1] - trained[-1]) < 0.02, (fine_tuned, trained)
