"""Draft trees (pure tensor code: no models, no caches).

A draft tree hangs below the *root*, the pending token (the last verified one, not yet fed to the
verifier). Nodes are stored level by level, so every row of a batch shares the depth of each node
index; a chain of k drafts is the tree whose node i has parent i-1. The verifier scores the block
``[root, node_0 .. node_{N-1}]``; block entry 0 is the root and entry i+1 is node i.

Sampled siblings are drawn *without replacement* (Gumbel-top-k, or stochastic beam search over
whole sequences, Kool et al., 2019) and stored in the order they were drawn, which is the order
recursive rejection sampling (Jeon et al., 2024) tries them in; greedy trees (top-beta/tau) hold
the drafter's best tokens, best first, or the sequences beam search over the drafter keeps.
Letters as in rules.py: p is the drafter, q the verifier.
"""

import functools
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor


class DraftTree(NamedTuple):
    """Read-only: a chain's parents and depths are shared by every chain of its length. The
    valid children of one node hold distinct tokens (the top-beta rule accepts the one holding
    the verifier's pick; every tree builder here draws siblings without replacement)."""

    tokens: Tensor  # [B, N] node tokens
    parents: Tensor  # [B, N] parent node index, -1 for the root
    depths: Tensor  # [N] depth of each node (1 = child of the root), non-decreasing
    valid: Tensor  # [B, N] False for slots that hold no draft (never accepted)
    # [B, N+1, V] the drafter distribution each entry's children were drawn from (entry 0 is
    # the root); None for greedy drafts, which the top-beta rule judges without p.
    draft_probs: Optional[Tensor] = None


def chain(tokens: Tensor, draft_probs: Optional[Tensor] = None,
          valid: Optional[Tensor] = None) -> DraftTree:  # fmt: skip
    """The tree of a single drafted block [B, k]: node i's parent is node i-1; every node holds
    a draft unless ``valid`` [B, k] says otherwise."""
    batch, k = tokens.shape
    parents, depths = _chain_shape(k, tokens.device)
    if valid is None:
        valid = torch.ones_like(tokens, dtype=torch.bool)
    return DraftTree(tokens, parents.expand(batch, k), depths, valid, draft_probs)


@functools.lru_cache(maxsize=None)
def _chain_shape(k: int, device: torch.device) -> Tuple[Tensor, Tensor]:
    """A chain's parents [1, k] and depths [k], built once per length (every iteration drafts
    one)."""
    depths = torch.arange(1, k + 1, device=device)
    return (depths - 2).unsqueeze(0), depths


def before_any_eos(tokens: Tensor, eos: int) -> Tensor:
    """[B, k] bool: whether no EOS comes before each position of ``tokens`` [B, k] (the position
    itself may hold one)."""
    is_eos = tokens.eq(eos)
    return is_eos.cumsum(dim=1) <= is_eos


def greedy_chain(tokens: Tensor, eos: int) -> DraftTree:
    """The chain of greedy drafts [B, k]; drafts after an EOS are empty slots."""
    return chain(tokens, valid=before_any_eos(tokens, eos))


def greedy_tree(best: Tensor, branching: Tuple[int, ...], eos: int) -> DraftTree:
    """The tree whose nodes at depth d each have as children the ``branching[d-1]`` best tokens
    of position d: ``best`` [B, k, m] holds each position's m >= max(branching) best tokens,
    best first (a NAR drafter's positions do not depend on the path above them). Children of an
    EOS node are empty slots. Every row shares the shape (parents expanded from one row)."""
    batch = best.size(0)
    parents, depths, rank, strict_ancestors = _product_shape(branching, best.device)
    tokens = best[:, depths - 1, rank]  # [B, N]
    after_eos = (tokens.eq(eos).unsqueeze(1) & strict_ancestors).any(dim=2)
    return DraftTree(tokens, parents.expand(batch, -1), depths, ~after_eos)


def beam_tree(best_logprobs: Tensor, best: Tensor, width: int, eos: int) -> DraftTree:
    """The tree that beam search of width ``width`` grows over a NAR drafter's positions
    (which do not depend on the path above them): level d holds the ``width`` most probable
    one-token extensions of level d-1's sequences, best first. ``best`` [B, k, m] holds each
    position's m >= width best tokens, best first, ``best_logprobs`` their log-probs. A
    sequence that ends in EOS is not extended. Equal to growing the tree with ``beam_step``
    over the whole vocabulary: a beam's ``width`` best extensions use only its position's
    ``width`` best tokens."""
    batch, depth, _ = best.shape
    empty = best.new_zeros(batch, 0)
    tokens, parents, valid = [empty], [empty], [empty.bool()]
    logprobs = best_logprobs.new_zeros(batch, 1)  # the root's
    extendable = torch.ones(batch, 1, dtype=torch.bool, device=best.device)
    for level in range(depth):
        beams = logprobs.masked_fill(~extendable, float("-inf"))
        candidates = beams.unsqueeze(2) + best_logprobs[:, level, :width].unsqueeze(1)
        logprobs, flat = candidates.flatten(1).topk(width, dim=1)  # [B, width], best first
        tokens.append(best[:, level].gather(1, flat % width))
        first_parent = (level - 1) * width  # the node index of the level above's first
        parents.append(flat // width + first_parent if level else torch.full_like(flat, -1))
        valid.append(logprobs.isfinite())
        extendable = valid[-1] & tokens[-1].ne(eos)
    depths = torch.arange(1, depth + 1, device=best.device).repeat_interleave(width)
    return DraftTree(torch.cat(tokens, 1), torch.cat(parents, 1), depths, torch.cat(valid, 1))


@functools.lru_cache(maxsize=None)
def _product_shape(branching: Tuple[int, ...], device: torch.device):
    """parents [1, N], depths [N], sibling rank [N] and strict ancestors [1, N, N] (bool, node j
    above node i) of the tree with ``branching[d-1]`` children per node at depth d, nodes level
    by level and each node's children together (grow_tree's order)."""
    parents, depths, rank = [], [], []
    level = [-1]  # the parents of the next level: the root
    for depth, width in enumerate(branching, start=1):
        first = len(parents)
        for parent in level:
            parents += [parent] * width
            rank += range(width)
        depths += [depth] * (len(parents) - first)
        level = list(range(first, len(parents)))
    parents_row = torch.tensor([parents], device=device)
    visible = block_visibility(parents_row)[:, 1:, 1:]  # nodes only
    strict = visible & ~torch.eye(len(parents), dtype=torch.bool, device=device)
    return (parents_row, torch.tensor(depths, device=device), torch.tensor(rank, device=device),
            strict)  # fmt: skip


def block_visibility(parents: Tensor) -> Tensor:
    """Tree attention: [B, N+1, N+1] bool, entry j visible to entry i iff j is i or an ancestor
    of i (the root, entry 0, is everybody's ancestor). Rows that share one shape (parents
    expanded from one row) get [1, N+1, N+1], built once per shape."""
    if parents.size(0) == 1 or parents.stride(0) == 0:
        return _shared_visibility(tuple(parents[0].tolist()), parents.device)
    return _visibility(parents)


@functools.lru_cache(maxsize=64)
def _shared_visibility(parents: Tuple[int, ...], device: torch.device) -> Tensor:
    return _visibility(torch.tensor([parents], dtype=torch.long, device=device))


def _visibility(parents: Tensor) -> Tensor:
    batch, n = parents.shape
    entry_parent = torch.cat([parents.new_zeros(batch, 1), parents + 1], dim=1)  # root → itself
    visible = torch.eye(n + 1, dtype=torch.bool, device=parents.device).repeat(batch, 1, 1)
    ancestor = torch.arange(n + 1, device=parents.device).expand(batch, -1)
    depth = 0  # climb one level per step until every entry has reached the root
    while bool(ancestor.ne(0).any()) and depth < n:
        depth += 1
        ancestor = entry_parent.gather(1, ancestor)
        visible.scatter_(2, ancestor.unsqueeze(2), True)
    return visible


def block_depths(tree: DraftTree) -> Tensor:
    """Depth of every block entry [N+1]: 0 for the root."""
    return torch.cat([tree.depths.new_zeros(1), tree.depths])


def gumbel_top_k(
    logprobs: Tensor, k: int, generator: Optional[torch.Generator]
) -> Tuple[Tensor, Tensor]:
    """k tokens per row of logprobs [..., V] drawn without replacement, in draw order
    (Gumbel-top-k). Returns (tokens [..., k], drawn [..., k]); drawn is False where fewer than
    k tokens have mass."""
    noise = -torch.empty_like(logprobs).exponential_(generator=generator).log()
    scores, tokens = (logprobs + noise).topk(k, dim=-1)
    return tokens, scores.isfinite()


def stochastic_beam_step(
    beam_logprobs: Tensor,  # [B, W] log p of each beam's sequence (phi)
    beam_scores: Tensor,  # [B, W] the beam's perturbed score G; -inf for no beam
    child_logprobs: Tensor,  # [B, W, V] log p of each next token after each beam
    width: int,
    generator: Optional[torch.Generator],
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """One level of stochastic beam search (Kool et al., 2019): perturb every extension with
    Gumbel noise conditioned on its parent's perturbed score being the maximum, keep the
    ``width`` best. The kept sequences are a sample without replacement from p over sequences.

    Returns (parent beam [B, width], token [B, width], logprob [B, width], score [B, width]),
    best first; score is -inf where fewer extensions exist.
    """
    batch, beams, vocab = child_logprobs.shape
    logprobs = beam_logprobs.unsqueeze(2) + child_logprobs
    noise = -torch.empty_like(logprobs).exponential_(generator=generator).log()
    perturbed = logprobs + noise
    top = perturbed.max(dim=2, keepdim=True).values
    parent_score = beam_scores.unsqueeze(2)
    # G = -log(exp(-T) - exp(-Z) + exp(-perturbed)), in the stable form of Kool et al. (App. B)
    v = parent_score - perturbed + _log1mexp(perturbed - top)
    scores = parent_score - v.clamp(min=0) - torch.log1p(torch.exp(-v.abs()))
    has_mass = logprobs.isfinite() & parent_score.isfinite()
    scores = torch.where(has_mass, scores, torch.full_like(scores, float("-inf")))
    best, flat = scores.view(batch, -1).topk(width, dim=1)
    parent, token = flat // vocab, flat % vocab
    return parent, token, logprobs.view(batch, -1).gather(1, flat), best


def beam_step(
    beam_logprobs: Tensor,  # [B, W] log p of each beam's sequence; -inf for no beam
    child_logprobs: Tensor,  # [B, W, V] log p of each next token after each beam
    width: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    """One level of (deterministic) beam search: the ``width`` most probable extensions.

    Returns (parent beam [B, width], token [B, width], logprob [B, width]), best first; logprob
    is -inf where fewer extensions exist. A parent's children hold distinct tokens."""
    batch, _, vocab = child_logprobs.shape
    logprobs = (beam_logprobs.unsqueeze(2) + child_logprobs).view(batch, -1)
    best, flat = logprobs.topk(width, dim=1)
    return flat // vocab, flat % vocab, best


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x <= 0, accurate on both sides of -log 2."""
    x = x.clamp(max=0)
    return torch.where(
        x > -0.6931, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x))
    )
