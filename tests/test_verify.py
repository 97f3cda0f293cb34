"""The top-beta/tau rule on hand-built verifier distributions, with literal expectations."""

import math

import pytest
import torch

from spec_nmt.decoding.rules import accept_top_beta, check_top_beta_params
from spec_nmt.errors import SpecNmtError

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
        check_top_beta_params(beta, tau)
