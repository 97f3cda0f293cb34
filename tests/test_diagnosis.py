"""Acceptance by draft position, length, token kind and the verifier's confidence, counted from
hand-built iterations."""

import math

import pytest

from spec_nmt.decoding.trace import IterationRecord
from tests.conftest import script_module

diagnosis = script_module("diagnosis", "benchmarks")
EOS = 2
PIECES = {2: "</s>", 10: "\u2581The", 11: "\u2581house", 12: ",", 13: "ing", 14: "\u2581Merkel",
          15: "\u25812014", 16: "\u2581is"}  # fmt: skip


def record(prefix, drafts, accepted, next_token, sentence=0, sure=None):
    """An iteration's record; ``sure``: the verifier's largest probability at each block entry
    (0.99 at every one by default)."""
    sure = sure or [0.99] * (len(drafts) + 1)
    return IterationRecord(
        sentence=sentence, prefix=prefix, draft_tokens=drafts,
        draft_parents=list(range(-1, len(drafts) - 1)), candidates=[],
        candidate_logprobs=[[math.log(p), math.log((1 - p) / 2)] for p in sure],
        accepted_path=list(range(accepted)), next_token=next_token, next_kind="correction",
        ended_by_accepted_eos=False,
    )  # fmt: skip


@pytest.mark.parametrize("piece, starts_sentence, kind", [
    (",", False, "punctuation"), ("\u2581.", False, "punctuation"),
    ("\u2581\u201e", False, "punctuation"),
    ("ing", False, "subword continuation"), ("\u2581Merkel", False, "name or number"),
    ("\u2581The", True, "other"), ("\u2581The", False, "name or number"),
    ("\u25812014", True, "name or number"), ("\u2581house", False, "other"),
])  # fmt: skip
def test_token_kinds(piece, starts_sentence, kind):
    assert diagnosis.token_kind(piece, starts_sentence) == kind


def test_acceptance_by_position_counts_only_judged_positions():
    table = diagnosis.AcceptanceTable()
    records = [
        record([], [10, 11, 12], 3, 16),  # all accepted: positions 1-3 judged and accepted
        record([10], [11, 13, 12], 1, 12, sentence=1),  # 1 accepted, 2 rejected, 3 not judged
        record([10, 11], [EOS, 11, 12], 1, 16, sentence=1),  # accepted EOS: nothing after it
        record([10, 11, 14], [15, 16, 12], 0, 14),  # rejected at 1; the verifier wanted a name
    ]
    table.add(records, source_lengths=[5, 25], piece=PIECES.__getitem__, eos=EOS)
    result = table.as_dict()
    assert result["iterations"] == 4
    assert result["mean_accepted_per_iteration"] == 5 / 4
    overall = result["groups"]["all"]
    assert overall["judged"] == [4, 2, 1]
    assert overall["acceptance_by_position"] == [0.75, 0.5, 1.0]
    assert result["groups"]["length 1-10"]["judged"] == [2, 1, 1]
    assert result["groups"]["length 21-40"]["acceptance_by_position"] == [1.0, 0.0]
    # position 1 of the first iteration starts the sentence: "The" is no name there
    assert result["groups"]["kind other"]["judged"] == [2, 1]  # "The", "house"; "house"
    # "," rejected at position 2 (the verifier's correction), accepted at 3; none judged at 1
    assert result["groups"]["kind punctuation"] == {"acceptance_by_position": [None, 0.0, 1.0],
                                                    "judged": [0, 1, 1]}
    assert result["groups"]["kind name or number"]["acceptance_by_position"] == [0.0]
    assert result["groups"]["kind end of sentence"]["acceptance_by_position"] == [1.0]
    assert "kind subword continuation" not in result["groups"]  # "ing" was never judged
    assert list(result["groups"]) == ["all", "length 1-10", "length 21-40", "kind punctuation",
                                      "kind name or number", "kind other",
                                      "kind end of sentence", "verifier p >=0.95"]  # fmt: skip


def test_acceptance_by_the_verifiers_confidence_reads_the_entry_before_each_position():
    table = diagnosis.AcceptanceTable()
    records = [
        # entry 0 judges position 1 (p 0.3), entry 1 position 2 (p 0.7); position 3 not judged
        record([], [10, 11, 12], 1, 13, sure=[0.3, 0.7, 0.99, 0.5]),
        record([10], [11, 12, 13], 0, 16, sure=[0.96, 0.1, 0.1, 0.1]),  # rejected where sure
        record([10], [11, 12, 13], 2, 16, sure=[0.41, 0.61, 0.81, 0.1]),
    ]
    table.add(records, source_lengths=[5], piece=PIECES.__getitem__, eos=EOS)
    groups = table.as_dict()["groups"]
    verifier = {group[len("verifier p "):]: row for group, row in groups.items()
                if group.startswith("verifier p ")}  # fmt: skip
    assert verifier == {
        "0-0.4": {"acceptance_by_position": [1.0], "judged": [1]},
        "0.4-0.6": {"acceptance_by_position": [1.0], "judged": [1]},
        "0.6-0.8": {"acceptance_by_position": [None, 0.5], "judged": [0, 2]},
        "0.8-0.95": {"acceptance_by_position": [None, None, 0.0], "judged": [0, 0, 1]},
        ">=0.95": {"acceptance_by_position": [0.0], "judged": [1]},
    }
    assert list(verifier) == ["0-0.4", "0.4-0.6", "0.6-0.8", "0.8-0.95", ">=0.95"]  # in order


@pytest.mark.parametrize("probability, bucket", [
    (0.0, "0-0.4"), (0.39, "0-0.4"), (0.4, "0.4-0.6"), (0.6, "0.6-0.8"), (0.8, "0.8-0.95"),
    (0.949, "0.8-0.95"), (0.95, ">=0.95"), (1.0, ">=0.95"),
])  # fmt: skip
def test_a_bucket_holds_its_lower_bound(probability, bucket):
    assert diagnosis.confidence_bucket(probability) == bucket


def test_trees_are_refused():
    tree = record([], [10, 11], 1, 12)
    tree.draft_parents[1] = -1  # two children of the root
    with pytest.raises(ValueError, match="chains of drafts"):
        diagnosis.AcceptanceTable().add([tree], [5], PIECES.__getitem__, EOS)
