"""The --flagfile files of a command line, checked before absl reads them.

absl reads a flagfile as text and dies with a UnicodeDecodeError traceback
on binary bytes, and it skips a flagfile that includes itself with a warning,
running with the flags it never read. Both become one line naming the file.
Only regular files are read here: a pipe (`--flagfile=<(...)`) can be read once,
by absl.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Sequence

from engine.errors import UserError

_DIRECTIVES = ("--flagfile=", "-flagfile=")


def check_flagfiles(args: Sequence[str]) -> None:
    """Raises UserError for a flagfile among `args` (the command line without the
    program), or nested in one, that is not UTF-8 text or includes itself."""
    for name in _named_files(args):
        _check(name, stack=())


def _named_files(args: Sequence[str]) -> Iterator[str]:
    """The flagfiles named on the command line, as absl finds them."""
    rest = list(args)
    while rest:
        arg = rest.pop(0)
        if arg == "--":
            return
        if arg in ("--flagfile", "-flagfile") and rest:
            yield os.path.expanduser(rest.pop(0))
        elif arg.startswith(_DIRECTIVES):
            yield os.path.expanduser(arg.split("=", 1)[1].strip())


def _check(name: str, stack: tuple[str, ...]) -> None:
    if not name:
        return
    real = os.path.realpath(name)
    if real in stack:
        chain = " -> ".join([*stack[stack.index(real) :], real])
        raise UserError(
            f"--flagfile={name} includes itself ({chain}); remove the --flagfile line that closes the loop"
        )
    try:
        if not stat.S_ISREG(os.stat(name).st_mode):
            return  # A pipe or device: absl reads it (once); a directory: absl names it.
        with open(name, "rb") as handle:
            data = handle.read()
    except OSError:
        return  # absl names the file and the reason in one line.
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UserError(
            f"--flagfile={name} is not a text file (byte {data[error.start]:#04x} at offset {error.start} is "
            "not UTF-8); a flagfile holds one --flag=value per line"
        ) from None
    for line in text.splitlines():
        if line.startswith(_DIRECTIVES):
            _check(os.path.expanduser(line.split("=", 1)[1].strip()), (*stack, real))
