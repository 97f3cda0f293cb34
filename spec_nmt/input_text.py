"""spec-nmt-translate's input as text lines: its encoding guessed from its first bytes, input that
is not text refused, and each line that holds bytes its encoding cannot read named in a warning.

Whether the input is text is judged on its first bytes. A NUL byte there is refused. Text whose
bytes above ASCII are none of them UTF-8, and that reads as letters and punctuation in
Windows-1252 (Latin-1 and the quotes „“ Windows adds), is German saved the old way: it is read
so, with a warning, however short (a share of bad bytes would call a two-line file binary).
Otherwise more than MAX_NON_UTF8_SHARE of characters that are not UTF-8 is refused; below it the
input stays UTF-8 (its umlauts would be garbled as Latin-1) and the lines with bad bytes are
named.
"""

import codecs
import itertools
import re
import sys
import unicodedata
from typing import Iterator, List, Optional, TextIO

from spec_nmt.errors import SpecNmtError

TEXT_CHECK_BYTES = 8192
MAX_NON_UTF8_SHARE = 0.1
LATIN1 = "cp1252"
# The control characters that text holds
TEXT_CONTROLS = "\t\n\r\f"
# Bytes the encoding could not decode, as the surrogateescape error handler gives them
UNDECODED = re.compile("[\udc80-\udcff]")
# Lines with such bytes named one by one; after these, one warning says that more follow
NAMED_BAD_LINES = 5
PREFIX = "spec-nmt-translate warning:"


def input_name(path: str) -> str:
    return "stdin" if path == "-" else path


def open_input(path: str, encoding: Optional[str] = None) -> TextIO:
    """The input as text: only a newline ends a line, so N lines in always means N lines out,
    and undecodable bytes are kept as surrogate escapes for decoded_lines. Without an
    ``encoding``, input that is not text is refused and German in Latin-1 is read as such."""
    name = input_name(path)
    if path == "-":
        from spec_nmt.text import tolerant_stdin  # (text.py loads torch)

        # (typed lines are text; peeking would wait for them)
        if encoding is None and not sys.stdin.isatty():
            encoding = input_encoding(sys.stdin.buffer.peek(TEXT_CHECK_BYTES)[:TEXT_CHECK_BYTES],
                                      name)  # fmt: skip
        tolerant_stdin(encoding, errors="surrogateescape")
        return sys.stdin
    try:
        if encoding is None:
            with open(path, "rb") as raw:
                encoding = input_encoding(raw.read(TEXT_CHECK_BYTES), name)
        return open(path, encoding=encoding, errors="surrogateescape", newline="\n")
    except OSError as error:
        raise SpecNmtError(f"--input {path}: {error.strerror}") from error


def input_encoding(head: bytes, name: str) -> str:
    """UTF-8, or Windows-1252 (with a warning) for German in Latin-1, judged on the input's
    first bytes; input that is not text is refused."""
    if b"\0" in head:
        refuse(name, "holds NUL bytes")
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text = decoder.decode(head, final=False)  # (a character cut at the end is no error)
    if "\ufffd" not in text:
        return "utf-8"
    if not any(ord(ch) > 127 and ch != "\ufffd" for ch in text) and reads_as_latin1(head):
        print(f"{PREFIX} {name} is not UTF-8; reading it as Latin-1 (Windows-1252); --encoding "
              "ENCODING names its encoding", file=sys.stderr)  # fmt: skip
        return LATIN1
    if text.count("\ufffd") > MAX_NON_UTF8_SHARE * len(text):
        refuse(name, "is mostly not UTF-8")
    return "utf-8"


def reads_as_latin1(head: bytes) -> bool:
    """Whether ``head`` is text in Windows-1252: no control characters but those of text, and
    its characters above ASCII mostly letters (umlauts, ß) or punctuation („“ –), not
    symbols."""
    try:
        text = head.decode(LATIN1)
    except UnicodeDecodeError:  # (bytes Windows-1252 leaves undefined)
        return False
    if any(unicodedata.category(ch) == "Cc" and ch not in TEXT_CONTROLS for ch in text):
        return False
    above_ascii = [unicodedata.category(ch)[0] for ch in text if ord(ch) > 127]
    return 2 * sum(kind in "LP" for kind in above_ascii) >= len(above_ascii)


def refuse(name: str, problem: str) -> None:
    raise SpecNmtError(
        f"{name} {problem}: it is not text (a binary or compressed file?); give German text, "
        "one sentence or paragraph per line, in UTF-8, or name its encoding with --encoding"
    )


def decoded_lines(stream: TextIO, name: str) -> Iterator[str]:
    """The stream's lines without their newlines, each byte its encoding could not read made
    U+FFFD; the first lines that held such bytes are named in a warning."""
    bad_lines = 0
    for number, line in enumerate(stream, start=1):
        line, undecoded = UNDECODED.subn("\ufffd", line.rstrip("\n"))
        if undecoded:
            bad_lines += 1
            if bad_lines <= NAMED_BAD_LINES:
                print(f"{PREFIX} {name} line {number} holds {undecoded} byte(s) that are not "
                      f"{stream.encoding}, read as U+FFFD; --encoding ENCODING names the "
                      "input's encoding", file=sys.stderr, flush=True)  # fmt: skip
            elif bad_lines == NAMED_BAD_LINES + 1:
                print(f"{PREFIX} {name}: more lines hold bytes that are not {stream.encoding}; "
                      "they are not named", file=sys.stderr, flush=True)  # fmt: skip
        yield line


def buffers(lines: Iterator[str], size: int) -> Iterator[List[str]]:
    """Lists of at most ``size`` lines, as they are read."""
    while True:
        buffer = list(itertools.islice(lines, size))
        if not buffer:
            return
        yield buffer
