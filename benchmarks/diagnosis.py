"""Where draft chains break: acceptance by draft position, by sentence length, by the kind of
token the verifier wanted there and by how sure the verifier was of it, from the decoding loop's
iteration records.

Position i of an iteration is *judged* when every draft before it was accepted; it is accepted
when its draft is the verifier's token. P(i | i-1) is then accepted / judged at position i. The
token at a judged position is the verifier's: the accepted draft, or at the first rejection the
verifier's correction. A position after an accepted EOS is not judged.
"""

import math
import string
import unicodedata
from collections import defaultdict
from typing import Callable, Dict, Iterable, List, Sequence, Tuple

import spec_nmt.plugin  # noqa: F401  isort: skip  (first: fairseq quiet, the plugin registered)
import torch
from common import environment, greedy_alone, load_inputs, oracle, speculating, write_result

from spec_nmt.text import WORD_START

TOKEN_KINDS = ("punctuation", "subword continuation", "name or number", "other",
               "end of sentence")
# upper bounds of the source-length buckets, in pieces (EOS excluded); the last is open
LENGTH_BUCKETS = (10, 20, 40)
# upper bounds of the buckets of the verifier's largest probability at a judged position
CONFIDENCE_BUCKETS = (0.4, 0.6, 0.8, 0.95)


def token_kind(piece: str, starts_sentence: bool = False) -> str:
    """The kind of a target piece: punctuation, a subword continuation (no word-start mark), a
    name or number (digits, or a capitalised word that does not start the sentence: English
    capitalises little else), or other."""
    text = piece.lstrip(WORD_START)
    if text and all(ch in string.punctuation or unicodedata.category(ch).startswith("P")
                    for ch in text):  # fmt: skip
        return "punctuation"
    if not piece.startswith(WORD_START) and text:
        return "subword continuation"
    if any(ch.isdigit() for ch in text) or (text[:1].isupper() and not starts_sentence):
        return "name or number"
    return "other"


def length_bucket(source_length: int) -> str:
    low = 1
    for high in LENGTH_BUCKETS:
        if source_length <= high:
            return f"{low}-{high}"
        low = high + 1
    return f">{LENGTH_BUCKETS[-1]}"


def confidence_bucket(probability: float) -> str:
    """The bucket of a probability: "LOW-HIGH" for LOW <= p < HIGH, the last one ">=LOW" (the
    labels sort in the buckets' order)."""
    low = 0.0
    for high in CONFIDENCE_BUCKETS:
        if probability < high:
            return f"{low:g}-{high:g}"
        low = high
    return f">={CONFIDENCE_BUCKETS[-1]:g}"


def judged_positions(record, eos: int) -> Iterable[Tuple[int, int, bool]]:
    """(position from 1, the verifier's token there, accepted) for each judged position of a
    chain iteration's record (IterationRecord)."""
    drafts = record.draft_tokens
    accepted = len(record.accepted_path)
    for position in range(1, len(drafts) + 1):
        if position <= accepted:
            yield position, drafts[position - 1], True
            if drafts[position - 1] == eos:
                return
        else:
            yield position, record.next_token, False
            return


class AcceptanceTable:
    """Judged and accepted counts by position, overall and per group (a length bucket, a token
    kind, or a bucket of the verifier's largest probability there: the draft at position i is
    judged by the verifier's distribution at block entry i - 1)."""

    def __init__(self):
        self.judged: Dict[str, Dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.accepted: Dict[str, Dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.iterations = 0
        self.accepted_tokens = 0

    def add(self, records, source_lengths: Sequence[int], piece: Callable[[int], str],
            eos: int) -> None:  # fmt: skip
        """Count the iterations of one batch (``source_lengths``: each sentence's, by its row)."""
        for record in records:
            if any(parent != i - 1 for i, parent in enumerate(record.draft_parents)):
                raise ValueError("acceptance by position is measured on chains of drafts")
            self.iterations += 1
            self.accepted_tokens += len(record.accepted_path)
            bucket = "length " + length_bucket(source_lengths[record.sentence])
            for position, token, accepted in judged_positions(record, eos):
                starts_sentence = not record.prefix and position == 1
                kind = ("end of sentence" if token == eos
                        else token_kind(piece(token), starts_sentence))  # fmt: skip
                sure = math.exp(record.candidate_logprobs[position - 1][0])
                for group in ("all", bucket, "kind " + kind,
                              "verifier p " + confidence_bucket(sure)):  # fmt: skip
                    self.judged[group][position] += 1
                    self.accepted[group][position] += accepted

    def as_dict(self) -> Dict:
        """P(i | i-1) per group and position (None where nothing was judged), the judged counts,
        and accepted drafts per iteration."""
        groups = {}
        for group in sorted(self.judged, key=_group_order):
            judged, accepted = self.judged[group], self.accepted[group]
            positions = range(1, max(judged) + 1)
            groups[group] = {
                "acceptance_by_position": [
                    round(accepted[i] / judged[i], 4) if judged[i] else None for i in positions
                ],
                "judged": [judged[i] for i in positions],
            }
        return {
            "mean_accepted_per_iteration": round(self.accepted_tokens / max(self.iterations, 1), 4),
            "iterations": self.iterations,
            "groups": groups,
        }


def _group_order(group: str):
    kinds = {"all": 0, "length": 1, "kind": 2, "verifier": 3}
    prefix = group.split(" ", 1)[0]
    rest = group[len(prefix) + 1 :]
    if prefix == "length":
        bound = int(rest.lstrip(">").split("-")[0])
        return kinds[prefix], bound, rest
    if prefix == "kind":
        return kinds[prefix], TOKEN_KINDS.index(rest), rest
    return kinds[prefix], 0, rest


def markdown(tables: Dict[str, Dict], positions: int) -> List[str]:
    """One markdown table per measured system: P(i | i-1) for the first ``positions``
    positions, per group, with the judged count of position 1."""
    lines = []
    header = "| group | " + " | ".join(str(i) for i in range(1, positions + 1)) + " | judged at 1 |"
    for system, table in tables.items():
        lines += [f"{system}: {table['mean_accepted_per_iteration']} accepted drafts per "
                  f"iteration over {table['iterations']} iterations", "", header,
                  "|" + "---|" * (positions + 2)]  # fmt: skip
        for group, row in table["groups"].items():
            shares = row["acceptance_by_position"][:positions]
            cells = ["" if p is None else f"{p:.2f}" for p in shares]
            cells += [""] * (positions - len(cells))
            lines.append(f"| {group} | " + " | ".join(cells) + f" | {row['judged'][0]} |")
        lines.append("")
    return lines


def acceptance(args):
    """Where draft chains break: P(position i accepted | position i-1 accepted) for the drafter
    (lossless, and the reference top-beta/tau) and the oracle at k = --block, overall, by source
    length, by the kind of token the verifier wanted and by its largest probability there
    (diagnosis.py)."""
    pair, src, _, tokens = load_inputs(args)
    systems = {
        "drafter, lossless": speculating(pair, block_size=args.block),
        f"drafter, beta {args.beta} tau {args.tau:g}": speculating(
            pair, block_size=args.block, beta=args.beta, tau=args.tau),
        "oracle, lossless": oracle(pair, tokens, greedy_alone(pair, tokens), args.block),
    }  # fmt: skip
    source_lengths = [t.numel() - 1 for t in tokens]  # without EOS
    eos = pair.tgt_dict.eos()
    tables = {}
    for name, generator in systems.items():
        table = AcceptanceTable()
        with torch.inference_mode():
            for lines, sample in pair.batches(tokens, args.batch_size):
                trace = []
                generator.generate([pair.verifier], sample, trace=trace)
                table.add(trace, [source_lengths[line] for line in lines],
                          pair.tgt_dict.__getitem__, eos)  # fmt: skip
        tables[name] = table.as_dict()
    print("\n".join(markdown(tables, min(args.block, 10))))
    # a row per system, its overall P(i | i-1) first (what plot.py draws)
    rows = [dict(system=name, **table,
                 acceptance_by_position=table["groups"]["all"]["acceptance_by_position"])
            for name, table in tables.items()]  # fmt: skip
    write_result(args, {"mode": "acceptance", "lines": len(src), "block": args.block,
                        "environment": environment(args, pair), "rows": rows})  # fmt: skip
