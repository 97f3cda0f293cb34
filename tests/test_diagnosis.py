"""Acceptance by draft position, length and token kind, counted from hand-built iterations."""

import pytest

from spec_nmt.decoding.trace import IterationRecord
from tests.conftest import script_module

diagnosis = script_module("diagnosis", "benchmarks")
EOS = 2
PIECES = {2: "</s>", 10: "\u2581The", 11: "\u2581house", 12: ",", 13: "ing", 14: "\u2581Merkel",
          15: "\u25812014", 16: "\u2581is"}  # fmt: skip


def record(prefix, drafts, accepted, next_token, sentence=0):
    return IterationRecord(
        sentence=sentence, prefix=prefix, draft_tokens=drafts,
        draft_parents=list(range(-1, len(drafts) - 1)), candidates=[], candidate_logprobs=[],
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
                                      "kind end of sentence"]  # fmt: skip


def test_trees_are_refused():
    tree = record([], [10, 11], 1, 12)
    tree.draft_parents[1] = -1  # two children of the root
    with pytest.raises(ValueError, match="chains of drafts"):
        diagnosis.AcceptanceTable().add([tree], [5], PIECES.__getitem__, EOS)
