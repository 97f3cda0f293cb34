"""A synthetic "German -> English" corpus that a tiny Transformer learns in a few hundred updates.

Source words s0..s39 map to fixed target words; every word with index divisible by 5 becomes two
target words, and adjacent pairs (s_i, s_j) with i < j swap order in the target. Sentences are
3-12 words.
"""

import random
from pathlib import Path

N_WORDS = 40


def _translate(words):
    out = []
    i = 0
    while i < len(words):
        # local reordering: a rising pair swaps
        if i + 1 < len(words) and words[i] < words[i + 1] and (words[i] + words[i + 1]) % 3 == 0:
            pair = [words[i + 1], words[i]]
            i += 2
        else:
            pair = [words[i]]
            i += 1
        for w in pair:
            out.append(f"t{w}")
            if w % 5 == 0:
                out.append(f"x{w}")
    return out


def make_pairs(n, seed):
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        words = [rng.randrange(N_WORDS) for _ in range(rng.randint(3, 12))]
        pairs.append((" ".join(f"s{w}" for w in words), " ".join(_translate(words))))
    return pairs


def write_corpus(directory, n_train=3000, n_valid=100, n_test=60, seed=1):
    """Writes {train,valid,test}.{de,en} and returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for split, n, split_seed in (
        ("train", n_train, seed),
        ("valid", n_valid, seed + 1),
        ("test", n_test, seed + 2),
    ):
        pairs = make_pairs(n, split_seed)
        (directory / f"{split}.de").write_text("".join(src + "\n" for src, _ in pairs))
        (directory / f"{split}.en").write_text("".join(tgt + "\n" for _, tgt in pairs))
    return directory
