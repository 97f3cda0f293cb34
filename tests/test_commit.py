"""Rows.commit, the one commit of both loops (decoding/batch_rows.py), on hand-built blocks: what
each row appends, with which scores, and what a finished row leaves as it was."""

import torch

from spec_nmt.decoding.batch_rows import BatchRows

EOS, PAD = 2, 1
VOCABULARY = 8


def started_rows(lengths, live):
    """Two rows with BOS and ``lengths`` verified tokens (7s) and room for a block of three."""
    tokens = torch.full((2, 10), PAD)
    tokens[:, 0] = EOS
    for row, length in enumerate(lengths):
        tokens[row, 1 : length + 1] = 7
    rows = BatchRows.start(tokens, torch.zeros(2, 9), torch.tensor([8, 8]))
    rows.lengths.copy_(torch.tensor(lengths))
    rows.live.copy_(torch.tensor(live))
    return rows


def block_logits():
    """[2, 3, V] logits whose entry (row, i) puts 10 * row + i on token i + 3, and a normaliser."""
    logits = torch.zeros(2, 3, VOCABULARY)
    for row in range(2):
        for entry in range(3):
            logits[row, entry, entry + 3] = 10 * row + entry
    return logits, torch.full((2, 3), 0.5)


def test_a_chain_appends_the_accepted_drafts_and_the_next_token_with_their_scores():
    rows = started_rows([1, 2], [True, True])
    logits, normalizer = block_logits()
    drafts = torch.tensor([[3, 4], [3, 9]])  # row 0 accepts both, row 1 the first
    emitted, counts, ended = rows.commit(drafts, torch.tensor([2, 1]), torch.tensor([5, 4]),
                                         logits, normalizer, torch.tensor([2, 2]), EOS)  # fmt: skip
    assert counts.tolist() == [3, 2] and not ended.any()
    assert rows.tokens[0, 1:5].tolist() == [7, 3, 4, 5]
    assert rows.tokens[1, 1:5].tolist() == [7, 7, 3, 4]
    assert rows.lengths.tolist() == [4, 4]
    # the score of the token an entry chose: its logit there less the entry's normaliser
    assert rows.scores[0, 1:4].tolist() == [-0.5, 0.5, 1.5]
    assert rows.scores[1, 2:4].tolist() == [9.5, 10.5]
    assert rows.iterations.tolist() == [1, 1] and rows.accepted.tolist() == [2, 1]
    assert rows.drafted.tolist() == [2, 2]
    assert emitted[0].tolist() == [3, 4, 5]


def test_an_accepted_eos_ends_the_row_and_a_finished_row_stays_as_it_was():
    rows = started_rows([1, 2], [True, False])
    before = rows.tokens[1].clone(), rows.scores[1].clone()
    logits, normalizer = block_logits()
    drafts = torch.tensor([[EOS, 4], [3, 4]])
    _, counts, ended = rows.commit(drafts, torch.tensor([1, 2]), torch.tensor([6, 6]), logits,
                                   normalizer, torch.tensor([1, 2]), EOS)  # fmt: skip
    assert counts.tolist() == [1, 0]  # the EOS, no token after it; nothing for the finished row
    assert ended.tolist() == [True, False] and rows.live.tolist() == [False, False]
    assert rows.tokens[0, 2].item() == EOS and rows.lengths.tolist() == [2, 2]
    # (the finished row writes past its end only)
    assert torch.equal(rows.tokens[1, :3], before[0][:3])
    assert torch.equal(rows.scores[1, :2], before[1][:2])
    assert rows.iterations.tolist() == [1, 0] and rows.accepted.tolist() == [1, 0]


def test_a_tree_scores_each_token_at_the_entry_that_chose_it():
    rows = started_rows([1, 1], [True, True])
    logits, normalizer = block_logits()
    normalizer[:, 2] = 2.0
    # row 0 accepted the tree's node 1 (block entry 2) alone: its token, then the next token
    # chosen at that entry; row 1 accepted nothing
    kept = torch.tensor([[0, 2, 0], [0, 1, 1]])
    drafts = torch.tensor([[4, 0], [3, 0]])  # along the path (past n_accepted: anything)
    _, counts, _ = rows.commit(drafts, torch.tensor([1, 0]), torch.tensor([5, 3]), logits,
                               normalizer, torch.tensor([2, 2]), EOS, kept)  # fmt: skip
    assert counts.tolist() == [2, 1]
    assert rows.tokens[0, 2:4].tolist() == [4, 5] and rows.tokens[1, 2].item() == 3
    # row 0: token 4 chosen at entry 0 (logit 0 there: -0.5); token 5 at entry 2 (2 - 2.0)
    assert rows.scores[0, 1:3].tolist() == [-0.5, 0.0]
    assert rows.scores[1, 1].item() == 10 - 0.5  # token 3 at entry 0 of row 1
