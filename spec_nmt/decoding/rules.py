"""The table of verification rules: each one's acceptance over a draft tree and what its drafts
must be. A new rule is one entry here (and its pure functions in verify.py or tree.py); the
settings, the task's ``--verify`` choices and the generator read this table."""

from typing import Callable, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from spec_nmt.decoding.tree import DraftTree, accept_top_beta_tree, recursive_rejection
from spec_nmt.decoding.verify import accept_top_beta, sampling_probs, speculative_sample

# (tree, constrained logits [B, N+1, V], settings, eos, generator)
#   -> (path [B, depth] of accepted node indices padded with -1, n_accepted [B], next token [B])
Accept = Callable[[DraftTree, Tensor, object, int, Optional[torch.Generator]],
                  Tuple[Tensor, Tensor, Tensor]]  # fmt: skip


class Rule(NamedTuple):
    accept: Accept
    sampled_drafts: bool  # drafts drawn from the drafter (else its best tokens)
    trees: bool  # drafts may branch (else always a chain of block_size)
    # the tree drawn when no tree flag is given (--tree-branching's form); None: a chain
    default_branching: Optional[str] = None


def _chain_path(tree: DraftTree, n_accepted: Tensor) -> Tensor:
    chain = torch.arange(tree.tokens.size(1), device=tree.tokens.device).expand_as(tree.tokens)
    return torch.where(chain < n_accepted.unsqueeze(1), chain, torch.full_like(chain, -1))


def _top_beta(tree, logits, settings, eos, generator):
    if not settings.draft_plan.is_chain:
        return accept_top_beta_tree(tree, logits, settings.beta, settings.tau, eos)
    n_accepted, next_tokens = accept_top_beta(tree.tokens, logits, settings.beta, settings.tau, eos)
    return _chain_path(tree, n_accepted), n_accepted, next_tokens


def _speculative_sampling(tree, logits, settings, eos, generator):
    probs = sampling_probs(logits, settings.sampling_topk, settings.sampling_topp)
    k = tree.tokens.size(1)
    n_accepted, next_tokens = speculative_sample(
        tree.tokens, tree.draft_probs[:, :k], probs, eos, generator
    )
    return _chain_path(tree, n_accepted), n_accepted, next_tokens


def _recursive_rejection(tree, logits, settings, eos, generator):
    probs = sampling_probs(logits, settings.sampling_topk, settings.sampling_topp)
    return recursive_rejection(tree, probs, eos, generator)


RULES = {
    "top_beta": Rule(_top_beta, sampled_drafts=False, trees=True),
    "sampling": Rule(_speculative_sampling, sampled_drafts=True, trees=False),
    # RSD-C 3,1: the most tokens per verifier call of the 6-node trees on newstest2013
    # (BENCHMARKS.md)
    "rsd": Rule(_recursive_rejection, sampled_drafts=True, trees=True, default_branching="3,1"),
}
