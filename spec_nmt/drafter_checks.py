"""Checks of a drafter against the verifier it is loaded beside."""

from spec_nmt.errors import SpecNmtError
from spec_nmt.models.cached_drafter import same_weights


def refuse_the_verifier_as_drafter(drafter_model, verifier_model, path: str) -> None:
    """Refuse an autoregressive drafter that is the verifier itself (e.g. ``--drafter-path
    verifier.pt``): it would draft at the verifier's own cost, slower than the verifier alone,
    and nothing would say why."""
    ours, theirs = drafter_model.state_dict(), verifier_model.state_dict()
    if ours.keys() == theirs.keys() and all(same_weights(ours[n], theirs[n]) for n in ours):
        raise SpecNmtError(
            f"--drafter-path {path} is the verifier itself; give a drafter (a Spec-Drafter, a "
            "cached or heads drafter, or a smaller Transformer), or --block-size 0 to decode "
            "with the verifier alone"
        )
