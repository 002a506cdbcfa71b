"""`python -m engine.main`: flags -> RunConfig -> training job -> exit code.

User errors (bad flags, data, model_dir, checkpoints) end the process with
one line on stderr and exit status 2; anything else is a bug and keeps its
traceback.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # Keep TF's C++ start-up chatter out.

from absl import app, logging  # noqa: E402

from engine import flags as engine_flags  # noqa: E402  (defines the flags)
from engine.errors import UserError  # noqa: E402

USER_ERROR_EXIT = 2


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


def run_cli() -> None:
    logging.set_verbosity(logging.INFO)
    app.run(lambda argv: sys.exit(_main_with_clean_errors(argv)))


if __name__ == "__main__":
    run_cli()
