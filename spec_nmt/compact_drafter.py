"""Drafter checkpoints without their copies of the verifier.

A cached drafter carries a frozen copy of its verifier's encoder that it is checked against; in
the bundled pair that copy is over half the file. A feature drafter carries the whole verifier
(``VERIFIER_COPIES`` of each model class names the parts). ``without_verifier_copies``
(scripts/export_model.py) drops every tensor of that part that equals the verifier's and keeps a
fingerprint of them, plus the rows the drafter's embeddings have beyond the verifier's (its
[MASK]). ``with_verifier_copies`` (spec_nmt/loading.py's drafter loader) rebuilds them from the
verifier being loaded, and refuses a verifier whose fingerprint differs: the refusal the full
checkpoint gets from ``check_verifier_matches``.
"""

import hashlib
from typing import Dict, Iterable, Tuple

import torch
from fairseq.models import ARCH_MODEL_REGISTRY
from torch import Tensor

from spec_nmt.checkpoint_loading import VERIFIER_COPIES_KEY, checkpoint_arch
from spec_nmt.errors import SpecNmtError

# A checkpoint's VERIFIER_COPIES_KEY holds what was dropped: {"names": {drafter name: verifier
# name}, "extra_rows": {drafter name: rows beyond the verifier's}, "sha256": their fingerprint}.


def copied_parts(state) -> Dict[str, str]:
    """The parts a drafter checkpoint copies from its verifier, as {drafter prefix: the
    verifier's prefix of the same part} (a model class's ``VERIFIER_COPIES``; empty for a
    Spec-Drafter, whose encoder is its own)."""
    model_class = ARCH_MODEL_REGISTRY.get(checkpoint_arch(state))
    return getattr(model_class, "VERIFIER_COPIES", {})


def copies_verifier(state) -> bool:
    """Whether a drafter checkpoint holds copies of its verifier's parts."""
    return bool(copied_parts(state))


def _fingerprint(tensors: Iterable[Tuple[str, Tensor]]) -> str:
    """sha256 of names and fp16 values: fp16 because exported verifiers are stored in fp16 and a
    drafter trained on the fp32 checkpoint must still match them."""
    digest = hashlib.sha256()
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        digest.update(name.encode())
        value = tensor.detach().cpu()
        value = value.half() if value.is_floating_point() else value
        digest.update(value.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _verifier_name(name: str, parts: Dict[str, str]):
    for ours, theirs in parts.items():
        if name.startswith(ours):
            return theirs + name[len(ours) :]
    return None


def without_verifier_copies(weights: Dict[str, Tensor], verifier: Dict[str, Tensor], path,
                            parts: Dict[str, str]):  # fmt: skip
    """(the drafter's ``weights`` less its copies of the ``verifier``'s weights, the record that
    rebuilds them). A copied tensor that differs from the verifier's is refused: the drafter
    was trained on another verifier."""
    names, extra_rows, dropped = {}, {}, []
    for name, tensor in weights.items():
        theirs_name = _verifier_name(name, parts)
        if theirs_name is None:
            continue
        theirs = verifier.get(theirs_name)
        rows = tensor[: theirs.size(0)] if theirs is not None and tensor.dim() else tensor
        if theirs is None or rows.shape != theirs.shape or not torch.equal(
            rows.half() if rows.is_floating_point() else rows,
            theirs.half() if theirs.is_floating_point() else theirs,
        ):
            raise SpecNmtError(
                f"{path}: {name} is not the verifier's {theirs_name}: the drafter was trained "
                "on another verifier (export it with the verifier it was trained with)"
            )
        names[name] = theirs_name
        if tensor.dim() and tensor.size(0) > theirs.size(0):
            extra_rows[name] = tensor[theirs.size(0) :].clone()  # not the whole storage
        dropped.append((name, tensor))
    kept = {name: tensor for name, tensor in weights.items() if name not in names}
    record = {"names": names, "extra_rows": extra_rows, "sha256": _fingerprint(dropped)}
    return kept, record


def with_verifier_copies(state, verifier_model, path: str):
    """``state`` (a drafter checkpoint) with the tensors ``without_verifier_copies`` dropped
    rebuilt from ``verifier_model``, in the dtype of the drafter's own weights; unchanged if
    nothing was dropped."""
    record = state.get(VERIFIER_COPIES_KEY)
    if record is None:
        return state
    verifier = verifier_model.state_dict()
    dtype = next(t.dtype for t in state["model"].values() if t.is_floating_point())
    rebuilt = {}
    for name, theirs_name in record["names"].items():
        if theirs_name not in verifier:
            break
        tensor = verifier[theirs_name].detach().cpu()
        tensor = tensor.to(dtype) if tensor.is_floating_point() else tensor
        extra = record["extra_rows"].get(name)
        rebuilt[name] = tensor if extra is None else torch.cat([tensor, extra.to(tensor.dtype)])
    if len(rebuilt) < len(record["names"]) or _fingerprint(rebuilt.items()) != record["sha256"]:
        raise SpecNmtError(
            f"--drafter-path {path}: the drafter was trained on another verifier's weights (the "
            "fingerprint of its copy differs from this verifier's): it decodes only with the "
            "verifier it was trained with (--init-from-verifier, --verifier-path)"
        )
    model = dict(state["model"], **rebuilt)
    return dict(state, model=model)
