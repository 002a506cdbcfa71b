"""`python -m engine.main`: flags -> RunConfig -> training job -> exit code.

User errors (bad flags, data, model_dir, checkpoints) end the process with
one line on stderr and exit status 2; anything else is a bug and keeps its
traceback.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # Keep TF's C++ start-up chatter out.

from engine.preemption import install_watcher  # noqa: E402

if __name__ == "__main__":
    install_watcher()  # Before TensorFlow starts threads: they must all block SIGTERM/SIGINT.

from absl import app, flags, logging  # noqa: E402

from engine import flags as engine_flags  # noqa: E402  (defines the flags)
from engine.errors import USER_ERROR_EXIT, UserError, one_line  # noqa: E402


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise UserError(f"unexpected arguments {argv[1:]}; every setting is a --flag")
    from engine.config import RunConfig
    from engine.job import run

    config = RunConfig.from_flags(engine_flags.FLAGS)
    return run(config).get("exit_status", 0)


def _main_with_clean_errors(argv: list[str]) -> int:
    try:
        return main(argv)
    except UserError as error:
        logging.flush()
        print(f"engine.main: error: {error}", file=sys.stderr)
        return USER_ERROR_EXIT


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's parsing, with its errors (unknown flag, bad value, missing --flagfile)
    as one line and exit 2 like every other user error, instead of exit 1."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as error:
        print(f"engine.main: error: {one_line(error)}; see --helpfull", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)


def run_cli() -> None:
    logging.set_verbosity(logging.INFO)
    app.run(lambda argv: sys.exit(_main_with_clean_errors(argv)), flags_parser=_parse_flags)


if __name__ == "__main__":
    run_cli()
