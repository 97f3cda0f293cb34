"""The HTML trace of draft/verify on the bundled model pair: its content, and (where Chromium is
installed) that it renders to a non-blank screenshot."""

import html
import os
import re
import shutil
import struct
import subprocess
import sys
import zlib

import pytest

from spec_nmt.translator import SpecTranslator
from tests.conftest import BUNDLED_MODEL_DIR, REPO

SENTENCES = ["Das Haus ist groß.", "Guten Morgen, <Welt> & Co."]


@pytest.fixture(scope="module")
def trace_page(tmp_path_factory):
    out = tmp_path_factory.mktemp("trace") / "trace.html"
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "trace.py"), str(BUNDLED_MODEL_DIR), *SENTENCES,
         "--block-size", "6", "--output", str(out)],
        check=True, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return out


def test_the_page_shows_every_iteration_and_the_lossless_translation(trace_page):
    page = trace_page.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page and "http" not in page
    translations = SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR).translate(SENTENCES, block_size=6)
    sections = page.split("<h2>")[1:]
    assert len(sections) == len(SENTENCES)
    for section, translation in zip(sections, translations):
        stated = int(re.search(r"(\d+) iterations \(verifier calls\)", section).group(1))
        assert section.count('<div class="iteration">') == stated >= 1
        assert f'<p class="translation">{html.escape(translation)}</p>' in section  # escaped
        assert "[MASK]" in section and 'class="tok pending"' in section
        assert re.search(r'class="tok (correction|bonus)"', section)
    assert "Guten Morgen, &lt;Welt&gt; &amp; Co." in page  # user text is escaped


def png_size_and_pixels(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    chunks, offset = [], 8
    while offset < len(data):
        length, kind = struct.unpack(">I4s", data[offset : offset + 8])
        if kind == b"IDAT":
            chunks.append(data[offset + 8 : offset + 8 + length])
        offset += 12 + length
    return width, height, zlib.decompress(b"".join(chunks))


# .ci/run installs Chromium, so CI (CI set) renders the page in it every run; elsewhere the test
# is skipped without it
@pytest.mark.skipif(shutil.which("chromium") is None and not os.environ.get("CI"),
                    reason="Chromium is not installed")  # fmt: skip
def test_headless_chromium_renders_the_page(trace_page, tmp_path):
    shot = tmp_path / "trace.png"
    subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
         "--window-size=1000,700", trace_page.as_uri()],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    width, height, pixels = png_size_and_pixels(shot)
    assert (width, height) == (1000, 700)
    assert len(set(pixels)) > 50  # coloured token boxes and text, not a blank page
