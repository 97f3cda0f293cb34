"""Draft trees (pure tensor code: no models, no caches).

A draft tree hangs below the *root*, the pending token (the last verified one, not yet fed to the
verifier). Nodes are stored level by level, so every row of a batch shares the depth of each node
index; a chain of k drafts is the tree whose node i has parent i-1. The verifier scores the block
``[root, node_0 .. node_{N-1}]``; block entry 0 is the root and entry i+1 is node i.

Sampled siblings are drawn *without replacement* (Gumbel-top-k, or stochastic beam search over
whole sequences, Kool et al., 2019) and stored in the order they were drawn, which is the order
recursive rejection sampling (Jeon et al., 2024) tries them in; greedy trees (top-beta/tau) hold
the drafter's best tokens, best first, or the sequences beam search over the drafter keeps.
Letters as in verify.py: p is the drafter, q the verifier.
"""

import functools
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from spec_nmt.decoding.verify import before_any_eos, residual, sample_from


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


def children_table(tree: DraftTree) -> Tensor:
    """[B, N+1, C]: the valid children of every block entry in draw order, padded with -1."""
    batch, n = tree.parents.shape
    parent_entry = torch.where(tree.valid, tree.parents + 1, torch.full_like(tree.parents, -1))
    same_parent = parent_entry.unsqueeze(2).eq(parent_entry.unsqueeze(1))  # [B, N, N]
    earlier = torch.ones(n, n, dtype=torch.bool, device=tree.tokens.device).tril(-1)
    rank = (same_parent & earlier).sum(dim=2)  # sibling rank of each node
    width = int(rank.max()) + 1 if n else 1
    table = torch.full((batch, n + 2, width), -1, dtype=torch.long, device=tree.tokens.device)
    # invalid nodes go to a scratch entry (the last) that is dropped below
    target = torch.where(parent_entry >= 0, parent_entry, torch.full_like(parent_entry, n + 1))
    nodes = torch.arange(n, device=tree.tokens.device).expand(batch, n)
    table.view(batch, -1).scatter_(1, target * width + rank, nodes)
    return table[:, : n + 1]


def recursive_rejection(
    tree: DraftTree,
    verifier_probs: Tensor,  # [B, N+1, V] q at every block entry
    eos: int,
    generator: Optional[torch.Generator] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Recursive rejection sampling down a draft tree (Jeon et al., 2024).

    At the current entry, try its children x_1, x_2, ... in draw order: accept x_i with
    probability min(1, q_i(x_i) / p_i(x_i)), where p_1 is the drafter distribution the siblings
    were drawn from and p_{i+1} is p_i without x_i, renormalised (sampling without replacement);
    after each rejection q_{i+1} = norm(max(0, q_i - p_i)). An accepted child becomes the current
    entry; when all children are rejected (or there are none), the next token is sampled from
    the last residual (a *correction*, or a *bonus* token from q at a leaf). The output is
    distributed exactly as sampling from q. An accepted EOS ends the sentence.

    Returns (path [B, depth] accepted node indices padded with -1, n_accepted [B],
    next_tokens [B]; meaningless where the path ends with EOS).
    """
    batch, n = tree.tokens.shape
    device = tree.tokens.device
    max_depth = int(tree.depths.max()) if n else 0
    children = children_table(tree)
    rows = torch.arange(batch, device=device)
    current = torch.zeros(batch, dtype=torch.long, device=device)
    active = torch.ones(batch, dtype=torch.bool, device=device)
    path = torch.full((batch, max_depth), -1, dtype=torch.long, device=device)
    n_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    if not n:  # no drafts: the verifier's own sample
        return path, n_accepted, sample_from(verifier_probs[:, 0], generator)
    next_tokens = torch.zeros(batch, dtype=torch.long, device=device)
    for depth in range(max_depth + 1):
        target = verifier_probs[rows, current].float()
        draft = tree.draft_probs[rows, current].float()
        chosen = torch.full_like(current, -1)
        for sibling in range(children.size(2)):
            child = children[rows, current, sibling]
            trying = active & chosen.lt(0) & child.ge(0)
            if not trying.any():
                break
            token = tree.tokens[rows, child.clamp(min=0)].unsqueeze(1)
            u = torch.rand(batch, generator=generator, device=device)
            p, q = draft.gather(1, token).squeeze(1), target.gather(1, token).squeeze(1)
            accept = trying & (u * p < q)
            chosen = torch.where(accept, child, chosen)
            reject = (trying & ~accept).unsqueeze(1)
            target = torch.where(reject, residual(target, draft), target)
            without = draft.scatter(1, token, 0.0)
            without = without / without.sum(dim=1, keepdim=True).clamp(min=1e-30)
            draft = torch.where(reject, without, draft)
        stops = active & chosen.lt(0)
        if stops.any():
            next_tokens = torch.where(stops, sample_from(target, generator), next_tokens)
        goes = active & chosen.ge(0)
        if depth < path.size(1):
            path[:, depth] = torch.where(goes, chosen, path[:, depth])
        n_accepted += goes.long()
        ended = goes & tree.tokens[rows, chosen.clamp(min=0)].eq(eos)
        active = goes & ~ended
        current = torch.where(goes, chosen + 1, current)
    return path, n_accepted, next_tokens


def accept_top_beta_tree(
    tree: DraftTree,
    verifier_scores: Tensor,  # [B, N+1, V] log-probs or logits at every block entry
    beta: int,
    tau: float,
    eos: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    """The top-beta/tau rule (verify.accept_top_beta) down a tree of greedy drafts.

    From the root, a child passes when its token is among the verifier's ``beta`` best at its
    parent's entry and within ``tau`` of the best log-prob there; of the passing children the one
    the verifier scores highest (the first drawn among equals) is accepted and becomes the
    current entry. Where no child passes, the verifier's best token at the current entry
    follows. With ``beta=1, tau=0`` only the child holding the verifier's own pick passes
    (siblings hold distinct tokens), so the output is exactly the verifier's greedy decoding, as
    with a chain. An accepted EOS ends the sentence.

    Every node is judged at once and the path found by propagating acceptance down the levels
    (no walk from entry to entry: a few tensor operations per level).

    Returns (path [B, depth] accepted node indices padded with -1, n_accepted [B],
    next_tokens [B]; meaningless where the path ends with EOS).
    """
    batch, n = tree.tokens.shape
    device = tree.tokens.device
    # the same call picks the best token and the candidates, so ties resolve alike (see
    # accept_top_beta); max is the fast form of topk(1)
    if beta == 1:
        best_tokens = verifier_scores.max(dim=-1).indices
    else:
        top_scores, top_tokens = verifier_scores.topk(beta, dim=-1)  # [B, N+1, beta]
        best_scores, best_tokens = top_scores[:, :, 0], top_tokens[:, :, 0]
    max_depth = int(tree.depths.max()) if n else 0
    if not n:
        empty = tree.tokens.new_zeros(batch, 0)
        return empty, empty.new_zeros(batch), best_tokens[:, 0]
    parent_entry = (tree.parents + 1).clamp(min=0)  # [B, N]: the entry each node is judged at
    nodes = torch.arange(n, device=device).expand(batch, n)
    unchosen = torch.full_like(nodes, n)
    if beta == 1:
        # only the verifier's best token passes (its score is the best: tau holds), and
        # siblings hold distinct tokens, so it is the one child accepted
        chosen = best_tokens.gather(1, parent_entry).eq(tree.tokens) & tree.valid
    else:
        node_scores = verifier_scores[
            torch.arange(batch, device=device).unsqueeze(1), parent_entry, tree.tokens
        ]
        in_top_beta = top_tokens.gather(
            1, parent_entry.unsqueeze(2).expand(-1, -1, top_tokens.size(2))
        ).eq(tree.tokens.unsqueeze(2)).any(dim=2)
        passes = (in_top_beta & (node_scores >= best_scores.gather(1, parent_entry) - tau)
                  & tree.valid)  # fmt: skip
        # each entry's accepted child: its best passing child, the first drawn among equals
        ranking = node_scores.masked_fill(~passes, float("-inf"))
        entry_best = ranking.new_full((batch, n + 1), float("-inf")).scatter_reduce(
            1, parent_entry, ranking, "amax"
        )
        chosen = passes & ranking.eq(entry_best.gather(1, parent_entry))
        first = unchosen.new_full((batch, n + 1), n).scatter_reduce(
            1, parent_entry, torch.where(chosen, nodes, unchosen), "amin"
        )
        chosen &= nodes.eq(first.gather(1, parent_entry))
    # on the path: chosen below an entry on the path (the root is; an accepted EOS ends it)
    on_path = chosen
    root = torch.ones(batch, 1, dtype=torch.bool, device=device)
    not_eos = tree.tokens.ne(eos)
    for _ in range(max_depth - 1):
        extends = torch.cat([root, on_path & not_eos], dim=1)
        on_path = chosen & extends.gather(1, parent_entry)
    n_accepted = on_path.sum(dim=1)
    path = torch.where(on_path, nodes, unchosen).sort(dim=1).values[:, :max_depth]
    path = path.masked_fill(path.eq(n), -1)  # nodes are stored level by level: depth order
    last_entry = torch.where(on_path, nodes + 1, torch.zeros_like(nodes)).max(dim=1).values
    return path, n_accepted, best_tokens.gather(1, last_entry.unsqueeze(1)).squeeze(1)
