"""Let torch >= 2.6 load fairseq checkpoints (see spec_nmt_torch_load), name the file when one
cannot be read, and save loaded checkpoints back in the form fairseq writes.

fairseq's tools print a long traceback for a truncated or corrupt checkpoint, or for one trained
with another dictionary than the data directory's (whether given as --path, --drafter-path or in
a model directory); wrapping fairseq's two loaders turns these into one line naming the file.
"""

import functools
from typing import Any, Callable, Dict, Optional

import torch
from fairseq import checkpoint_utils
from omegaconf import OmegaConf
from torch import Tensor

from spec_nmt.errors import SpecNmtError
from spec_nmt.files import written_whole
from spec_nmt_torch_load import allow_fairseq_checkpoint_types

allow_fairseq_checkpoint_types()  # also done at fairseq import where spec-nmt is installed

# The checkpoint key of a drafter exported without its copies of the verifier's weights
# (spec_nmt/compact_drafter.py): such a file loads only beside its verifier.
VERIFIER_COPIES_KEY = "verifier_copies"


def map_tied(weights: Dict[str, Tensor], convert: Callable[[str, Tensor], Tensor]):
    """``weights`` with ``convert(name, tensor)`` applied once per tensor: names that share one
    (tied embeddings and output projection) still share the result, so a saved file stores
    it once. Equal tensors count as one: fairseq saves a model trained on a GPU by moving each
    tensor to the CPU alone, which unties them."""
    done = []  # (tensor, its result)
    mapped = {}
    for name, tensor in weights.items():
        for seen, result in done:
            if seen.shape == tensor.shape and seen.dtype == tensor.dtype and (
                seen.data_ptr() == tensor.data_ptr() or torch.equal(seen, tensor)
            ):
                mapped[name] = result
                break
        else:
            mapped[name] = convert(name, tensor)
            done.append((tensor, mapped[name]))
    return mapped


def model_config(state) -> Optional[Any]:
    """The model configuration saved in a checkpoint state (``cfg.model``, or the ``args`` of
    older fairseq checkpoints); its options read with ``getattr``."""
    cfg = state.get("cfg")
    if cfg is not None and cfg.get("model") is not None:
        return cfg["model"]
    return state.get("args")


def checkpoint_arch(state) -> Optional[str]:
    model = model_config(state)
    return getattr(model, "arch", None) or getattr(model, "_name", None)


def save_checkpoint(state, path) -> None:
    """Save a state from ``checkpoint_utils.load_checkpoint_to_cpu`` as fairseq saves one: the
    configuration as plain containers, which torch.load(weights_only=True) accepts. Written
    aside and renamed: a stop while saving leaves the old file or none, never half a file."""
    if OmegaConf.is_config(state.get("cfg")):
        plain = OmegaConf.to_container(state["cfg"], resolve=True, enum_to_str=True)
        state = dict(state, cfg=plain)
    with written_whole(path) as partial:
        torch.save(state, partial)


def _naming_unreadable_files(load):
    @functools.wraps(load)
    def load_checkpoint_to_cpu(path, *args, **kwargs):
        try:
            return load(path, *args, **kwargs)
        except FileNotFoundError as error:
            raise SpecNmtError(f"checkpoint {path}: no such file") from error
        except Exception as error:  # torch.load's errors for truncated, corrupt, foreign files
            reason = str(error).split(". ")[0].splitlines()[0] if str(error) else ""
            raise SpecNmtError(
                f"{path} is not a readable fairseq checkpoint ({type(error).__name__}: {reason}); "
                "it is truncated, corrupt or not a checkpoint: copy it again or re-save it"
            ) from error

    return load_checkpoint_to_cpu


def _naming_mismatched_files(load):
    @functools.wraps(load)
    def load_model_ensemble_and_task(filenames, *args, **kwargs):
        try:
            return load(filenames, *args, **kwargs)
        except RuntimeError as error:
            if "Missing key(s)" in str(error):
                for name in filenames:
                    if VERIFIER_COPIES_KEY in checkpoint_utils.load_checkpoint_to_cpu(name):
                        raise SpecNmtError(
                            f"{name} is a Spec-Drafter, not a verifier: a drafter stored "
                            "without its copy of the verifier's encoder, which loads only as "
                            "--drafter-path (drafter.pt) beside that verifier (--path)"
                        ) from error
            mismatch = [line.strip() for line in str(error).splitlines() if "size mismatch" in line]
            if not mismatch:
                raise
            raise SpecNmtError(
                f"{', '.join(map(str, filenames))} does not fit the model built from the data "
                f"directory ({mismatch[0]}): it was trained with another dictionary (dict.*.txt) "
                "or architecture; use the data directory or model directory it was trained with"
            ) from error

    return load_model_ensemble_and_task


if not hasattr(checkpoint_utils.load_checkpoint_to_cpu, "__wrapped__"):
    checkpoint_utils.load_checkpoint_to_cpu = _naming_unreadable_files(
        checkpoint_utils.load_checkpoint_to_cpu
    )
    checkpoint_utils.load_model_ensemble_and_task = _naming_mismatched_files(
        checkpoint_utils.load_model_ensemble_and_task
    )
