"""What each iteration of the decoding loop did, as plain data (``generate(..., trace=[])``):
for scripts/trace.py's pages and the benchmark's acceptance diagnosis."""

from dataclasses import dataclass
from typing import List

from torch import Tensor

from spec_nmt.decoding.tree import DraftTree


@dataclass
class IterationRecord:
    """What one iteration did for one sentence (``generate(..., trace=[])``), as plain data."""

    sentence: int  # row of the batch
    prefix: List[int]  # verified output tokens before the iteration
    draft_tokens: List[int]  # the draft tree's nodes ...
    draft_parents: List[int]  # ... and each node's parent (-1: the root)
    candidates: List[List[int]]  # per block entry: the verifier's best tokens (beta, at least 3)
    candidate_logprobs: List[List[float]]
    accepted_path: List[int]  # accepted nodes, root to leaf
    next_token: int  # the verifier's token after them
    next_kind: str  # "correction" (after a rejection) or "bonus" (after a leaf)
    ended_by_accepted_eos: bool


def trace_records(rows, tree: DraftTree, logits: Tensor, normalizer: Tensor, path: Tensor,
                  n_accepted: Tensor, next_tokens: Tensor, beta: int, eos: int):  # fmt: skip
    """What one iteration did for each live row of ``rows`` (the loop's BatchRows), as plain
    Python data: the verified prefix, the draft tree, the verifier's best candidates at every
    block entry (its beta best, at least 3) with log-probs, the accepted path and the
    correction/bonus token."""
    n_best = min(max(beta, 3), logits.size(2))
    best_logits, best_tokens = logits.topk(n_best, dim=2)
    best_logprobs = best_logits - normalizer.unsqueeze(2)
    records = []
    for i, sentence in enumerate(rows.sentences):
        if not rows.live[i]:
            continue
        n = int(n_accepted[i])
        accepted = path[i, :n].tolist()
        # a bonus token follows an entry without children to try; else a correction
        leaf = _is_leaf(tree, i, accepted[-1] if n else -1)
        records.append(IterationRecord(
            sentence=sentence,
            prefix=rows.tokens[i, 1 : int(rows.lengths[i]) + 1].tolist(),
            draft_tokens=tree.tokens[i].tolist(),
            draft_parents=tree.parents[i].tolist(),
            candidates=best_tokens[i].tolist(),
            candidate_logprobs=best_logprobs[i].float().tolist(),
            accepted_path=accepted,
            next_token=int(next_tokens[i]),
            next_kind="bonus" if leaf else "correction",
            ended_by_accepted_eos=bool(n and tree.tokens[i, accepted[-1]] == eos),
        ))  # fmt: skip
    return records


def _is_leaf(tree: DraftTree, row: int, node: int) -> bool:
    """Whether a node (-1: the root) of a row's draft tree has no valid children."""
    return not bool((tree.parents[row].eq(node) & tree.valid[row]).any())
