"""Every acceptance rule, chain and tree, as pure functions on tensors (no models, caches or
dictionaries), and the ``RULES`` table that the decoding loop reads. A new rule is its functions,
one entry in this table and one in ``settings.VERIFY_RULES`` (the drafts it judges, which the
settings and the ``--verify`` choices read).

Letters follow the design documents: p is the drafter, q the verifier. A rule looks at the drafts
and the verifier's scores for ``[pending token, drafts]`` and returns which drafted tokens are
*accepted* and the token the verifier puts after them: the *correction* token at the first
rejection, or the *bonus* token after a fully accepted path.
"""

from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from spec_nmt.decoding.tree import DraftTree, before_any_eos


def accepted_count(
    passes: Tensor, draft_tokens: Tensor, eos: int, valid: Optional[Tensor] = None
) -> Tensor:
    """Accepted drafts per row [B]: the leading run of drafts that pass [B, k], none after an
    accepted EOS (the sentence ends there) nor at a slot that is not ``valid`` [B, k] (the
    row's chain ended before it)."""
    counted = passes & before_any_eos(draft_tokens, eos)
    if valid is not None:
        counted &= valid
    return counted.long().cumprod(dim=1).sum(dim=1)


def accept_top_beta(
    draft_tokens: Tensor,  # [B, k] long
    verifier_scores: Tensor,  # [B, k+1, V] float: log-probs, or logits
    beta: int,
    tau: float,
    eos: int,
    valid: Optional[Tensor] = None,  # [B, k] bool: the drafts that count (None: all)
) -> Tuple[Tensor, Tensor]:
    """SpecDec's top-beta/tau rule (Xia et al., 2023).

    Drafted token i is accepted while every token before it was accepted, it is among the
    verifier's ``beta`` best tokens at i, and its log-prob is within ``tau`` of the best one.
    Nothing is accepted after an accepted EOS (the sentence ends there) or at a slot that is
    not ``valid`` (a row's chain ended before it, e.g. under --draft-stop).
    With ``beta=1, tau=0`` a drafted token is accepted only when it is the verifier's own pick,
    so the output is exactly the verifier's greedy decoding.

    The rule compares only tokens of the same position, so logits (log-probs shifted by each
    position's normaliser) give the same decisions without normalising [B, k+1, V].

    Returns ``(n_accepted [B], next_tokens [B])``: ``next_tokens`` is the verifier's best token at
    position ``n_accepted`` (meaningless for rows whose accepted drafts end with EOS).
    """
    batch, k = draft_tokens.shape
    if verifier_scores.shape[:2] != (batch, k + 1):  # a caller's bug, not a user's
        raise ValueError(
            f"verifier_scores must be [B, k+1, V] = [{batch}, {k + 1}, V], "
            f"got {list(verifier_scores.shape)}"
        )
    # The same call picks both the best token and the candidates, so beta=1 accepts a draft
    # exactly when it is the token the rule puts there itself (ties included). For beta=1 that
    # call is max (the first best index, as topk(1)), faster than topk over thousands of columns.
    if beta == 1:
        best_scores, best_tokens = verifier_scores.max(dim=-1)
        top_logprobs, top_tokens = best_scores.unsqueeze(-1), best_tokens.unsqueeze(-1)
    else:
        top_logprobs, top_tokens = verifier_scores.topk(beta, dim=-1)  # [B, k+1, beta]
    next_candidates = top_tokens[:, :, 0]  # [B, k+1]
    if k == 0:
        return draft_tokens.new_zeros(batch), next_candidates[:, 0]

    block_top_tokens = top_tokens[:, :k]
    in_top_beta = block_top_tokens.eq(draft_tokens.unsqueeze(-1)).any(dim=-1)  # [B, k]
    draft_logprobs = verifier_scores[:, :k].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    within_tau = draft_logprobs >= top_logprobs[:, :k, 0] - tau
    n_accepted = accepted_count(in_top_beta & within_tau, draft_tokens, eos, valid)
    next_tokens = next_candidates.gather(1, n_accepted.unsqueeze(1)).squeeze(1)
    return n_accepted, next_tokens


def sampling_probs(scores: Tensor, topk: int = -1, topp: float = -1.0) -> Tensor:
    """The distribution fairseq's ``--sampling`` draws from, normalised: [..., V] log-probs or
    logits (temperature already applied) → probs. As in fairseq's ``Sampling`` search, top-p wins
    over top-k, and top-p keeps the smallest set of best tokens whose mass reaches p."""
    probs = torch.softmax(scores.float(), dim=-1)
    if topp > 0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep_sorted = mass_before < topp
        keep_sorted[..., 0] = True
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
    elif topk > 0:
        threshold = probs.topk(min(topk, probs.size(-1)), dim=-1).values[..., -1:]
        probs = probs * (probs >= threshold)
    return probs / probs.sum(dim=-1, keepdim=True)


def residual(verifier_probs: Tensor, draft_probs: Tensor) -> Tensor:
    """norm(max(0, q - p)): where to sample after rejecting a draft taken from p [..., V].

    Where q <= p everywhere (only possible when q == p, when no draft is ever rejected, or from
    float rounding) the residual has no mass; q itself is then returned.
    """
    excess = (verifier_probs - draft_probs).clamp(min=0)
    mass = excess.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, excess / mass.clamp(min=1e-30), verifier_probs)


def sample_from(probs: Tensor, generator: Optional[torch.Generator]) -> Tensor:
    """One token per row of probs [..., V] (rows need not be normalised)."""
    flat = probs.reshape(-1, probs.size(-1))
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def speculative_sample(
    draft_tokens: Tensor,  # [B, k] long, d_i drawn from draft_probs[:, i]
    draft_probs: Tensor,  # [B, k, V] p_i
    verifier_probs: Tensor,  # [B, k+1, V] q_i (q_k gives the bonus token)
    eos: int,
    generator: Optional[torch.Generator] = None,
    uniforms: Optional[Tensor] = None,  # [B, k]; drawn from generator when None
    valid: Optional[Tensor] = None,  # [B, k] bool: the drafts that count (None: all)
) -> Tuple[Tensor, Tensor]:
    """Speculative sampling (Leviathan et al., 2023; Chen et al., 2023): accept d_i with
    probability min(1, q_i(d_i) / p_i(d_i)) while all earlier drafts were accepted; at the first
    rejection the next token is a *correction* from norm(max(0, q_i - p_i)); after a fully
    accepted block it is a *bonus* token from q_k. The output is distributed exactly as sampling
    from q. Nothing is accepted after an accepted EOS. A row's chain ends before its first slot
    that is not ``valid``: reaching it, the next token is its bonus token.

    Returns ``(n_accepted [B], next_tokens [B])``.
    """
    batch, k = draft_tokens.shape
    if uniforms is None:
        uniforms = torch.rand(batch, k, generator=generator, device=draft_tokens.device)
    index = draft_tokens.unsqueeze(-1)
    q_of_draft = verifier_probs[:, :k].gather(-1, index).squeeze(-1)
    p_of_draft = draft_probs.gather(-1, index).squeeze(-1)
    # u < q/p, written without a division so that p = 0 (never drawn) cannot produce NaN.
    passes = uniforms * p_of_draft < q_of_draft
    n_accepted = accepted_count(passes, draft_tokens, eos, valid)

    rows = torch.arange(batch, device=draft_tokens.device)
    q_next = verifier_probs[rows, n_accepted]  # [B, V]
    rejected = n_accepted < k
    if valid is not None and k:  # reaching the end of a row's chain is no rejection
        rejected &= valid.gather(1, n_accepted.clamp(max=k - 1).unsqueeze(1)).squeeze(1)
    p_next = torch.zeros_like(q_next)
    p_next[rejected] = draft_probs[rows[rejected], n_accepted[rejected]].to(q_next.dtype)
    next_dist = torch.where(rejected.unsqueeze(1), residual(q_next, p_next), q_next)
    return n_accepted, sample_from(next_dist, generator)


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
    """The top-beta/tau rule (accept_top_beta) down a tree of greedy drafts.

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


# (tree, constrained logits [B, N+1, V], settings, eos, generator)
#   -> (path [B, depth] of accepted node indices padded with -1, n_accepted [B], next token [B])
Accept = Callable[[DraftTree, Tensor, object, int, Optional[torch.Generator]],
                  Tuple[Tensor, Tensor, Tensor]]  # fmt: skip


def _chain_path(tree: DraftTree, n_accepted: Tensor) -> Tensor:
    chain = torch.arange(tree.tokens.size(1), device=tree.tokens.device).expand_as(tree.tokens)
    return torch.where(chain < n_accepted.unsqueeze(1), chain, torch.full_like(chain, -1))


def _top_beta(tree, logits, settings, eos, generator):
    if not settings.draft_plan.is_chain:
        return accept_top_beta_tree(tree, logits, settings.beta, settings.tau, eos)
    n_accepted, next_tokens = accept_top_beta(tree.tokens, logits, settings.beta, settings.tau,
                                              eos, tree.valid)  # fmt: skip
    return _chain_path(tree, n_accepted), n_accepted, next_tokens


def _speculative_sampling(tree, logits, settings, eos, generator):
    probs = sampling_probs(logits, settings.sampling_topk, settings.sampling_topp)
    k = tree.tokens.size(1)
    n_accepted, next_tokens = speculative_sample(
        tree.tokens, tree.draft_probs[:, :k], probs, eos, generator, valid=tree.valid
    )
    return _chain_path(tree, n_accepted), n_accepted, next_tokens


def _recursive_rejection(tree, logits, settings, eos, generator):
    probs = sampling_probs(logits, settings.sampling_topk, settings.sampling_topp)
    return recursive_rejection(tree, probs, eos, generator)


RULES = {"top_beta": _top_beta, "sampling": _speculative_sampling, "rsd": _recursive_rejection}
