"""The --flagfile files of a command line, checked before absl reads them.

absl reads a flagfile as text and dies with a UnicodeDecodeError traceback
on binary bytes, it skips a flagfile that includes itself with a warning,
running with the flags it never read, and it blocks forever on a named pipe
nothing writes to (or reads /dev/zero until memory runs out). Each becomes one
line naming the file: a flagfile is a regular file of at most 1 MiB, or the
pipe the shell opens for `--flagfile=<(...)` (/dev/fd/N), which only absl reads
(a pipe can be read once).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Sequence

from engine.cli.config.small_files import file_kind, is_shell_pipe, read_small_file
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
        mode = os.stat(name).st_mode
    except OSError:
        return  # absl names the file and the reason in one line.
    if stat.S_ISDIR(mode) or (stat.S_ISFIFO(mode) and is_shell_pipe(name)):
        return  # A directory: absl names it; the shell's pipe: absl reads it (once).
    fix = "write the flags to a regular file, one --flag=value per line"
    if not stat.S_ISREG(mode):
        raise UserError(f"--flagfile={name} is {file_kind(mode)}, not a regular file; {fix}")
    data = read_small_file(name, f"--flagfile={name}", fix=fix)
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
