"""Every acceptance rule on hand-built distributions and trees, with literal expectations or
chi-square tests (no models)."""

import math

import pytest
import torch
from fairseq.data import Dictionary
from fairseq.search import Sampling

from spec_nmt.decoding import rules
from spec_nmt.decoding import tree as trees
from spec_nmt.decoding.drafter import grow_tree
from spec_nmt.decoding.rules import (
    accept_top_beta,
    residual,
    sampling_probs,
    speculative_sample,
)
from spec_nmt.errors import SpecNmtError
from spec_nmt.settings import DecodingSettings, DraftPlan
from tests.stats import chi_square_pvalue
from tests.test_tree import DEPTHS, PARENTS, scores_with_best

EOS = 2
V = 6


def logprobs(*rows):
    """Verifier log-probs [1, len(rows), V] from per-position {token: log-prob} dicts; every
    other token gets -10."""
    table = torch.full((1, len(rows), V), -10.0)
    for position, entries in enumerate(rows):
        for token, value in entries.items():
            table[0, position, token] = value
    return table


def run(drafts, table, beta=1, tau=0.0):
    n, next_tokens = accept_top_beta(torch.tensor([drafts]), table, beta, tau, EOS)
    return int(n[0]), int(next_tokens[0])


def test_all_drafts_accepted_then_bonus_token():
    table = logprobs({4: -0.1}, {5: -0.2}, {3: -0.3}, {4: -0.05})
    assert run([4, 5, 3], table) == (3, 4)


def test_first_draft_rejected_gives_correction_only():
    table = logprobs({4: -0.1, 5: -1.0}, {5: -0.2}, {3: -0.3}, {4: -0.05})
    assert run([5, 5, 3], table) == (0, 4)


def test_later_match_after_a_rejection_is_not_accepted():
    table = logprobs({4: -0.1}, {5: -0.2, 3: -2.0}, {3: -0.3}, {4: -0.05})
    assert run([4, 3, 3], table) == (1, 5)


def test_beta_two_accepts_second_best_within_tau():
    table = logprobs({4: -0.5, 5: -0.9}, {3: -0.1}, {4: -0.1})
    assert run([5, 3], table, beta=2, tau=0.5) == (2, 4)
    assert run([5, 3], table, beta=1, tau=0.5) == (0, 4)


def test_tau_bounds_the_gap_to_the_best_token():
    table = logprobs({4: -0.5, 5: -1.5}, {3: -0.1}, {4: -0.1})
    assert run([5, 3], table, beta=2, tau=0.99) == (0, 4)
    assert run([5, 3], table, beta=2, tau=1.0) == (2, 4)  # exactly tau apart: accepted


def test_third_best_needs_beta_three():
    table = logprobs({4: -0.5, 5: -0.6, 3: -0.7}, {1: -0.1})
    assert run([3], table, beta=2, tau=5.0) == (0, 4)
    assert run([3], table, beta=3, tau=5.0) == (1, 1)


def test_tie_with_beta_one_follows_the_verifiers_own_choice():
    table = logprobs({4: -0.7, 5: -0.7}, {3: -0.1})
    _, verifier_pick = run([1], table)  # rejected: the correction is the rule's own pick
    assert verifier_pick in (4, 5)
    other = 9 - verifier_pick  # the other of tokens 4 and 5
    assert run([verifier_pick], table) == (1, 3)
    assert run([other], table) == (0, verifier_pick)
    assert run([other], table, beta=2) == (1, 3)  # both tied tokens are in the top 2


def test_accepted_eos_ends_the_block():
    table = logprobs({4: -0.1}, {EOS: -0.1}, {4: -0.1}, {5: -0.1})
    n, _ = run([4, EOS, 4], table)
    assert n == 2  # the draft after EOS matches the verifier but is not accepted


def test_rejected_eos_draft():
    table = logprobs({4: -0.1}, {5: -0.1, EOS: -3.0}, {4: -0.1})
    assert run([4, EOS], table) == (1, 5)


def test_rows_of_a_batch_are_independent():
    first = logprobs({4: -0.1}, {5: -0.1}, {3: -0.1})
    second = logprobs({3: -0.1}, {5: -0.1}, {4: -0.1})
    drafts = torch.tensor([[4, 5], [4, 5]])
    n, next_tokens = accept_top_beta(drafts, torch.cat([first, second]), 1, 0.0, EOS)
    assert n.tolist() == [2, 0]
    assert next_tokens.tolist() == [3, 3]


def test_empty_block_gives_the_verifiers_token():
    table = logprobs({5: -0.1})
    n, next_tokens = accept_top_beta(torch.zeros(1, 0, dtype=torch.long), table, 1, 0.0, EOS)
    assert (int(n[0]), int(next_tokens[0])) == (0, 5)


def test_forbidden_tokens_are_never_accepted_even_in_top_beta():
    table = logprobs({4: 0.0}, {3: -0.1})
    table[0, 0, 5] = -math.inf  # e.g. pad, or any token at a forced-EOS step
    table[0, 0, [0, 1, 2, 3]] = -math.inf
    assert run([5], table, beta=V, tau=1e9) == (0, 4)


def test_shape_mismatch_is_a_programming_error_with_traceback():
    with pytest.raises(ValueError, match=r"\[B, k\+1, V\]") as raised:
        accept_top_beta(torch.tensor([[1, 2]]), torch.zeros(1, 2, V), 1, 0.0, EOS)
    assert not isinstance(raised.value, SpecNmtError)


@pytest.mark.parametrize("beta, tau", [(0, 0.0), (-1, 0.0), (1.5, 0.0), (1, -0.1), (1, math.nan)])
def test_invalid_parameters(beta, tau):
    with pytest.raises(SpecNmtError):
        DecodingSettings(beta=beta, tau=tau)


def test_children_table_keeps_draw_order_and_skips_empty_slots():
    valid = torch.tensor([[True, True, True, False, True, True]])
    tree = trees.DraftTree(torch.arange(6).unsqueeze(0), PARENTS, DEPTHS, valid)
    table = rules.children_table(tree)[0].tolist()
    assert table == [[0, 1], [2, -1], [4, -1], [5, -1], [-1, -1], [-1, -1], [-1, -1]]


def test_residual_on_hand_built_distributions():
    q = torch.tensor([0.5, 0.3, 0.2])
    p = torch.tensor([0.2, 0.6, 0.2])
    assert torch.allclose(residual(q, p), torch.tensor([1.0, 0.0, 0.0]))
    q = torch.tensor([0.4, 0.4, 0.2])
    p = torch.tensor([0.1, 0.3, 0.6])
    assert torch.allclose(residual(q, p), torch.tensor([0.75, 0.25, 0.0]))
    assert torch.equal(residual(q, q), q)  # no mass left: fall back to q


def test_speculative_sample_forced_decisions():
    p = torch.tensor([[[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]])
    q = torch.tensor([[[0.25, 0.75, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]]])
    drafts = torch.tensor([[0, 3]])
    # q/p at d_1 = 0.5: u = 0.4 accepts it, then q/p at d_2 = 4 accepts: bonus from q_2 = token 0
    n, nxt = speculative_sample(drafts, p, q, EOS, uniforms=torch.tensor([[0.4, 0.99]]))
    assert (n.item(), nxt.item()) == (2, 0)
    # u = 0.6 rejects d_1: correction from norm(max(0, q_1 - p_1)) = token 1 for sure
    n, nxt = speculative_sample(drafts, p, q, EOS, uniforms=torch.tensor([[0.6, 0.0]]))
    assert (n.item(), nxt.item()) == (0, 1)
    # nothing is accepted after an accepted EOS
    p_eos = torch.tensor([[[0.0, 0.0, 1.0, 0.0], [0.25] * 4]])
    q_eos = torch.tensor([[[0.0, 0.0, 1.0, 0.0], [0.25] * 4, [0.25] * 4]])
    n, _ = speculative_sample(torch.tensor([[EOS, 3]]), p_eos, q_eos, EOS,
                              uniforms=torch.zeros(1, 2))  # fmt: skip
    assert n.item() == 1


def test_a_chains_slots_that_are_not_valid_are_never_accepted():
    """Slots after a row's stop (DraftTree.valid false) end its chain under both chain rules,
    however well their tokens would pass; speculative sampling then draws the bonus token from
    q there, not a correction from the residual."""
    table = logprobs({3: -0.1}, {4: -0.1}, {5: -0.1})
    drafts = torch.tensor([[3, 4], [3, 4]])
    valid = torch.tensor([[True, False], [True, True]])
    n, next_tokens = accept_top_beta(drafts, table.expand(2, -1, -1), 1, 0.0, EOS, valid)
    assert n.tolist() == [1, 2] and next_tokens.tolist() == [4, 5]
    rows = 400
    p = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]).expand(rows, -1, -1)
    q = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5],
                      [0.25] * 4]).expand(rows, -1, -1)  # fmt: skip
    drafts = torch.tensor([[0, 3]]).expand(rows, -1)
    valid = torch.tensor([[True, False]]).expand(rows, -1)
    generator = torch.Generator().manual_seed(0)
    n, next_tokens = speculative_sample(drafts, p, q, EOS, generator, valid=valid)
    assert n.eq(1).all()
    # q_1 draws tokens 2 and 3; the residual max(0, q_1 - p_1) would give token 2 only
    assert set(next_tokens.tolist()) == {2, 3}


@pytest.mark.parametrize("topk,topp", [(2, -1.0), (-1, 0.6), (-1, 0.95), (3, 0.5)])
def test_sampling_probs_keep_what_fairseq_sampling_keeps(topk, topp):
    torch.manual_seed(0)
    logprobs = torch.randn(3, 1, 9).log_softmax(-1)
    probs = sampling_probs(logprobs, topk, topp)
    assert torch.allclose(probs.sum(-1), torch.ones(3, 1))
    search = Sampling(Dictionary(), sampling_topk=topk, sampling_topp=topp)
    if topp > 0:
        kept_probs, kept_index = search._sample_topp(logprobs.clone())
        kept_index = [set(i[p > 0].tolist()) for i, p in zip(kept_index[:, 0], kept_probs[:, 0])]
    else:
        kept_index = [set(i.tolist()) for i in logprobs.topk(topk).indices[:, 0]]
    assert [set(row.nonzero().flatten().tolist()) for row in probs[:, 0]] == kept_index


def joint_counts(path_tokens, next_tokens, n_accepted, q_second, generator):
    """Counts of (first, second) output token from one iteration of a rule; where the iteration
    emitted only one token, the second is drawn from q_second [V, V] as the next would."""
    vocab = q_second.size(0)
    first = torch.where(n_accepted > 0, path_tokens[:, 0], next_tokens)
    following = torch.multinomial(q_second[first], 1, generator=generator).squeeze(1)
    second = torch.where(n_accepted > 1, path_tokens[:, 1].clamp(min=0), next_tokens)
    second = torch.where(n_accepted > 0, second, following)
    return torch.bincount(first * vocab + second, minlength=vocab * vocab)


def hand_built_case(samples, seed):
    """A depth-2 tree drawn from hand-written p over 4 tokens, with hand-written q."""
    generator = torch.Generator().manual_seed(seed)
    p_root = torch.tensor([0.6, 0.2, 0.15, 0.05])
    p_child = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1],
                            [0.25, 0.25, 0.25, 0.25], [0.4, 0.4, 0.1, 0.1]])  # fmt: skip
    q_root = torch.tensor([0.1, 0.3, 0.4, 0.2])
    q_child = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.05, 0.05, 0.6, 0.3],
                            [0.3, 0.3, 0.2, 0.2], [0.1, 0.1, 0.1, 0.7]])  # fmt: skip

    def expand(tokens, _visible, depth, _leaf):
        if depth == 0:
            return p_root.log().expand(samples, 1, -1)
        return p_child[tokens].log()

    plan = DraftPlan(branching=(2, 2), sample=True)
    tree = grow_tree(plan, torch.zeros(samples, dtype=torch.long), expand, eos=99,
                     generator=generator)  # fmt: skip
    entry_tokens = torch.cat([torch.full((samples, 1), -1), tree.tokens], 1)
    q = torch.where(entry_tokens.eq(-1).unsqueeze(2), q_root, q_child[entry_tokens.clamp(min=0)])
    return tree, q, generator, q_root, q_child


def test_recursive_rejection_recovers_q_on_a_hand_built_tree():
    samples = 40000
    tree, q, generator, q_root, q_child = hand_built_case(samples, 0)
    path, n_accepted, next_tokens = rules.recursive_rejection(tree, q, eos=99, generator=generator)
    assert n_accepted.float().mean() > 0.5  # drafts do get accepted
    path_tokens = tree.tokens.gather(1, path.clamp(min=0))
    counts = joint_counts(path_tokens, next_tokens, n_accepted, q_child, generator)
    expected = (q_root.unsqueeze(1) * q_child).flatten()
    assert chi_square_pvalue(counts, expected) > 1e-3


def test_recursive_rejection_without_residuals_is_detected():
    """Control: the same test fails for a rule that forgets the residual after a rejection."""
    samples = 40000
    tree, q, generator, q_root, q_child = hand_built_case(samples, 1)
    # Try every sibling against the unchanged q (no residual after a rejection).
    original_residual = rules.residual
    try:
        rules.residual = lambda q_, p_: q_
        path, n_accepted, next_tokens = rules.recursive_rejection(tree, q, 99, generator)
    finally:
        rules.residual = original_residual
    path_tokens = tree.tokens.gather(1, path.clamp(min=0))
    counts = joint_counts(path_tokens, next_tokens, n_accepted, q_child, generator)
    expected = (q_root.unsqueeze(1) * q_child).flatten()
    assert chi_square_pvalue(counts, expected) < 1e-3


def test_greedy_tree_acceptance_follows_the_verifiers_picks():
    """beta 1, tau 0 down the hand-drawn tree (tokens: node i holds token 3 + i): at the root the
    verifier picks node 1's token, at node 1 node 4's, so the path is [1, 4]; node 4 is a leaf,
    so the verifier's pick there is the bonus token."""
    tree = trees.DraftTree(torch.tensor([[3, 4, 5, 6, 7, 0]]), PARENTS, DEPTHS,
                           torch.ones(1, 6, dtype=torch.bool))  # fmt: skip
    # entries: root, nodes 0..5; the best token at each entry
    scores = scores_with_best([4, 5, 7, 1, 1, 1, 1])
    path, n_accepted, next_tokens = rules.accept_top_beta_tree(tree, scores, 1, 0.0, EOS)
    assert path.tolist() == [[1, 4, -1]] and n_accepted.tolist() == [2]
    assert next_tokens.tolist() == [1]  # the verifier's pick after node 4 (entry 5)
    # the root's pick is in no child: nothing accepted, the pick follows (a correction)
    path, n_accepted, next_tokens = rules.accept_top_beta_tree(
        tree, scores_with_best([6, 5, 7, 1, 1, 1, 1]), 1, 0.0, EOS
    )
    assert n_accepted.tolist() == [0] and path.tolist() == [[-1, -1, -1]]
    assert next_tokens.tolist() == [6]
    # an empty slot is never accepted, even holding the verifier's pick
    empty = tree._replace(valid=torch.tensor([[True, False, True, True, True, True]]))
    _, n_accepted, next_tokens = rules.accept_top_beta_tree(empty, scores, 1, 0.0, EOS)
    assert n_accepted.tolist() == [0] and next_tokens.tolist() == [4]


def test_greedy_tree_acceptance_with_beta_takes_the_best_passing_child():
    """beta 2: both root children pass where both are among the verifier's 2 best and within
    tau; the verifier's better one is taken. With tau below the gap only the best passes."""
    tree = trees.DraftTree(torch.tensor([[3, 4, 5, 6, 7, 0]]), PARENTS, DEPTHS,
                           torch.ones(1, 6, dtype=torch.bool))  # fmt: skip
    # root: best 4 (node 1), runner-up 3 (node 0); node 0's entry: best 5 (node 2); node 1's
    # entry: best 1 (no child holds it), runner-up 7 (node 4); node 2's entry: best 0 (node 5)
    scores = scores_with_best([4, 5, 1, 0, 1, 1, 1], runner_up=[3, None, 7, None, None, None, None])
    path, n_accepted, next_tokens = rules.accept_top_beta_tree(tree, scores, 2, 1.0, EOS)
    assert path[0, :2].tolist() == [1, 4] and n_accepted.tolist() == [2]  # 4 beats 3 at the root
    assert next_tokens.tolist() == [1]
    _, n_accepted, next_tokens = rules.accept_top_beta_tree(tree, scores, 2, 0.25, EOS)
    assert n_accepted.tolist() == [1] and next_tokens.tolist() == [1]  # node 4 is 0.5 below
    # the root's best is no child's token: its runner-up child (node 0) passes with beta 2
    scores[0, 0, 4] = -10.0
    scores[0, 0, 6] = 0.0
    path, n_accepted, _ = rules.accept_top_beta_tree(tree, scores, 2, 1.0, EOS)
    assert path[0].tolist() == [0, 2, 5] and n_accepted.tolist() == [3]


def test_greedy_tree_acceptance_stops_after_an_accepted_eos():
    tree = trees.DraftTree(torch.tensor([[EOS, 4, 5, 6, 7, 0]]), PARENTS, DEPTHS,
                           torch.ones(1, 6, dtype=torch.bool))  # fmt: skip
    scores = scores_with_best([EOS, 5, 1, 1, 7, 1, 1])  # node 0's child 5 would pass too
    path, n_accepted, _ = rules.accept_top_beta_tree(tree, scores, 1, 0.0, EOS)
    assert path[0].tolist() == [0, -1, -1] and n_accepted.tolist() == [1]


def test_greedy_tree_acceptance_on_a_chain_equals_the_chain_rule():
    """A chain is a tree: both rules decide alike, for random drafts and scores."""
    torch.manual_seed(3)
    for beta, tau in ((1, 0.0), (3, 1.0)):
        scores = torch.randn(64, 5, 6)
        runner_up = (torch.rand(64, 4) < 0.3).long().unsqueeze(2)  # else the best token
        drafts = scores[:, :4].topk(2, dim=-1).indices.gather(2, runner_up).squeeze(2)
        n_chain, next_chain = rules.accept_top_beta(drafts, scores, beta, tau, EOS)
        path, n_tree, next_tree = rules.accept_top_beta_tree(trees.chain(drafts), scores, beta,
                                                             tau, EOS)  # fmt: skip
        assert torch.equal(n_tree, n_chain) and torch.equal(next_tree, next_chain)
        assert n_chain.min() == 0 and n_chain.max() >= 2  # both outcomes occur


def test_rules_without_drafts_give_the_verifiers_own_token():
    """A tree of no nodes (a drafter with nothing to draft yet): no path, the verifier's token."""
    empty = trees.chain(torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 1, 6))
    scores = torch.tensor([[[0.0, 3.0, 1.0, 0.0, 0.0, 0.0]], [[5.0, 0.0, 0.0, 0.0, 0.0, 0.0]]])
    path, n_accepted, next_tokens = rules.accept_top_beta_tree(empty, scores, 1, 0.0, EOS)
    assert path.shape == (2, 0) and n_accepted.tolist() == [0, 0]
    assert next_tokens.tolist() == [1, 0]
    one_hot = torch.nn.functional.one_hot(torch.tensor([[1], [0]]), 6).float()
    path, n_accepted, next_tokens = rules.recursive_rejection(empty, one_hot, EOS)
    assert path.shape == (2, 0) and next_tokens.tolist() == [1, 0]


def test_speculative_sampling_stays_exact_when_chains_stop_early():
    """--draft-stop: how long a chain is depends on the drafter's own draws (here a chain goes
    on only after the drafter's sure token 0); every position is still judged exactly, so the
    output stays distributed as the verifier's (q_root, then q_child). One sentence per draw:
    the stop is decided for the whole batch."""
    samples = 6000
    generator = torch.Generator().manual_seed(2)
    p_root = torch.tensor([0.7, 0.1, 0.1, 0.1])  # the drafter's
    p_child = torch.tensor([[0.6, 0.2, 0.1, 0.1], [0.1, 0.7, 0.1, 0.1],
                            [0.25, 0.25, 0.25, 0.25], [0.1, 0.1, 0.1, 0.7]])  # fmt: skip
    q_root = torch.tensor([0.3, 0.3, 0.2, 0.2])  # the verifier's
    q_child = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1],
                            [0.25, 0.25, 0.25, 0.25], [0.4, 0.4, 0.1, 0.1]])  # fmt: skip

    def expand(tokens, _visible, depth, _leaf):
        return (p_root.view(1, 1, -1) if depth == 0 else p_child[tokens]).log()

    plan = DraftPlan.chain(2, sample=True, stop_below=0.5)
    counts = torch.zeros(16, dtype=torch.long)
    lengths = set()
    for _ in range(samples):
        tree = grow_tree(plan, torch.zeros(1, dtype=torch.long), expand, 99, generator, False)
        lengths.add(tree.tokens.size(1))
        verifier = torch.cat([q_root.view(1, 1, -1), q_child[tree.tokens]], dim=1)
        k = tree.tokens.size(1)
        n_accepted, next_tokens = rules.speculative_sample(tree.tokens, tree.draft_probs[:, :k],
                                                           verifier, 99, generator)  # fmt: skip
        path_tokens = torch.cat([tree.tokens, torch.full((1, 2 - k), -1)], dim=1)
        counts += joint_counts(path_tokens, next_tokens, n_accepted, q_child, generator)
    assert lengths == {1, 2}
    expected = (q_root.unsqueeze(1) * q_child).flatten()
    assert chi_square_pvalue(counts, expected) > 1e-3


def test_every_rule_has_its_drafts_and_its_acceptance():
    """A rule is named in two tables, the drafts it judges (settings) and how (rules): a name in
    one only would be a --verify choice without acceptance, or an acceptance no flag reaches."""
    from spec_nmt.decoding.rules import RULES
    from spec_nmt.settings import VERIFY_RULES

    assert list(RULES) == list(VERIFY_RULES)
