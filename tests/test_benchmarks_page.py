"""BENCHMARKS.md stays a page a newcomer can decide from: at most 400 lines, a summary first, every
relative link in it reaching a file (and a heading, for a Markdown #anchor), and the README's,
the model card's and the lab notes' links into it reaching a heading there; and the model card
pointing to no directory that a clone lacks."""

import re

import pytest

from tests.conftest import BUNDLED_MODEL_DIR, REPO

PAGE = REPO / "BENCHMARKS.md"
MAX_LINES = 400
LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
HEADING = re.compile(r"(#{1,6}) +(.+?) *#*$")


def outside_code(text):
    """The lines outside fenced code blocks, with inline code removed."""
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield re.sub(r"`[^`]*`", "", line)


def anchor(heading):
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path):
    """Every heading id of a Markdown file, a repeated heading's as -1, -2, ... as GitHub does."""
    seen, ids = {}, set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        match = None if fenced else HEADING.match(line)
        if match:
            base = anchor(match.group(2))
            ids.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return ids


def broken_links(source):
    """The relative links of `source` whose file, or heading in a Markdown file, is missing."""
    broken = []
    for line in outside_code(source.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            path, _, fragment = target.partition("#")
            file = (source.parent / path).resolve() if path else source
            if not file.is_file():
                broken.append(target)
            elif fragment and file.suffix == ".md" and fragment not in anchors(file):
                broken.append(target)
    return broken


def test_at_most_400_lines_opening_with_a_summary():
    lines = PAGE.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_LINES, f"{len(lines)} lines: move the history to docs/lab-notes.md"
    text = PAGE.read_text(encoding="utf-8")
    headings = [line for line in outside_code(text) if HEADING.match(line)]
    assert headings[0].startswith("# ") and headings[1] == "## Summary", headings[:2]
    # the summary gives the speed-up in ms per token and as a ratio, and the quality
    summary = "\n".join(lines[lines.index("## Summary"):lines.index(headings[2])])
    assert "ms per output token" in summary and "×" in summary and "BLEU" in summary


def test_every_relative_link_of_the_page_resolves():
    assert broken_links(PAGE) == []


@pytest.mark.parametrize("source", [
    REPO / "README.md", BUNDLED_MODEL_DIR / "MODEL_CARD.md", *sorted((REPO / "docs").glob("*.md")),
], ids=lambda path: path.name)  # fmt: skip
def test_links_into_the_page_reach_its_headings(source):
    broken = broken_links(source)
    assert [target for target in broken if target.partition("#")[0].endswith("BENCHMARKS.md")] == []


def test_the_anchor_rule_matches_the_pages_own_links():
    """The pages link headings with punctuation and formatting; the rule gives their GitHub ids."""
    assert anchor("Quality (BLEU)") == "quality-bleu"
    assert anchor("The loop's ceiling and the cost of an iteration") == (
        "the-loops-ceiling-and-the-cost-of-an-iteration"
    )
    assert anchor("The feature drafter (EAGLE, opt-in)") == "the-feature-drafter-eagle-opt-in"
    assert anchor("How the page's tables were read (its opening, as of `0b91ca4`)") == (
        "how-the-pages-tables-were-read-its-opening-as-of-0b91ca4"
    )


def test_the_model_card_names_no_directory_that_a_clone_lacks():
    """The training machine's own directories (its shared data, its runs) are named by
    variables that the card explains (issue 67)."""
    card = (BUNDLED_MODEL_DIR / "MODEL_CARD.md").read_text()
    assert re.findall(r"\.\./(?:shared|runs)\b\S*", card) == []
    assert "`RUNS` the scratch directory" in " ".join(card.split())


def test_the_readme_gives_the_relaxed_rules_figures_as_the_page_has_them():
    """The README offered the relaxed rule as faster than lossless, which the page's figures
    for the bundled pair deny: its "Which mode" row gives them (issue 67)."""
    page = PAGE.read_text()
    relaxed = re.search(r"^\| top-β/τ, k = 5, β = 3, τ = 1 \| ([0-9.]+) \| ([0-9.]+) \| "
                        r"([0-9.]+) \|", page, re.M).groups()  # fmt: skip
    defaults = re.search(r"^\| \*\*defaults\*\* .*?\| \*\*([0-9.]+)\*\* \| \*\*([0-9.]+)\*\* "
                         r"\(.*?\| \*\*([0-9.]+)\*\* \(", page, re.M).groups()  # fmt: skip
    readme = (REPO / "README.md").read_text()
    row = next(line for line in readme.splitlines() if "`--block-size 5 --beta 3 --tau 1.0`" in line
               and line.startswith("|"))  # fmt: skip
    assert "**not faster**" in row and "faster than lossless" not in readme
    assert f"{relaxed[1]}× fairseq greedy against {defaults[1]}× at batch 1" in row
    assert f"{relaxed[2]}× against {defaults[2]}× in batches of 64" in row
    lost = float(defaults[0]) - float(relaxed[0])
    assert f"{lost:.2f} BLEU lower" in row
