"""Numbers in a translation: which of the source's numbers the output kept.

A number is a run of digits with single ``.`` or ``,`` between digit groups ("50", "4,20",
"1.234.567", "6.6.2013"), or groups of three digits after a space ("200 000", as German
also writes thousands). Two numbers are the same when their digits are, separators removed:
German "4,20" is English "4.20", German "1.234.567" is "1,234,567" or "1234567". A source's
numbers are kept when every one of them, counted as often as it occurs, is among the output's.
"""

import re
from collections import Counter
from typing import List

# thousands grouped by spaces first (a plain, no-break or narrow no-break space), else digit
# groups joined by single points or commas
NUMBER = re.compile(r"(?<![\d.,])\d{1,3}(?:[ \u00a0\u202f]\d{3})+(?![\d]|[.,]\d)|\d+(?:[.,]\d+)*")


def digits(number: str) -> str:
    """A number's digits, its separators removed: what two numbers are compared by."""
    return re.sub(r"\D", "", number)


def numbers_in(text: str) -> List[str]:
    return NUMBER.findall(text)


def missing_numbers(source: str, output: str) -> List[str]:
    """The source's numbers that the output lacks, in source order (none: every one is kept)."""
    available = Counter(digits(number) for number in numbers_in(output))
    missing = []
    for number in numbers_in(source):
        if available[digits(number)]:
            available[digits(number)] -= 1
        else:
            missing.append(number)
    return missing
