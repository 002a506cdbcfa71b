"""How the launchers and their tasks take SIGINT, SIGTERM and SIGHUP, in this process (no task
starts): a launcher's first signal is passed on and waited for, its second ends every task at
once without a traceback; a task takes its launcher's signal as the stop it already makes; a
stuck task cannot hang a launcher's stop. One process test: engine.main in a terminal that
closes (an ssh session) saves and exits 129. The launchers' processes: tests/cluster/test_launch.py,
tests/cluster/test_multi_host.py.

Covers: engine/cli/process/preemption.py, engine/launch/task_processes.py.
"""

from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import subprocess
import sys
import termios
import threading
import time
from unittest import mock

import pytest
from helpers import REPO, environment, latest_step, python_env

from engine.cli.process import preemption
from engine.launch import task_processes
from engine.launch.task_processes import Interrupted, Launcher, StopSignals, Task, make_tasks


def test_a_launchers_first_signal_stops_its_tasks_and_a_second_ends_them_at_once():
    killed, said, exits = [], [], []
    signals = StopSignals(lambda: killed.append(True), say=said.append, exit=exits.append)
    with pytest.raises(Interrupted) as first:
        signals.handle(signal.SIGTERM, None)
    assert first.value.signum == signal.SIGTERM and not killed and not exits
    signals.handle(signal.SIGTERM, None)  # while the tasks save: no exception into that clean-up
    assert killed == [True] and exits == [143]
    assert said == ["SIGTERM received again: every task ended at once (SIGKILL), without its save; exit 143"]


def test_a_signal_while_a_launcher_stops_its_tasks_anyway_is_one_line_and_a_second_ends_them():
    killed, said, exits = [], [], []
    signals = StopSignals(lambda: killed.append(True), say=said.append, exit=exits.append)
    signals.stop_under_way()
    signals.handle(signal.SIGTERM, None)  # No Interrupted into the stop under way.
    assert not killed and not exits
    assert said == [
        "SIGTERM received while every task is being stopped already (at most 10 s); "
        "send SIGTERM again to end them at once"
    ]
    signals.handle(signal.SIGTERM, None)
    assert killed == [True] and exits == [143]


@pytest.mark.cli
def test_sigterm_while_the_launcher_stops_a_failed_cluster_is_one_line_and_keeps_its_status(capsys):
    """`engine.launch --num_ps=1`: the cluster failed (status 1), and SIGTERM came while the
    launcher stopped what was left; its `finally` raised `Interrupted: 15` (a traceback)."""
    from absl import flags

    from engine.launch import launcher as launch

    class FailedCluster:
        """A Launcher whose run ended with status 1; SIGTERM arrives during its first stop."""

        def __init__(self, *args, **kwargs):
            self.restarts, self.stops = 0, 0

        def run(self) -> int:
            return 1

        def stop(self, **kwargs) -> None:
            self.stops += 1
            if self.stops == 1:
                signal.raise_signal(signal.SIGTERM)  # Its handler runs here, in this thread.

        def kill_now(self) -> None:
            raise AssertionError("a first signal kills nothing")

    previous = {signum: signal.getsignal(signum) for signum in (*preemption.STOP_SIGNALS, signal.SIGUSR1)}
    try:
        with mock.patch.object(launch, "Launcher", FailedCluster):
            status = launch.main(launch.parse_flags(["engine.launch", "--num_workers=1", "--num_ps=1", "--"]))
    finally:
        flags.FLAGS.unparse_flags()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    stderr = capsys.readouterr().err
    assert status == 1, stderr
    assert "Traceback" not in stderr and "Interrupted" not in stderr
    assert stderr.splitlines()[-2:] == [
        "[launch] SIGTERM received while every task is being stopped already (at most 10 s); "
        "send SIGTERM again to end them at once",
        "[launch] done with exit status 1",
    ], stderr


def test_a_launcher_takes_sighup_as_sigterm_and_leaves_a_closed_terminal():
    signals = StopSignals(lambda: None, say=lambda line: None, exit=lambda status: None)
    with (
        mock.patch.object(task_processes, "leave_a_closed_terminal") as left,
        pytest.raises(Interrupted) as first,
    ):
        signals.handle(signal.SIGHUP, None)
    assert first.value.signum == signal.SIGHUP and left.called
    previous = {signum: signal.getsignal(signum) for signum in preemption.STOP_SIGNALS}
    try:
        signals.install()
        assert {signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)} == {
            signals.handle
        }
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class FakeProcess:
    """A task's process that ignores SIGTERM and, `stuck`, SIGKILL too (a task in the kernel)."""

    def __init__(self, stuck: bool, log: list[int] | None = None):
        self.stuck, self.pid, self.signals = stuck, 4242, []
        self.log = log if log is not None else []

    def poll(self):
        return None

    def send_signal(self, signum: int) -> None:
        self.signals.append(signum)
        self.log.append(signum)

    def kill(self) -> None:
        self.signals.append(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        if self.stuck or signal.SIGKILL not in self.signals:
            time.sleep(min(timeout or 0, 0.05))
            raise subprocess.TimeoutExpired("task", timeout)
        return -9


def tasks_of(spec: dict[str, tuple[str, ...]]) -> list[Task]:
    return make_tasks(spec, ["--train_steps=10"])


def test_a_stop_passes_the_signal_to_engine_main_and_sigterm_to_servers_the_coordinator_first():
    tasks = tasks_of({"chief": ("h:1",), "worker": ("h:2",), "ps": ("h:3",)})
    order: list[int] = []
    processes = {task.name: FakeProcess(stuck=False, log=order) for task in tasks}
    for task in tasks:
        task.process = processes[task.name]  # type: ignore[assignment]
    Launcher(tasks, say=lambda line: None).stop(grace=0.1, signum=signal.SIGINT)
    assert [task.runs_main for task in tasks] == [True, False, False]
    assert processes["chief:0"].signals == [signal.SIGINT, signal.SIGKILL]  # engine.main: the signal itself
    assert processes["worker:0"].signals == [signal.SIGTERM, signal.SIGKILL]  # engine.server: SIGTERM
    assert order == [signal.SIGINT, signal.SIGTERM, signal.SIGTERM]  # the coordinator first


def test_sigusr1_to_a_launcher_asks_its_engine_main_tasks_for_reports_and_leaves_servers_alone():
    tasks = tasks_of({"chief": ("h:1",), "worker": ("h:2",), "ps": ("h:3",)})
    processes = {task.name: FakeProcess(stuck=False) for task in tasks}
    for task in tasks:
        task.process = processes[task.name]  # type: ignore[assignment]
    said: list[str] = []
    launcher = Launcher(tasks, say=said.append)
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        task_processes.forward_report_requests(lambda: launcher)
        os.kill(os.getpid(), signal.SIGUSR1)  # Handled at the next bytecode: the launcher lives on.
        time.sleep(0.05)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert processes["chief:0"].signals == [signal.SIGUSR1]
    assert processes["worker:0"].signals == processes["ps:0"].signals == []  # engine.server: SIGUSR1 ends it
    assert said == [
        "SIGUSR1 received: asked chief:0 to write what it is doing to <model_dir>/diagnostics/<task>.txt; "
        "worker:0, ps:0 (engine.server) take no such request"
    ]


def test_a_task_that_survives_sigkill_cannot_hang_the_launchers_stop():
    tasks = tasks_of({"worker": ("h:1", "h:2")})
    for task in tasks:
        task.process = FakeProcess(stuck=True)  # type: ignore[assignment]
    said: list[str] = []
    launcher = Launcher(tasks, say=said.append)
    began = time.monotonic()
    with mock.patch.object(task_processes, "KILL_WAIT_SECONDS", 0.2):
        launcher.stop(grace=0.2)
    assert time.monotonic() - began < 3
    assert said == [
        f"warning: worker:{index} (pid 4242) is still there 0.2 s after SIGKILL (stuck in the kernel, e.g. on "
        "a lost file system); going on without it"
        for index in (0, 1)
    ]


def test_a_task_knows_its_launcher_and_never_sees_the_rendezvous_secret():
    (task,) = tasks_of({"worker": ("h:1",)})
    launcher = Launcher([task], say=lambda line: None)
    with (
        environment({"ENGINE_RENDEZVOUS_SECRET": "s" * 32}),
        mock.patch.object(task_processes.subprocess, "Popen") as popen,
        mock.patch.object(task_processes.threading, "Thread"),
    ):
        popen.return_value.pid = 1
        launcher.start(task)
    env = popen.call_args.kwargs["env"]
    assert env[preemption.LAUNCHER_PID_ENV] == str(os.getpid())
    assert "ENGINE_RENDEZVOUS_SECRET" not in env


class StoppableTrainer:
    """What the watcher asks of a Trainer: `request_stop`, counted."""

    def __init__(self):
        self.stops = 0

    def request_stop(self) -> None:
        self.stops += 1


@pytest.fixture
def watcher(monkeypatch):
    """A watcher (no thread), this process's parent as its launcher, os._exit recorded."""
    monkeypatch.setenv(preemption.LAUNCHER_PID_ENV, str(os.getppid()))
    exits: list[int] = []

    def fake_exit(status: int) -> None:
        exits.append(status)
        raise SystemExit(status)

    monkeypatch.setattr(preemption.os, "_exit", fake_exit)
    return preemption._Watcher(), exits


def test_a_report_that_cannot_be_written_is_one_warning_and_the_watcher_lives_on(watcher, tmp_path, caplog):
    """A model_dir whose diagnostics/ is a file (a read-only or full disk alike): the watcher,
    which must still take the stop signals, says so in one line instead of dying."""
    watcher, exits = watcher
    trainer = StoppableTrainer()
    trainer.progress = lambda: {"last completed step": 7}  # type: ignore[attr-defined]
    (tmp_path / "diagnostics").write_text("in the way")
    with watcher.stopping(trainer, diagnostics=(str(tmp_path / "diagnostics"), "main")) as record:
        watcher._report()
        watcher._take(signal.SIGTERM, sender=0)  # It still stops the run.
    warnings = [r.getMessage() for r in caplog.records if "SIGUSR1" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("SIGUSR1 received: could not write"), warnings
    assert trainer.stops == 1 and record.signum == signal.SIGTERM and exits == []


def test_a_task_takes_its_launchers_signal_as_the_stop_it_makes_already(watcher):
    watcher, exits = watcher
    trainer = StoppableTrainer()
    with watcher.stopping(trainer) as record:
        watcher._take(signal.SIGINT, sender=0)  # a terminal's Ctrl-C: the whole process group
        watcher._take(signal.SIGINT, sender=os.getppid())  # its launcher passing it on: not a second
        assert trainer.stops == 1 and not exits and record.exit_status == 130
        with pytest.raises(SystemExit):
            watcher._take(signal.SIGINT, sender=12345)  # a second from anyone else: at once, as before
    assert exits == [130]


def test_a_launchers_signal_after_training_lets_the_task_finish(watcher):
    watcher, exits = watcher
    with watcher.stopping(StoppableTrainer()):
        pass
    watcher._take(signal.SIGTERM, sender=os.getppid())  # writing metrics.json, releasing its lock
    assert not exits
    with pytest.raises(SystemExit):
        watcher._take(signal.SIGTERM, sender=0)
    assert exits == [143]


def test_a_launchers_signal_during_the_start_up_ends_the_task_at_once(watcher):
    watcher, exits = watcher
    with pytest.raises(SystemExit):  # nothing to save yet
        watcher._take(signal.SIGTERM, sender=os.getppid())
    assert exits == [143]


def test_sighup_saves_like_sigterm_and_exits_129(watcher):
    watcher, exits = watcher
    trainer = StoppableTrainer()
    with mock.patch.object(preemption, "leave_a_closed_terminal") as left, watcher.stopping(trainer) as record:
        watcher._take(signal.SIGHUP, sender=0)
    assert trainer.stops == 1 and record.exit_status == 129 and left.called and not exits


def siginfo(signo: int, pid: int, code: int = 0) -> signal.struct_siginfo:
    """A siginfo as `signal.sigwaitinfo` returns one: (signo, code, errno, pid, uid, status, band)."""
    return signal.struct_siginfo((signo, code, 0, pid, 0, 0, 0))


# What Python 3.11's sigtimedwait returned after Ctrl-Z then `fg`: a siginfo it never filled, with
# signals the process was not sent and senders that are no pid. Its SIGHUPs no check could tell
# from a real one: the watcher no longer calls it (tests/process/test_job_control.py).
GARBAGE = [
    siginfo(signal.SIGQUIT, -542834133),
    siginfo(322642408, -1228864816, code=326861104),
    siginfo(0, 321551064),
]


def test_the_watcher_acts_only_on_a_watched_signal_and_names_only_a_real_sender(watcher, caplog):
    """Garbage ends nothing and kills no watcher; a real SIGTERM after it still stops the run,
    and a sender is named only where the kernel says a process sent the signal."""
    watcher, exits = watcher
    waits = iter([*GARBAGE, siginfo(preemption.WAKE_SIGNAL, os.getpid(), code=-6)])

    def wait() -> signal.struct_siginfo:
        return next(waits)  # StopIteration at the end: the loop's end in this test.

    watcher._wait = wait
    trainer, ended = StoppableTrainer(), []

    def watch() -> None:
        try:
            watcher.watch()
        except StopIteration:
            ended.append(True)  # Every siginfo was taken, the last wait ended the loop.

    with watcher.stopping(trainer) as record:
        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        thread.join(timeout=10)
    assert ended == [True]
    assert trainer.stops == 0 and record.signum is None and exits == []
    assert preemption.taken_signal(siginfo(signal.SIGTERM, 4321)) == (signal.SIGTERM, 4321)
    assert preemption.taken_signal(siginfo(signal.SIGHUP, 4321, code=0x80)) == (signal.SIGHUP, 0)  # the kernel's
    assert preemption.taken_signal(siginfo(signal.SIGHUP, -542834133)) == (signal.SIGHUP, 0)
    assert preemption.taken_signal(None) is None
    with pytest.raises(SystemExit):  # nothing registered: a start-up's signal ends the process at once
        watcher._take(signal.SIGTERM, sender=-542834133)
    assert exits == [143] and "pid" not in caplog.records[-1].getMessage()


def test_a_launcher_pid_that_is_not_the_parent_is_nobodys():
    with environment({preemption.LAUNCHER_PID_ENV: "1"}):
        assert preemption.launcher_pid() == (1 if os.getppid() == 1 else None)
    with environment({preemption.LAUNCHER_PID_ENV: str(os.getppid())}):
        assert preemption.launcher_pid() == os.getppid()


def _controlling_terminal() -> None:
    """In the child, a session leader: its stdin (the terminal) becomes its controlling one."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


@pytest.mark.process
@pytest.mark.timeout(300)
def test_engine_main_in_a_terminal_that_closes_saves_and_exits_129(tmp_path):
    flags = ["--model=mlp", "--train_steps=1000000", "--steps_per_loop=20", "--eval_every=0"]
    master, terminal = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "engine.main", *flags, "--checkpoint_every=1000000", f"--model_dir={tmp_path}"],
        cwd=REPO,
        env=python_env(),
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        start_new_session=True,
        preexec_fn=_controlling_terminal,
    )
    os.close(terminal)
    try:
        seen, deadline = b"", time.monotonic() + 240
        while b"step 20/" not in seen:  # training is under way
            assert time.monotonic() < deadline and process.poll() is None, seen.decode(errors="replace")[-3000:]
            if select.select([master], [], [], 1.0)[0]:
                seen += os.read(master, 65536)
        os.close(master)  # The session closes: the kernel sends SIGHUP, and writes to it fail (EIO).
        closed = time.monotonic()
        assert process.wait(timeout=120) == 129
        assert time.monotonic() - closed < 60
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    step = latest_step(tmp_path)
    assert step is not None and step > 0 and step % 20 == 0, step
    assert not (tmp_path / ".writer.lock").exists() and not list(tmp_path.rglob("*_temp"))


@pytest.mark.process
@pytest.mark.timeout(120)
def test_a_parameter_server_task_takes_stop_signals_from_its_launcher_alone():
    """A terminal's Ctrl-C reaches the ps tasks too; they must outlive it until the coordinator
    has saved (it needs them), and end when their launcher (here: this process) says."""
    from helpers import free_ports, read_stderr_until

    chief, worker, ps = (f"localhost:{port}" for port in free_ports(3))
    process = subprocess.Popen(
        [sys.executable, "-m", "engine.server", "--task_type=ps", "--task_index=0"]
        + [f"--chief_host={chief}", f"--worker_hosts={worker}", f"--ps_hosts={ps}"],
        cwd=REPO,
        env=python_env(**{preemption.LAUNCHER_PID_ENV: str(os.getpid())}),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        read_stderr_until(process, "serving at", timeout=90)
        subprocess.run(["kill", "-INT", str(process.pid)], check=True, timeout=10)  # not its launcher
        read_stderr_until(process, "left to engine.launch", timeout=10)
        assert process.poll() is None
        process.send_signal(signal.SIGTERM)  # its launcher
        assert process.wait(timeout=20) == 143
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=30)
