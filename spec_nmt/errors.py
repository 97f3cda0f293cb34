"""One-line errors for users of the fairseq command-line tools.

fairseq's CLIs print a full traceback for any exception. Mistakes a user can fix (a wrong flag,
a wrong checkpoint) raise ``SpecNmtError`` instead, which the hook below prints as a single
``spec_nmt error: ...`` line; every other exception keeps its traceback.
"""

import sys


class SpecNmtError(ValueError):
    """A problem with the user's input, flags or files, with the fix in its message."""


def _print_user_errors(exc_type, exc, traceback, fallback=sys.excepthook):
    if issubclass(exc_type, SpecNmtError):
        print(f"spec_nmt error: {exc}", file=sys.stderr)
    else:
        fallback(exc_type, exc, traceback)


def install_error_hook() -> None:
    if sys.excepthook is not _print_user_errors:
        sys.excepthook = _print_user_errors
