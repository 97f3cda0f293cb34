"""Draft trees and the sampling rules on hand-built trees and distributions (no models)."""

import torch

from spec_nmt.decoding import rules
from spec_nmt.decoding import tree as trees
from spec_nmt.decoding.drafter import grow_tree, stopped_chain
from spec_nmt.settings import DraftPlan
from tests.stats import chi_square_pvalue

EOS = 2

#        root
#       /    \
#      0      1
#     / \     |
#    2   3    4
#    |
#    5
PARENTS = torch.tensor([[-1, -1, 0, 0, 1, 2]])
DEPTHS = torch.tensor([1, 1, 2, 2, 2, 3])


def test_block_visibility_of_a_hand_drawn_tree():
    visible = trees.block_visibility(PARENTS)[0].int().tolist()
    # entries: root, then node i at entry i+1; each row: itself and its ancestors
    assert visible == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ]


def test_a_chain_is_causal():
    chain = trees.chain(torch.tensor([[5, 6, 7]]))
    visible = trees.block_visibility(chain.parents)[0]
    assert torch.equal(visible, torch.ones(4, 4, dtype=torch.bool).tril())
    assert trees.block_depths(chain).tolist() == [0, 1, 2, 3]


def test_gumbel_top_k_draws_without_replacement_in_order():
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    tokens, drawn = trees.gumbel_top_k(p.log().expand(40000, 4), 2, generator)
    assert drawn.all() and tokens[:, 0].ne(tokens[:, 1]).all()
    # first draw ~ p; second draw given the first ~ p without it, renormalised
    first = torch.bincount(tokens[:, 0], minlength=4)
    assert chi_square_pvalue(first, p) > 1e-3
    after_zero = tokens[tokens[:, 0] == 0, 1]
    counts = torch.bincount(after_zero, minlength=4)[1:]
    assert chi_square_pvalue(counts, [0.6, 0.3, 0.1]) > 1e-3
    # fewer tokens with mass than asked: the rest is marked as not drawn
    _, drawn = trees.gumbel_top_k(torch.tensor([[0.0, float("-inf"), float("-inf")]]), 2, generator)
    assert drawn.tolist() == [[True, False]]


def test_stochastic_beam_search_draws_distinct_sequences():
    generator = torch.Generator().manual_seed(0)
    vocab, width = 5, 3
    logprobs = torch.randn(200, 1, vocab).log_softmax(-1)
    plan = DraftPlan(beam_width=width, beam_depth=3, sample=True)
    tree = grow_tree(plan, torch.zeros(200, dtype=torch.long),
                     lambda t, v, d, _: logprobs.expand(-1, t.size(1), -1), EOS,
                     generator)  # fmt: skip
    assert tree.tokens.shape == (200, width * 3) and tree.depths.tolist() == [1] * 3 + [2] * 3 + [3] * 3
    # the deepest level's beams are different sequences (root-to-leaf paths)
    for row in range(200):
        paths = set()
        for leaf in range(6, 9):
            node, path = leaf, []
            while node >= 0:
                path.append(int(tree.tokens[row, node]))
                node = int(tree.parents[row, node])
            paths.add(tuple(path))
        assert len(paths) == width


def test_the_root_always_has_children_even_though_bos_is_eos():
    """fairseq's BOS is the EOS symbol: the first iteration's root must still be extended."""
    logprobs = torch.randn(2, 1, 6).log_softmax(-1)
    tree = grow_tree(DraftPlan(branching=(2, 1), sample=True), torch.full((2,), EOS),
                     lambda t, v, d, _: logprobs.expand(-1, t.size(1), -1), EOS,
                     torch.Generator().manual_seed(0))  # fmt: skip
    assert tree.valid[:, :2].all()


def test_greedy_chain_equals_the_grown_greedy_chain():
    """The NAR drafters' shortcut for greedy chains gives the tree grow_tree would grow: each
    position's best token, empty slots after a drafted EOS."""
    torch.manual_seed(0)
    logprobs = torch.randn(6, 5, 9).log_softmax(-1)
    logprobs[0, 1, EOS] = 5.0  # row 0 drafts EOS at depth 2
    logprobs[1, 4, EOS] = 5.0  # row 1 at the last depth
    pending = torch.full((6,), 7)

    def expand(level_tokens, _visible, depth, _leaf):
        position = logprobs[:, min(depth, 4)]
        return position.unsqueeze(1).expand(-1, level_tokens.size(1), -1)

    grown = grow_tree(DraftPlan.chain(5, sample=False), pending, expand, EOS, None, False)
    shortcut = trees.greedy_chain(logprobs.argmax(-1), EOS)
    for field in ("tokens", "parents", "depths", "valid"):
        assert torch.equal(getattr(grown, field), getattr(shortcut, field)), field
    assert shortcut.valid[0].tolist() == [True, True, False, False, False]


def test_greedy_tree_equals_the_grown_greedy_tree():
    """The NAR drafters' shortcut for greedy trees gives the tree grow_tree would grow from the
    same per-position distributions: each node's children its depth's best tokens, empty slots
    below a drafted EOS; every row shares one shape, whose visibility is built once."""
    torch.manual_seed(1)
    logprobs = torch.randn(5, 3, 9).log_softmax(-1)
    logprobs[0, 0, EOS] = 5.0  # row 0: EOS is the best first token
    logprobs[1, 1, EOS] = 5.0  # row 1: the best second token
    branching = (3, 2, 1)

    def expand(level_tokens, _visible, depth, _leaf):
        position = logprobs[:, min(depth, 2)]
        return position.unsqueeze(1).expand(-1, level_tokens.size(1), -1)

    grown = grow_tree(DraftPlan(branching=branching), torch.full((5,), 7), expand, EOS, None,
                      False)  # fmt: skip
    shortcut = trees.greedy_tree(logprobs.topk(3, dim=-1).indices, branching, EOS)
    for field in ("tokens", "parents", "depths", "valid"):
        assert torch.equal(getattr(grown, field), getattr(shortcut, field)), field
    assert not shortcut.valid[0].all() and not shortcut.valid[1].all()
    shared = trees.block_visibility(shortcut.parents)
    assert shared.shape == (1, 16, 16)
    assert torch.equal(shared[0], trees.block_visibility(grown.parents)[3])
    assert trees.block_visibility(shortcut.parents) is shared


def beam_search(logprobs, depth, width):
    """Plain Python beam search over independent positions (logprobs [k, V]): the ``width``
    most probable extensions of the last level's sequences (none extends an EOS), best first."""
    beams = [((), 0.0)]
    for level in range(depth):
        extensions = [(sequence + (token,), score + float(logprobs[level, token]))
                      for sequence, score in beams if not sequence or sequence[-1] != EOS
                      for token in range(logprobs.size(1))]  # fmt: skip
        beams = sorted(extensions, key=lambda s: -s[1])[:width]
    return [sequence for sequence, _ in beams]


def test_beam_tree_holds_the_sequences_beam_search_keeps():
    """--tree-budget with top_beta: level d of the tree holds the ``width`` sequences of d
    tokens that beam search keeps (by plain Python here: the most probable extensions of the
    level above), a sequence that ends in EOS is not extended, and the NAR shortcut from each
    position's best tokens equals growing the beam over the whole vocabulary."""
    torch.manual_seed(2)
    width, depth = 3, 3
    logprobs = torch.randn(4, depth, 7).log_softmax(-1)
    logprobs[0, 0, EOS] = 2.0  # row 0: EOS is the best first token
    logprobs[1, 1, EOS] = 2.0  # row 1: the best second token
    best_logprobs, best = logprobs.topk(width, dim=-1)
    tree = trees.beam_tree(best_logprobs, best, width, EOS)
    assert tree.depths.tolist() == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    for row in range(4):
        for level in range(1, depth + 1):
            held = []
            for node in range((level - 1) * width, level * width):
                sequence = [int(tree.tokens[row, node])]
                parent = int(tree.parents[row, node])
                while parent >= 0:
                    sequence.insert(0, int(tree.tokens[row, parent]))
                    parent = int(tree.parents[row, parent])
                held.append(tuple(sequence))
            assert held == beam_search(logprobs[row], level, width), (row, level)
    # row 0's EOS node has no children: every deeper node descends from the other two
    eos_node = tree.tokens[0, :width].tolist().index(EOS)
    assert eos_node not in tree.parents[0, width:].tolist()
    assert tree.valid.all()

    def expand(level_tokens, _visible, level, _leaf):
        position = logprobs[:, min(level, depth - 1)]
        return position.unsqueeze(1).expand(-1, level_tokens.size(1), -1)

    plan = DraftPlan(beam_width=width, beam_depth=depth)
    grown = grow_tree(plan, torch.full((4,), 5), expand, EOS, None, False)
    for field in ("tokens", "parents", "depths", "valid"):
        assert torch.equal(getattr(grown, field), getattr(tree, field)), field


def test_beam_tree_acceptance_follows_parents_across_the_level():
    """A beam tree's nodes are ordered by probability, not by parent: node 2 (depth 2) hangs
    below node 1, node 3 below node 0. The rule follows the parents: root picks node 1's
    token, node 1's entry picks node 2's, so the path is [1, 2] and node 2's pick follows."""
    parents, depths = torch.tensor([[-1, -1, 1, 0]]), torch.tensor([1, 1, 2, 2])
    tree = trees.DraftTree(torch.tensor([[3, 4, 5, 6]]), parents, depths,
                           torch.ones(1, 4, dtype=torch.bool))  # fmt: skip
    # entries: root, nodes 0..3; node 0's entry would pick 6 (node 3), but node 0 is rejected
    scores = scores_with_best([4, 6, 5, 1, 1])
    for beta, tau in ((1, 0.0), (2, 1.0)):
        path, n_accepted, next_tokens = rules.accept_top_beta_tree(tree, scores, beta, tau, EOS)
        assert path.tolist() == [[1, 2]] and n_accepted.tolist() == [2]
        assert next_tokens.tolist() == [1]
    # node 1's entry picks 6, which hangs below node 0: node 1 is accepted, node 3 is not
    path, n_accepted, next_tokens = rules.accept_top_beta_tree(
        tree, scores_with_best([4, 6, 6, 1, 1]), 1, 0.0, EOS
    )
    assert path.tolist() == [[1, -1]] and n_accepted.tolist() == [1]
    assert next_tokens.tolist() == [6]


def test_beam_tree_leaves_empty_slots_below_a_drafted_eos_and_may_be_empty():
    """A beam of width 1 whose first draft is EOS cannot go on: every deeper node is an empty
    slot (never accepted). A plan of depth 0 (near the position limit) drafts nothing."""
    logprobs = torch.randn(2, 3, 7).log_softmax(-1)
    logprobs[0, 0, EOS] = 2.0  # row 0 drafts EOS first
    logprobs[1, :, EOS] = -50.0  # row 1 never does
    best_logprobs, best = logprobs.topk(1, dim=-1)
    tree = trees.beam_tree(best_logprobs, best, 1, EOS)
    assert tree.valid.tolist() == [[True, False, False], [True, True, True]]
    assert tree.parents.tolist() == [[-1, 0, 1], [-1, 0, 1]]
    scores = scores_with_best([EOS, 1, 1, 1])
    _, n_accepted, _ = rules.accept_top_beta_tree(tree._replace(tokens=tree.tokens[:1],
                                                                parents=tree.parents[:1],
                                                                valid=tree.valid[:1]),
                                                  scores, 1, 0.0, EOS)  # fmt: skip
    assert n_accepted.tolist() == [1]  # the EOS, nothing below it
    empty = trees.beam_tree(best_logprobs[:, :0], best[:, :0], 1, EOS)
    assert empty.tokens.shape == (2, 0) and empty.valid.shape == (2, 0)
    assert empty.depths.numel() == 0


def scores_with_best(best_per_entry, vocab=8, runner_up=None, gap=0.5):
    """Log-probs [1, E, vocab]: entry e's best token is best_per_entry[e] (log-prob 0 against
    -10 elsewhere); runner_up[e] (optional) sits ``gap`` below it."""
    scores = torch.full((1, len(best_per_entry), vocab), -10.0)
    for entry, token in enumerate(best_per_entry):
        scores[0, entry, token] = 0.0
        if runner_up and runner_up[entry] is not None:
            scores[0, entry, runner_up[entry]] = -gap
    return scores


def best_token_logprobs(best_probs, vocab=20):
    """Log-probs [B, 1, vocab] where row b's best token, 4, has probability best_probs[b] and
    the rest share what is left."""
    probs = torch.tensor(best_probs).unsqueeze(1)
    logprobs = ((1 - probs) / (vocab - 1)).log().expand(-1, vocab).clone()
    logprobs[:, 4] = probs.squeeze(1).log()
    return logprobs.unsqueeze(1)


def test_each_row_s_chain_stops_after_its_first_unsure_draft():
    """DraftPlan.stop_below (--draft-stop), row by row: a row's drafts after its first one
    below that probability under the drafter (or after its EOS) are empty slots, whatever the
    other rows draft, and the chain ends where no row goes on: that level's expand is told it
    holds the leaves, and nothing deeper is drafted. A finished row drafts nothing."""
    #                      level 1     level 2     level 3     level 4
    levels = [best_token_logprobs(p) for p in ([0.9, 0.2], [0.6, 0.9], [0.3, 0.9], [0.9, 0.9])]
    calls = []

    def expand(level_tokens, _visible, depth, leaf):
        calls.append((depth, leaf))
        return levels[depth] if depth < len(levels) else levels[-1]

    plan = DraftPlan.chain(6, sample=False, stop_below=0.5)
    pending = torch.full((2,), 7)
    tree = grow_tree(plan, pending, expand, EOS, None, False)
    assert tree.tokens.tolist() == [[4, 4, 4]] * 2
    assert tree.valid.tolist() == [[True, True, True], [True, False, False]]
    assert calls == [(0, False), (1, False), (2, False), (3, True)]
    assert grow_tree(DraftPlan.chain(6, sample=False), pending, expand, EOS, None,
                     False).tokens.size(1) == 6  # fmt: skip

    # a sure EOS ends its row's chain too
    levels[0][0, 0, EOS] = 10.0
    calls.clear()
    tree = grow_tree(plan, pending, expand, EOS, None, False)
    assert tree.tokens[:, 0].tolist() == [EOS, 4] and tree.valid.tolist() == [[True], [True]]
    assert calls == [(0, False), (1, True)]

    # the NAR drafters' shortcut over the same drafts ends the chains alike
    drafts = torch.tensor([[EOS, 4, 4], [4, 4, 4]])
    probs = torch.tensor([[0.99, 0.9, 0.3], [0.2, 0.9, 0.9]])
    stopped = stopped_chain(drafts, probs, trees.before_any_eos(drafts, EOS), 0.5, EOS)
    assert stopped.tokens.tolist() == [[EOS], [4]] and stopped.valid.all()
    drafts[0, 0] = 4
    stopped = stopped_chain(drafts, probs, torch.tensor([[True] * 3, [False] * 3]), 0.5, EOS)
    assert stopped.valid.tolist() == [[True, True, True], [False, False, False]]

    finished = torch.tensor([False, True])
    tree = grow_tree(plan, pending, expand, EOS, None, False, finished=finished)
    assert not tree.valid[1].any()
