"""Loading models for speculative decoding: checkpoints, the drafter's adapter and draft
vocabulary, the drafter's precision (bf16, int8), and the refusals of files that do not belong
together.
"""

import copy
import logging
import os
import warnings
from typing import Optional

import torch
from fairseq import checkpoint_utils
from fairseq.models import ARCH_MODEL_REGISTRY

from spec_nmt.checkpoint_loading import checkpoint_arch, model_config
from spec_nmt.compact_drafter import with_verifier_copies
from spec_nmt.decoding.drafter import NoDrafter
from spec_nmt.drafters.ar_drafter import ArDrafter
from spec_nmt.drafters.cached_drafter import CachedDrafterModel, same_weights
from spec_nmt.drafters.feature_drafter import FeatureDrafterModel
from spec_nmt.drafters.spec_drafter import MASK_SYMBOL, SpecDrafterModel, restrict_output
from spec_nmt.drafters.twin_drafter import TwinUnavailable, load_twin
from spec_nmt.errors import SpecNmtError
from spec_nmt.options import DRAFTER_CHOICES, DRAFTER_PRECISION_NAMES

logger = logging.getLogger(__name__)

def load_decoding_drafter(task, choice: str, path: Optional[str], verifier_model):
    """The drafter that decoding gets for --drafter ``choice``: the drafter file's adapter
    (``load_drafter``; ``path`` None: none), with the verifier's twin beside it as its ``twin``
    (``decoding.drafter.drafter_for_rule`` says which rule drafts with which), or the twin
    alone, or a drafter that drafts nothing."""
    if choice not in DRAFTER_CHOICES:
        raise SpecNmtError(f"--drafter must be one of {', '.join(DRAFTER_CHOICES)}, "
                           f"got {choice!r}")  # fmt: skip
    if choice == "file" and path is None:
        raise SpecNmtError("--drafter file needs a drafter checkpoint (--drafter-path)")
    drafter = None
    if path is not None and choice != "none":
        drafter = load_drafter(task, path, verifier_model)
    twin = None
    wanted = choice == "twin" or (
        choice == "auto" and next(verifier_model.parameters()).device.type == "cpu")
    if wanted:
        try:
            twin = load_twin(verifier_model, task.source_dictionary, task.target_dictionary,
                             verifier_model.decoder.max_positions())  # fmt: skip
            twin.chosen_by_name = choice == "twin"
        except TwinUnavailable as error:
            logger.warning("no twin drafter: %s; %s drafts", error,
                           path if drafter is not None else "nothing (the verifier alone)")
    if twin is not None and drafter is not None:
        drafter.twin = twin
        return drafter
    if drafter is None:
        drafter = twin or _with_precision(NoDrafter(verifier_model.decoder.max_positions(),
                                                    len(task.target_dictionary)), "none")
    return drafter


def load_drafter(task, path: str, verifier_model):
    """Load a drafter checkpoint for ``task`` onto the verifier's device and dtype (its decoder
    in bf16 or its linear layers in int8 by --drafter-precision): a Spec-Drafter, a cached
    drafter, or a stock Transformer translation model (autoregressive drafter); returns its
    decoding adapter, which says its ``precision``."""
    state = with_verifier_copies(read_checkpoint("--drafter-path", path), verifier_model, path)
    arch = checkpoint_arch(state)
    if arch == "feature_drafter":
        if task.cfg.drafter_precision in ("bf16", "int8"):
            raise SpecNmtError(f"--drafter-precision {task.cfg.drafter_precision}: a feature "
                               "drafter drafts in the verifier's precision (drop the flag)")
        model = FeatureDrafterModel.beside(state, path, verifier_model)
        vocabulary = read_draft_vocabulary(state, path, task.target_dictionary, False)
        if vocabulary is not None:
            vocabulary = vocabulary.to(next(model.parameters()).device)
        return _with_precision(drafter_adapter(model, task.target_dictionary, vocabulary),
                               dtype_name(next(model.parameters()).dtype))  # fmt: skip
    autoregressive = arch is not None and arch.startswith("transformer")
    if not (is_nar_drafter(state) or autoregressive):
        raise SpecNmtError(
            f"--drafter-path {path} is neither a Spec-Drafter, a cached drafter, a feature "
            f"drafter nor a Transformer checkpoint (arch {arch}); train one with --task "
            "spec_translation --arch spec_drafter_small or cached_drafter_small, or with "
            "--task translation --arch feature_drafter or transformer"
        )
    if autoregressive:
        embeddings = state["model"].get("decoder.embed_tokens.weight")
        if embeddings is not None and embeddings.size(0) != len(task.target_dictionary):
            raise SpecNmtError(
                f"--drafter-path {path} has {embeddings.size(0)} target symbols but the "
                f"dictionary in {task.cfg.data} has {len(task.target_dictionary)}: drafter "
                "and verifier must share the data directory's dictionary"
            )
    vocabulary = read_draft_vocabulary(state, path, task.target_dictionary, autoregressive)
    model = load_beside(task, path, state, verifier_model)
    if autoregressive:
        refuse_the_verifier_as_drafter(model, verifier_model, path)
    check_pair(model, verifier_model)
    weights = next(model.parameters())
    if vocabulary is not None:  # before int8 or bf16, which then take the smaller projection
        vocabulary = vocabulary.to(weights.device)
        restrict_output(model.decoder, vocabulary)
    precision = drafter_precision(task.cfg.drafter_precision, weights.device.type,
                                  weights.dtype, isinstance(model, CachedDrafterModel))
    if precision == "bf16":
        adapter = drafter_adapter(_in_bf16(model), task.target_dictionary, vocabulary)
        if task.cfg.drafter_precision == "auto":
            # bf16 drafts depend a little on the batch (rounding by kernel shape): the relaxed
            # rule, whose translations the drafts decide, drafts with this fp32 copy
            # (decoding/drafter.py, drafter_for_rule), so that no translation depends on its
            # batch
            adapter.fp32_copy = _with_precision(
                drafter_adapter(model, task.target_dictionary, vocabulary), "fp32")
        return _with_precision(adapter, precision)
    if precision == "int8":
        model = _int8_linears(model)
    else:
        precision = dtype_name(weights.dtype)
    return _with_precision(drafter_adapter(model, task.target_dictionary, vocabulary), precision)


def _in_bf16(model):
    """A copy of a cached drafter with its decoder in bf16; the frozen encoder copy (the
    verifier's, unused in decoding) is shared, not copied."""
    encoder, model.encoder = model.encoder, None
    try:
        copied = copy.deepcopy(model)
    finally:
        model.encoder = encoder
    copied.encoder = encoder
    copied.decoder.to(torch.bfloat16)
    return copied


def _with_precision(adapter, precision: str):
    """The adapter, with what its drafter computes in (``precision``: fp32, fp16, bf16 or
    int8) for --stats and the benchmarks' records."""
    adapter.precision = precision
    return adapter


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(
        dtype, str(dtype))


def load_beside(task, path: str, state, reference_model):
    """The model of a checkpoint, on the device and in the dtype of ``reference_model``."""
    (model,), _ = checkpoint_utils.load_model_ensemble([path], task=task, state=state)
    reference = next(reference_model.parameters())
    return model.to(device=reference.device, dtype=reference.dtype).eval()


def read_checkpoint(flag: str, path: str):
    if not os.path.isfile(path):
        raise SpecNmtError(f"{flag} {path}: no such file")
    return checkpoint_utils.load_checkpoint_to_cpu(path)


def drafter_adapter(model, dictionary, vocabulary: Optional[torch.Tensor] = None):
    """The decoding loop's adapter for a drafter model: the one its ``decoding_adapter`` makes
    (every drafter model of drafters/ has one; over ``vocabulary`` when given, see
    read_draft_vocabulary), or for any other fairseq translation model the autoregressive
    drafter."""
    pad, eos = dictionary.pad(), dictionary.eos()
    if hasattr(model, "decoding_adapter"):
        return model.decoding_adapter(pad, eos, vocabulary)
    return ArDrafter(model, pad, eos)


def refuse_the_verifier_as_drafter(drafter_model, verifier_model, path: str) -> None:
    """Refuse an autoregressive drafter that is the verifier itself (e.g. ``--drafter-path
    verifier.pt``): it would draft at the verifier's own cost, slower than the verifier alone,
    and nothing would say why."""
    ours, theirs = drafter_model.state_dict(), verifier_model.state_dict()
    if ours.keys() == theirs.keys() and all(same_weights(ours[n], theirs[n]) for n in ours):
        raise SpecNmtError(
            f"--drafter-path {path} is the verifier itself; give a drafter (a Spec-Drafter, a "
            "cached drafter, or a smaller Transformer), or --block-size 0 to decode with the "
            "verifier alone"
        )


def load_paired_verifier(task, flag: str, path: str, drafter_model):
    """The verifier checkpoint ``path`` (given as ``flag``) that ``drafter_model`` is trained or
    measured with, beside it on its device and dtype, in eval mode; refused when it is a drafter
    or not the verifier the drafter was trained with."""
    verifier = load_beside(task, path, read_checkpoint(flag, path), drafter_model)
    if isinstance(verifier, SpecDrafterModel):
        raise SpecNmtError(
            f"{flag} {path} is a drafter; give the verifier (a Transformer trained with "
            "--task translation)"
        )
    check_pair(drafter_model, verifier)
    return verifier


def check_pair(drafter_model, verifier_model) -> None:
    """Refuse a verifier that is not the one the drafter was trained with, where the drafter
    can tell (a cached drafter holds a copy of its verifier's encoder)."""
    check = getattr(drafter_model, "check_verifier_matches", None)
    if check is not None:
        check(verifier_model)


# The checkpoint key of a drafter's draft vocabulary (scripts/export_model.py writes it).
DRAFT_VOCABULARY_KEY = "draft_vocabulary"


def read_draft_vocabulary(state, path: str, dictionary,
                          autoregressive: bool) -> Optional[torch.Tensor]:  # fmt: skip
    """The ascending target symbol ids a drafter checkpoint drafts over (None: all of them),
    checked against the target ``dictionary``: every id a symbol of it, EOS among them, PAD
    not."""
    vocabulary = state.get(DRAFT_VOCABULARY_KEY)
    if vocabulary is None:
        return None
    problem = None
    if autoregressive:
        problem = ("only the NAR drafters (Spec-Drafter, cached) and the feature drafter draft "
                   "over a vocabulary")
    elif not isinstance(vocabulary, torch.Tensor) or vocabulary.dim() != 1 or (
        vocabulary.is_floating_point() or vocabulary.numel() == 0
    ):
        problem = "it must be a non-empty 1-d tensor of symbol ids"
    elif not bool((vocabulary[1:] > vocabulary[:-1]).all()):
        problem = "its ids must be ascending and distinct"
    elif int(vocabulary[0]) < 0 or int(vocabulary[-1]) >= len(dictionary):
        problem = f"its ids must be symbols of the {len(dictionary)}-symbol target dictionary"
    elif dictionary.pad() in vocabulary.tolist() or dictionary.eos() not in vocabulary.tolist():
        problem = "it must hold EOS and not PAD"
    if problem:
        raise SpecNmtError(f"--drafter-path {path}: bad {DRAFT_VOCABULARY_KEY}: {problem}")
    return vocabulary.long()


def with_mask(dictionary):
    if MASK_SYMBOL in dictionary.indices:
        return dictionary
    extended = copy.deepcopy(dictionary)
    extended.add_symbol(MASK_SYMBOL, n=0)
    return extended


# The layers that --drafter-precision int8 quantizes: the feed-forward layers and the output
# projection, where int8 paid (2-5x on a CPU) before the packed fp32 products. The attention
# projections stay: int8 was slower there, and fairseq's own attention reads their weights as
# tensors.
INT8_LAYERS = ("fc1", "fc2", "output_projection")


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX tiles); elsewhere
    oneDNN converts, and bf16 products lose their edge."""
    # (private checks of torch.cpu: a torch without them is taken for a CPU without)
    return any(getattr(torch.cpu, check, lambda: False)()
               for check in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def drafter_precision(precision: str, device_type: str, dtype: torch.dtype,
                      cached: bool) -> str:  # fmt: skip
    """What a drafter whose weights are on ``device_type`` in ``dtype`` computes in: "fp32"
    (as loaded, the verifier's precision), "bf16" or "int8" (both on the CPU in fp32 only; bf16
    for a ``cached`` drafter only). ``auto`` takes bf16 where a cached drafter runs on a CPU
    with native bf16 products: half the weight bytes per call, which is what a drafter call
    costs there (BENCHMARKS.md, "The loop on the CPU"), for the same acceptance. bf16 drafts
    depend a little on the batch (rounding by kernel shape), so load_drafter gives auto's an
    fp32 copy for the relaxed rule."""
    if precision not in DRAFTER_PRECISION_NAMES:
        raise SpecNmtError(f"--drafter-precision must be one of "
                           f"{', '.join(DRAFTER_PRECISION_NAMES)}, got {precision!r}")  # fmt: skip
    cpu_fp32 = device_type == "cpu" and dtype == torch.float32
    if precision in ("bf16", "int8") and not cpu_fp32:
        raise SpecNmtError(f"--drafter-precision {precision} runs on the CPU in fp32 only (add "
                           "--cpu, drop --fp16)")  # fmt: skip
    if precision == "bf16" and not cached:
        raise SpecNmtError("--drafter-precision bf16 serves the cached drafter only (the "
                           "bundled kind); drop the flag for this drafter")  # fmt: skip
    if precision == "auto":
        return "bf16" if cpu_fp32 and cached and native_bf16() else "fp32"
    return precision


def _int8_linears(model):
    """The model with its feed-forward and output layers dynamically quantized to int8 (int8
    weights, activations quantized per call); drafts only decide what gets accepted."""
    quantized = {
        name: torch.ao.quantization.default_dynamic_qconfig
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in INT8_LAYERS
    }
    with warnings.catch_warnings():  # torch.ao's deprecation notice for eager-mode quantization
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, quantized, dtype=torch.qint8)


def drafts_over_vocabulary(state) -> bool:
    """Whether a drafter checkpoint's drafter can draft over a draft vocabulary: a NAR drafter
    (not a CTC one, whose blank is outside any vocabulary) or a feature drafter."""
    if getattr(model_config(state), "ctc_upsample", 0):
        return False
    return is_nar_drafter(state) or checkpoint_arch(state) == "feature_drafter"


def is_nar_drafter(state) -> bool:
    """Whether a checkpoint is a NAR drafter: a Spec-Drafter or a cached drafter."""
    model_class = ARCH_MODEL_REGISTRY.get(checkpoint_arch(state))
    return model_class is not None and issubclass(model_class, SpecDrafterModel)
