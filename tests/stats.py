"""Chi-square goodness of fit for sampled counts against exact probabilities."""

import numpy as np
from scipy.stats import chisquare


def chi_square_pvalue(counts, probs, min_expected=5.0) -> float:
    """p-value of counts [cells] under probs [cells]; cells expected below ``min_expected`` are
    pooled into one, as the test's approximation needs."""
    counts = np.asarray(counts, dtype=np.float64)
    expected = np.asarray(probs, dtype=np.float64)
    expected = expected / expected.sum() * counts.sum()
    if counts[expected == 0].sum() > 0:
        return 0.0  # an impossible outcome was drawn
    small = expected < min_expected
    if small.any():
        pooled_counts, pooled_expected = counts[small].sum(), expected[small].sum()
        counts, expected = counts[~small], expected[~small]
        if pooled_expected > 0:
            counts = np.append(counts, pooled_counts)
            expected = np.append(expected, pooled_expected)
    return float(chisquare(counts, expected).pvalue)
