#!/usr/bin/env python3
"""Draw speculative decoding, iteration by iteration, for a few real sentences: a self-contained
HTML page (no scripts, no external files).

    python scripts/trace.py data/models/bench-de-en "Das Haus ist groß." "Guten Morgen." \\
        --block-size 6 --beta 3 --tau 1.0 --output trace.html

For every iteration it shows the input (verified prefix, the pending token marked, then the
[MASK]s), the draft (accepted, rejected, never examined), the verifier's best candidates with
log-probs at every judged position, what was emitted (accepted drafts, then the correction or
bonus token) and the next input. --verify sampling / rsd work too (rsd shows the tree by depth).
"""

import argparse
import html
from pathlib import Path

import torch

from spec_nmt.options import (
    DEFAULT_DRAFTER_PRECISION,
    DRAFTER_PRECISION_HELP,
    DRAFTER_PRECISION_NAMES,
)
from spec_nmt.settings import DEFAULTS, VERIFY_RULES, flag_help, samples
from spec_nmt.symbols import ForeignCharacters
from spec_nmt.translator import SpecTranslator

STYLE = """
body { font-family: sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; }
.tok { display: inline-block; padding: 2px 6px; margin: 2px; border-radius: 4px;
  border: 1px solid #bbb; font-family: monospace; font-size: 13px; background: #fff; }
.iteration { border: 1px solid #ddd; border-radius: 6px; padding: 6px 10px; margin: 8px 0; }
.row { display: flex; align-items: flex-start; flex-wrap: wrap; margin: 3px 0; }
.label { width: 130px; flex: none; font-size: 12px; color: #666; padding-top: 5px; }
.column { display: inline-flex; flex-direction: column; margin-right: 6px; }
.prefix { background: #eef; } .pending { background: #ccf; font-weight: bold; }
.mask { background: #eee; color: #888; } .accepted { background: #b6e3b6; }
.rejected { background: #f4b6b6; text-decoration: line-through; } .unreached { color: #aaa; }
.correction { background: #ffd27f; } .bonus { background: #9fd3ff; }
.candidate { font-size: 12px; font-family: monospace; color: #444; }
.candidate.best { font-weight: bold; }
.source { color: #555; } .translation { font-weight: bold; }
"""


def token_box(text, css):
    return f'<span class="tok {css}">{html.escape(text)}</span>'


def iteration_html(number, record, symbol, block_depth, eos):
    prefix = [symbol(t) for t in record.prefix]
    input_boxes = [token_box(p, "prefix") for p in prefix[:-1]]
    input_boxes.append(token_box(prefix[-1] if prefix else "<s>", "pending"))
    input_boxes += [token_box("[MASK]", "mask")] * block_depth

    tokens, parents = record.draft_tokens, record.draft_parents
    accepted = record.accepted_path
    on_path = set(accepted)
    # the entry whose children were tried last: the root, or the last accepted node
    tried_parent = accepted[-1] if accepted else -1
    depth_of = []
    for parent in parents:
        depth_of.append(1 if parent < 0 else depth_of[parent] + 1)
    columns = []
    for depth in range(1, max(depth_of, default=0) + 1):
        boxes = []
        for node, token in enumerate(tokens):
            if depth_of[node] != depth:
                continue
            if node in on_path:
                css = "accepted"
            elif parents[node] == tried_parent:
                css = "rejected"
            else:
                css = "unreached"
            boxes.append(token_box(symbol(token), css))
        columns.append(f'<span class="column">{"".join(boxes)}</span>')

    judged = [0] + [node + 1 for node in accepted]
    if all(p == i - 1 for i, p in enumerate(parents)):  # a chain: every entry was scored
        judged = list(range(len(tokens) + 1))
    candidate_columns = []
    for entry in judged:
        lines = [
            f'<span class="candidate{" best" if rank == 0 else ""}">'
            f"{html.escape(symbol(token))} {logprob:.2f}</span>"
            for rank, (token, logprob) in enumerate(
                zip(record.candidates[entry], record.candidate_logprobs[entry])
            )
        ]
        candidate_columns.append(f'<span class="column">{"".join(lines)}</span>')

    emitted = [token_box(symbol(tokens[node]), "accepted") for node in accepted]
    if not record.ended_by_accepted_eos:
        emitted.append(token_box(symbol(record.next_token), record.next_kind))
    new_prefix = prefix + [symbol(tokens[node]) for node in accepted]
    next_boxes = [token_box(p, "prefix") for p in new_prefix]
    if not record.ended_by_accepted_eos and record.next_token != eos:
        next_boxes.append(token_box(symbol(record.next_token), "pending"))
        next_boxes += [token_box("[MASK]", "mask")] * block_depth
    rows = [
        ("input", "".join(input_boxes)),
        ("draft", "".join(columns) or "(no drafts)"),
        ("verifier's best", "".join(candidate_columns)),
        ("emitted", "".join(emitted)),
        ("next input", "".join(next_boxes)),
    ]
    body = "".join(
        f'<div class="row"><span class="label">{label}</span><span>{content}</span></div>'
        for label, content in rows
    )
    return f'<div class="iteration"><b>iteration {number}</b>{body}</div>'


def render(translator, sentences, settings) -> str:
    generator = translator.generator(**settings)
    symbol = translator.tgt_dict.__getitem__
    # what the model reads: the sentence without the characters it cannot (spec_nmt/symbols.py)
    readable, runs = zip(*map(translator.foreign.split, sentences))
    tokens = translator.encode(readable)
    sections = []
    for index, sentence in enumerate(sentences):
        _, sample = next(translator.batches([tokens[index]], 1))
        trace = []
        with torch.inference_mode():
            hypothesis = generator.generate([translator.verifier], sample, trace=trace)[0][0]
        iterations = "".join(
            iteration_html(n + 1, record, symbol, generator.plan.depth, translator.tgt_dict.eos())
            for n, record in enumerate(trace)
        )
        translation = ForeignCharacters.restore(translator.decode(hypothesis["tokens"]),
                                                runs[index])  # fmt: skip
        sections.append(
            f"<h2>Sentence {index + 1}</h2>"
            f'<p class="source">{html.escape(sentence)}</p>'
            f'<p class="translation">{html.escape(translation)}</p>'
            f"<p>{len(trace)} iterations (verifier calls), "
            f"{hypothesis.get('spec_accepted_tokens', 0)} accepted drafts, "
            f"{hypothesis['tokens'].numel()} output tokens</p>{iterations}"
        )
    legend = "".join(
        token_box(text, css) for text, css in [
            ("verified", "prefix"), ("pending", "pending"), ("[MASK]", "mask"),
            ("accepted", "accepted"), ("rejected", "rejected"), ("not examined", "unreached"),
            ("correction", "correction"), ("bonus", "bonus"),
        ]
    )  # fmt: skip
    title = f"spec-nmt trace: {html.escape(', '.join(f'{k}={v}' for k, v in settings.items()))}"
    return (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{title}</title>'
        f"<style>{STYLE}</style></head><body><h1>{title}</h1>"
        f'<p class="legend">{legend}</p>{"".join(sections)}</body></html>\n'
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path,
                        help="verifier.pt, drafter.pt, dict.*.txt, spm.model, as for "
                        "spec-nmt-translate")
    parser.add_argument("sentences", nargs="+", help="source sentences (raw text)")
    parser.add_argument("--output", "-o", type=Path, default=Path("trace.html"),
                        help="the HTML page to write (default: %(default)s)")
    parser.add_argument("--drafter-path", default=None,
                        help="drafter checkpoint instead of MODEL_DIR/drafter.pt")
    parser.add_argument("--drafter-precision", choices=DRAFTER_PRECISION_NAMES,
                        default=DEFAULT_DRAFTER_PRECISION,
                        help=DRAFTER_PRECISION_HELP + " (default: %(default)s)")
    for name in ("block_size", "beta", "tau", "verify", "tree_branching", "tree_budget",
                 "temperature", "seed"):  # fmt: skip
        default = getattr(DEFAULTS, name)
        parser.add_argument(f"--{name.replace('_', '-')}",
                            type=str if default is None else type(default), default=default,
                            choices=list(VERIFY_RULES) if name == "verify" else None,
                            help=flag_help(name))  # fmt: skip
    args = parser.parse_args()
    settings = {"block_size": args.block_size, "beta": args.beta, "tau": args.tau,
                "verify": args.verify}  # fmt: skip
    if samples(args.verify):
        settings.update(temperature=args.temperature, seed=args.seed)
    if args.tree_branching:
        settings["tree_branching"] = args.tree_branching
    if args.tree_budget:
        settings["tree_budget"] = args.tree_budget
    # a SpecNmtError becomes one line on stderr (spec_nmt's error hook)
    translator = SpecTranslator.from_pretrained(args.model_dir, args.drafter_path, device="cpu",
                                                drafter_precision=args.drafter_precision)
    page = render(translator, args.sentences, settings)
    args.output.write_text(page, encoding="utf-8")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
