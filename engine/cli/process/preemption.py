"""Graceful stop on SIGTERM/SIGINT/SIGHUP: finish the loop, save, exit 128+signal.

Schedulers preempt with SIGTERM, people with Ctrl-C, and a closed ssh session
sends SIGHUP (after which the terminal takes no more output: it goes to
/dev/null, `leave_a_closed_terminal`). Either way the
trainer is asked to stop after the compiled call it is running (at most
`steps_per_loop` train steps or eval batches), saves a checkpoint and writes
its summaries; a restart with the same flags continues from there. A second
signal ends the process at once with 128+signal. A task that `engine.launch`
started (`LAUNCHER_PID_ENV`) takes its launcher's signal as the same stop it
is already making, never as the second: a terminal's Ctrl-C reaches the
launcher's whole process group, and the launcher passes the stop on too.

SIGUSR1 asks the process what it is doing: the watcher writes every thread's stack and
the trainer's progress to `<model_dir>/diagnostics/<task>.txt` (`engine.diagnostics`), or
to stderr before a trainer is registered, and the run goes on.

Python runs signal handlers only between bytecodes, so while the main thread
sits in one compiled call a handler would wait for the whole call (and two
signals would merge into one). `engine.main` therefore calls
`install_watcher()` before TensorFlow starts any thread: the signals are
blocked in every thread (`signal.pthread_sigmask`) and one watcher thread
takes them with `signal.sigwaitinfo`, which returns at once whatever the main
thread is doing. In-process users (tests, notebooks) without the watcher get
ordinary Python handlers, with the limits above.

Job control (Ctrl-Z then `fg`, a scheduler's suspend and resume: SIGSTOP or
SIGTSTP, then SIGCONT) must never stop a run. The watcher waits without a
timeout (`sigwaitinfo`), not with `sigtimedwait`: Python 3.11's
`sigtimedwait`, interrupted by a stop and resumed past its deadline, returns
a siginfo it never filled (seen: SIGQUIT, SIGHUP, numbers that are no signal,
a sender pid of -542834133), on which the watcher exited 131 or died.
`sigwaitinfo` retries its interrupted wait and returns only a signal the
kernel delivered; the watcher still acts only on a signal it watches and
names a sender only where the kernel says a process sent it. To be paused it
is woken by `WAKE_SIGNAL` sent to its thread alone (`signal.pthread_kill`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from absl import logging

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOP_SIGNALS = HANDLED_SIGNALS  # The launchers take the same ones (engine.launch.task_processes).
DIAGNOSTICS_SIGNAL = signal.SIGUSR1  # "What are you doing?": a report, and the run goes on.
WATCHED_SIGNALS = (*HANDLED_SIGNALS, DIAGNOSTICS_SIGNAL)
# Set by engine.launch in each task's environment: its pid, whose signals pass on a stop.
LAUNCHER_PID_ENV = "ENGINE_LAUNCHER_PID"


def launcher_pid() -> int | None:
    """The pid of the engine.launch that started this process and still is its parent, or None."""
    try:
        pid = int(os.environ.get(LAUNCHER_PID_ENV, ""))
    except ValueError:
        return None
    return pid if pid == os.getppid() else None


def leave_a_closed_terminal() -> None:
    """After SIGHUP: stdout and stderr that are a terminal go to /dev/null, so that a line
    written while saving does not fail on the closed terminal (EIO) and end the save."""
    for fd in (1, 2):
        try:
            if os.isatty(fd):
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, fd)
                os.close(devnull)
        except OSError:
            pass


# Sent to the watcher's thread alone (pthread_kill) to wake it from its wait when it is to pause;
# blocked in every thread with the others, so that one sent from outside is taken and ignored.
WAKE_SIGNAL = signal.SIGRTMIN + 3
_WAITED_FOR = (*WATCHED_SIGNALS, WAKE_SIGNAL)
# si_code of a signal that a process sent (kill, sigqueue, tgkill): only then is si_pid its sender.
_SENT_BY_A_PROCESS = (0, -1, -6)  # SI_USER, SI_QUEUE, SI_TKILL (Linux)


def taken_signal(info: signal.struct_siginfo | None) -> tuple[int, int] | None:
    """(signal, sender pid or 0) of a siginfo the watcher acts on; None for anything else.

    Only a watched signal counts (never the wake-up, never a value that is no signal), and
    a sender is named only where the kernel says a process sent it and its pid is one (> 0):
    a signal from the kernel (a closed terminal's SIGHUP) has none."""
    if info is None or info.si_signo not in WATCHED_SIGNALS:
        return None
    sent = info.si_code in _SENT_BY_A_PROCESS and info.si_pid > 0
    return info.si_signo, info.si_pid if sent else 0


def _wait_for_a_signal() -> signal.struct_siginfo:
    """The next watched or wake-up signal; never a siginfo the kernel did not fill (see the
    module's docstring on `sigtimedwait`)."""
    return signal.sigwaitinfo(_WAITED_FOR)


class SignalRecord:
    """Which signal arrived, if any."""

    def __init__(self):
        self.signum: int | None = None

    @property
    def exit_status(self) -> int:
        return 128 + self.signum if self.signum is not None else 0


class _Watcher:
    """The thread that owns SIGTERM/SIGINT: the first asks the registered
    trainer to stop, a second one (or one with nothing to stop) exits at once."""

    def __init__(self, wait: Callable[[], signal.struct_siginfo | None] = _wait_for_a_signal):
        self._wait = wait  # Blocks until a signal comes: _wait_for_a_signal, or a test's.
        self._thread: int | None = None  # The watching thread's ident, which WAKE_SIGNAL wakes.
        self._lock = threading.Lock()
        self._trainer: Any = None  # The registered trainer (request_stop, progress), or None.
        self._record: SignalRecord | None = None
        self._stopping = False
        self._paused_changed = threading.Condition()
        self._paused = False
        self._waiting = False  # Inside its wait for a signal.
        self._trained = False  # A trainer was registered: past the start-up.
        self._diagnostics: tuple[str, str] | None = None  # (directory, task name) of the reports.

    def watch(self) -> None:
        """The watcher thread's loop; returns only when its wait raises (a test's end)."""
        self._thread = threading.get_ident()
        while True:
            with self._paused_changed:
                while self._paused:
                    self._paused_changed.wait()
                self._waiting = True
            try:
                info = self._wait()
            finally:
                with self._paused_changed:
                    self._waiting = False
                    self._paused_changed.notify_all()
            taken = taken_signal(info)
            if taken is None:
                continue  # The wake-up (to pause), or nothing the watcher acts on.
            if taken[0] == DIAGNOSTICS_SIGNAL:
                self._report()
            else:
                self._take(*taken)

    def _report(self) -> None:
        """Writes what this process is doing (engine.diagnostics); never raises, since the
        watcher must live on to take the stop signals."""
        from engine import diagnostics

        with self._lock:
            trainer, where = self._trainer, self._diagnostics
        try:
            progress = trainer.progress() if trainer is not None else {"doing": "not training (start-up or end)"}
            task = where[1] if where is not None else f"pid {os.getpid()}"
            text = diagnostics.report(progress, task=task)
            if trainer is None or where is None:
                sys.stderr.write(text)
                sys.stderr.flush()
                return
            path = diagnostics.write_report(where[0], where[1], text)
            logging.warning("SIGUSR1 received: wrote what this process is doing to %s; the run goes on", path)
        except Exception as error:  # noqa: BLE001 (any failure of a report is one line, never the watcher's end)
            logging.warning("SIGUSR1 received: could not write the diagnostics report (%s)", error)

    def _take(self, signum: int, sender: int = 0) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGHUP:
            leave_a_closed_terminal()
        with self._lock:
            if (
                sender
                and sender == launcher_pid()
                and (self._stopping or (self._trainer is None and self._trained))
            ):
                # The launcher passing on the stop this process makes already (or it is past
                # training, about to exit): the launcher bounds it, and it must not cut the save.
                return
            if self._stopping or self._trainer is None:
                logging.warning(
                    "%s received%s: exiting now with status %d%s",
                    name,
                    " again" if self._stopping else "",
                    128 + signum,
                    _sent_by(sender),
                )
                logging.flush()
                sys.stderr.flush()
                _exit_at_once(128 + signum)
            self._stopping = True
            assert self._record is not None, "registered together with the trainer"
            self._record.signum = signum
            logging.warning(
                "%s received: stopping after this compiled call and saving a checkpoint; "
                "send it again to exit at once",
                name,
            )
            self._trainer.request_stop()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """While inside, the watcher takes no signal: they stay pending in the process."""
        with self._paused_changed:
            self._paused = True
            while self._waiting:
                if self._thread is not None:  # A wake-up sent before its wait begins stays pending for it.
                    signal.pthread_kill(self._thread, WAKE_SIGNAL)
                self._paused_changed.wait(timeout=1.0)
        try:
            yield
        finally:
            with self._paused_changed:
                self._paused = False
                self._paused_changed.notify_all()

    @contextlib.contextmanager
    def stopping(self, trainer, diagnostics: tuple[str, str] | None = None) -> Iterator[SignalRecord]:
        record = SignalRecord()
        with self._lock:
            self._trainer, self._record, self._stopping = trainer, record, False
            self._trained, self._diagnostics = True, diagnostics
        try:
            yield record
        finally:
            with self._lock:
                self._trainer = self._diagnostics = None
                # A stop in progress keeps the next signal fatal; otherwise one signal ends at once too.
                self._stopping = self._stopping or record.signum is not None


def _exit_at_once(status: int) -> None:
    """Ends the process now, without the main thread's `finally` blocks: first removes the
    model_dir's writer lock file it holds, which a start-up cut short left behind (the next run
    took it over with a warning). Looked up, not imported: an import from this thread could wait
    on the main thread's, and a process that has not imported it holds no lock."""
    model_dir = sys.modules.get("engine.model_dir")
    if model_dir is not None:
        try:
            model_dir.abandon_writer_locks()
        except Exception:  # noqa: BLE001 (a lock file left is the old behaviour; the exit must come)
            pass
    os._exit(status)


def _sent_by(pid: int) -> str:
    """' (sent by pid N: its command)': a signal that ends a process before it trained names its
    sender, since nothing else will tell who it was."""
    if pid <= 0:
        return ""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            command = cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        command = ""
    return f" (sent by pid {pid}" + (f": {command[:200]})" if command else ")")


_watcher: _Watcher | None = None


def install_watcher() -> None:
    """Blocks SIGTERM/SIGINT/SIGHUP (SIGUSR1, WAKE_SIGNAL) in this and every later thread, starts the watcher.

    Call it first thing in the program's main thread, before TensorFlow
    starts threads: a thread that does not block the signals could take one
    with its default action and end the process without a checkpoint.
    """
    global _watcher
    if _watcher is not None:
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, _WAITED_FOR)
    _watcher = _Watcher()
    threading.Thread(target=_watcher.watch, name="signal-watcher", daemon=True).start()


@contextlib.contextmanager
def signals_left_pending() -> Iterator[None]:
    """While inside, SIGTERM/SIGINT stay pending instead of reaching the watcher.

    A cluster task's start-up runs inside one TensorFlow call that holds the
    GIL, so the watcher could take a signal but never act on it; left
    pending, the signal is seen by the start-up watchdog process
    (`engine.cluster.multi_host.bounded_startup`), which ends the task at once.
    """
    if _watcher is None:
        yield
        return
    with _watcher.paused():
        yield


@contextlib.contextmanager
def stop_on_signals(trainer, *, diagnostics: tuple[str, str] | None = None) -> Iterator[SignalRecord]:
    """While inside, SIGTERM/SIGINT/SIGHUP call `trainer.request_stop()`; the record says which came.
    Under the watcher, SIGUSR1 writes a report to `diagnostics` (a directory and the task's name)."""
    if _watcher is not None:
        with _watcher.stopping(trainer, diagnostics) as record:
            yield record
        return
    record = SignalRecord()
    previous = {signum: signal.getsignal(signum) for signum in HANDLED_SIGNALS}

    def handle(signum, frame):
        if signum == signal.SIGHUP:
            leave_a_closed_terminal()
        record.signum = signum
        for handled in HANDLED_SIGNALS:  # A second signal ends the process.
            signal.signal(handled, signal.SIG_DFL)
        logging.warning(
            "%s received: stopping after this loop and saving a checkpoint", signal.Signals(signum).name
        )
        trainer.request_stop()

    for signum in HANDLED_SIGNALS:
        signal.signal(signum, handle)
    try:
        yield record
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
