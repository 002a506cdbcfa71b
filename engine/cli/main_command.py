"""The program behind `python -m engine.main`: flags (over config files) -> RunConfig and its cluster
(resolved once, passed down) -> job -> exit code.

User errors (bad flags, data, model_dir, checkpoints) end the process with
one line on stderr and exit status 2; anything else is a bug and keeps its
traceback. How the log lines look and which tasks print them:
`engine.cli.process.console`; the table at the end: `engine.cli.run.summary`.
"""

import os
import sys
import threading
import time
from typing import NoReturn

from absl import app, flags, logging

from engine.cli.config import flags as engine_flags
from engine.cli.config.flag_names import FlagTermsFilter, in_flag_terms
from engine.cli.process import console
from engine.errors import USER_ERROR_EXIT, UserError, one_line, printable
from engine.status_line import status_line

# Where absl printed a module docstring and every flag in alphabetical order: engine.cli.config.usage
# (--helpfull too: the engine's flags by concern, then absl's).
SHORT_HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpshort", "-helpshort")
FULL_HELP_FLAGS = ("--helpfull", "-helpfull")
HELP_FLAGS = ("--help", "-help", "-?", "--helpshort", "-helpshort", "--helpfull", "-helpfull", "--helpxml")


# Where the run's goodput clock starts: the process's start under `run_cli` (engine.main's own
# process), else (in-process callers of `main`) the call of `main`.
_process_started: float | None = None


def main(argv: list[str]) -> int:
    started_at = _process_started or time.time()
    if len(argv) > 1:
        raise UserError(f"unexpected arguments {argv[1:]}; every setting is a --flag")
    from engine.lean_imports import optional_libraries_hidden
    from engine.native_logs import import_tensorflow_quietly

    with optional_libraries_hidden():  # Keras's scikit-learn, pandas...; TensorBoard's boto3 (lean_imports).
        import_tensorflow_quietly()  # The first import of TensorFlow (the flags do not import it).
        from engine.cli.run.job import run  # TensorBoard's hparams summaries among its imports.
    from engine.cli.config.config_files import as_yaml, printed_settings, run_from_flags

    # Over --config_file and <model_dir>/config.yaml; the cluster resolved once, passed down.
    config, multi_host = run_from_flags(engine_flags.FLAGS)
    if config.print_config:  # Checked, printed as a --config_file, nothing run or written.
        print(as_yaml(printed_settings(config)), end="")
        return 0
    if config.dry_run:  # Checked as its cluster would run it, on this host; nothing written.
        from engine.cli.config.flag_names import errors_in_flag_terms
        from engine.cli.run.dry_run import dry_run

        with console.configured(console.Console.for_run(config.schedule, None)), errors_in_flag_terms():
            return dry_run(config, multi_host)
    from engine.cli.run.summary import summary_table

    this_console = console.Console.for_run(config.schedule, multi_host.cluster)
    with console.configured(this_console):
        result = run(config, multi_host, started_at=started_at)
        table = summary_table(config, result) if this_console.speaks_for_the_run else None
        if table is not None:
            logging.info("%s", table)
    return result.get("exit_status", 0)


def main_with_clean_errors(argv: list[str]) -> int:
    try:
        return main(argv)
    except UserError as error:
        logging.flush()
        status_line.clear()  # The error's line, not the bar's.
        # Escaped: a message may quote a model_dir's text (a metric name, a lock's host).
        print(f"engine.main: error: {printable(in_flag_terms(error))}", file=sys.stderr)
        return getattr(error, "exit_status", USER_ERROR_EXIT)  # PeerLostError: a rerun may help.


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parsing, with its errors (unknown flag, bad value, missing --flagfile)
    as one line and exit 2 like every other user error, instead of exit 1."""
    from engine.cli.config.flagfiles import check_flagfiles

    if any(arg in SHORT_HELP_FLAGS for arg in argv[1:]):
        from engine.cli.config.usage import main_help

        print(main_help(), end="")
        sys.exit(0)
    if any(arg in FULL_HELP_FLAGS for arg in argv[1:]):
        from engine.cli.config.usage import full_help

        print(full_help(flags.FLAGS), end="")
        sys.exit(0)
    try:
        check_flagfiles(argv[1:])
        return flags.FLAGS(argv)
    except UserError as error:
        # Escaped: a message may quote a model_dir's text (a metric name, a lock's host).
        print(f"engine.main: error: {printable(in_flag_terms(error))}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)
    except flags.Error as error:
        print(f"engine.main: error: {one_line(error)}; see --helpfull", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)
    except SystemExit as done:  # absl prints the help asked for, then exits 1: not a failure.
        if done.code == 1 and any(arg.split("=")[0] in HELP_FLAGS for arg in argv[1:]):
            sys.exit(0)
        raise


def run_cli() -> None:
    global _process_started
    from engine.goodput import process_start_time

    _process_started = process_start_time()
    logging.set_verbosity(logging.INFO)
    logging.get_absl_handler().addFilter(FlagTermsFilter())  # The library's warnings, in flags.
    logging.get_absl_handler().addFilter(console.TensorFlowPerSaveLines())
    app.run(lambda argv: exit_process(main_with_clean_errors(argv)), flags_parser=parse_flags)


def exit_process(status: int) -> NoReturn:
    """Ends engine.main's own process with `status`: what the interpreter's exit would still do
    for the run happens first (the threads that are not daemons, such as a checkpoint write,
    are joined, the exit handlers run, the output is flushed), then the process ends at once.

    The interpreter's finalization that this skips has nothing left to give a finished run:
    its teardown of TensorFlow's modules costs CPU in every task of a cluster, and it is unsafe
    where a TensorFlow daemon thread (a `ClusterCoordinator`'s) is still inside a call, which
    Python 3.11 unwinds and TensorFlow's C++ swallows, aborting a run that succeeded (figures
    and the incident: benchmarks/RESULTS.md, "Figures behind the code's choices")."""
    from engine.compat import run_exit_handlers

    iterator_release = sys.modules.get("engine.loop.iterator_release")  # Imported where the run freed one.
    if iterator_release is not None:
        iterator_release.do_not_wait_at_exit()  # A destructor that never returns must not hold a finished run.
    main_thread = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main_thread and not thread.daemon:
            thread.join()
    run_exit_handlers()
    logging.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
