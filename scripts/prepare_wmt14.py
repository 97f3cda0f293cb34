#!/usr/bin/env python3
"""Download full WMT14 German-English from statmt.org and prepare it like bench-de-en.

    python scripts/prepare_wmt14.py WORK_DIR [--vocab-size 32000]

Needs internet (about 1.5 GB of archives). Downloads into WORK_DIR/orig (kept, so a rerun skips
finished downloads), writes WORK_DIR/raw/{train,valid,test}.{de,en} (train = Europarl v7 +
Common Crawl + News Commentary v9, valid = newstest2013, test = newstest2014 full, 3003 lines),
then runs the same preparation as scripts/prepare_data.py into WORK_DIR (spm.model, spm/, bin/).
"""

import argparse
import logging
import re
import tarfile
import urllib.request
from html import unescape
from pathlib import Path

from spec_nmt.data_prep import prepare

logger = logging.getLogger("prepare_wmt14")

ARCHIVES = {
    "training-parallel-europarl-v7.tgz": "http://statmt.org/wmt13/training-parallel-europarl-v7.tgz",
    "training-parallel-commoncrawl.tgz": "http://statmt.org/wmt13/training-parallel-commoncrawl.tgz",
    "training-parallel-nc-v9.tgz": "http://statmt.org/wmt14/training-parallel-nc-v9.tgz",
    "dev.tgz": "http://statmt.org/wmt14/dev.tgz",
    "test-full.tgz": "http://statmt.org/wmt14/test-full.tgz",
}
# (archive member suffix of the German side, the English side is the same with .en)
TRAIN_CORPORA = ("europarl-v7.de-en.de", "commoncrawl.de-en.de", "news-commentary-v9.de-en.de")
VALID = ("newstest2013.de", "newstest2013.en")
TEST_SGM = ("newstest2014-deen-src.de.sgm", "newstest2014-deen-ref.en.sgm")

_SEGMENT = re.compile(r"<seg[^>]*>(.*)</seg>", re.IGNORECASE)


def download(orig: Path):
    orig.mkdir(parents=True, exist_ok=True)
    for name, url in ARCHIVES.items():
        target = orig / name
        if target.is_file():
            continue
        logger.info("downloading %s", url)
        partial = target.with_suffix(".part")
        urllib.request.urlretrieve(url, partial)
        partial.rename(target)


def read_members(archives, suffixes):
    """{suffix: lines} of the first member ending in each suffix, reading every archive once
    (they are large and gzipped: no second pass)."""
    found = {}
    for archive in archives:
        with tarfile.open(archive) as tar:
            for member in tar:
                suffix = next((x for x in suffixes if member.name.endswith(x)), None)
                if member.isfile() and suffix is not None and suffix not in found:
                    found[suffix] = tar.extractfile(member).read().decode("utf-8").splitlines()
    missing = [x for x in suffixes if x not in found]
    if missing:
        raise FileNotFoundError(f"no member ending in {', '.join(missing)} in {', '.join(map(str, archives))}")
    return found


def sgm_segments(lines):
    """The text of each <seg> of an SGML test set, entities decoded."""
    return [unescape(m.group(1)).strip() for line in lines if (m := _SEGMENT.search(line))]


def clean(line):
    return " ".join(line.split())


def write_raw(orig: Path, raw: Path):
    train_pairs = [(de, de[:-3] + ".en") for de in TRAIN_CORPORA]
    wanted = [name for pair in train_pairs for name in pair] + list(VALID) + list(TEST_SGM)
    members = read_members(sorted(orig.glob("*.tgz")), wanted)
    raw.mkdir(parents=True, exist_ok=True)
    with open(raw / "train.de", "w", encoding="utf-8") as fde, \
            open(raw / "train.en", "w", encoding="utf-8") as fen:
        for de_suffix, en_suffix in train_pairs:
            de, en = members[de_suffix], members[en_suffix]
            if len(de) != len(en):
                raise ValueError(f"{de_suffix}: {len(de)} German but {len(en)} English lines")
            for d, e in zip(de, en):
                fde.write(clean(d) + "\n")
                fen.write(clean(e) + "\n")
    for split, (de_name, en_name), parse in (
        ("valid", VALID, lambda lines: lines),
        ("test", TEST_SGM, sgm_segments),
    ):
        for lang, name in (("de", de_name), ("en", en_name)):
            lines = parse(members[name])
            (raw / f"{split}.{lang}").write_text("".join(clean(x) + "\n" for x in lines), "utf-8")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("work_dir", type=Path)
    parser.add_argument("--vocab-size", type=int, default=32000, help="joint sentencepiece vocabulary")
    parser.add_argument("--skip-download", action="store_true", help="use the archives already in WORK_DIR/orig")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s | %(levelname)s | %(name)s | %(message)s")
    if not args.skip_download:
        download(args.work_dir / "orig")
    write_raw(args.work_dir / "orig", args.work_dir / "raw")
    prepare(args.work_dir / "raw", args.work_dir, vocab_size=args.vocab_size)


if __name__ == "__main__":
    main()
