"""What a process is doing, on request: every thread's Python stack and the trainer's progress,
written where a user looks while the run goes on.

`kill -USR1 <pid>` of `python -m engine.main` (or of each task of a cluster) writes
`<model_dir>/diagnostics/<task>.txt`: the last completed step, what the trainer was doing
and since when, and the stack of every thread. The signal is taken by the signal watcher's
own thread (`engine.cli.process.preemption`), so a main thread that sits in a compiled call,
an input pipeline or a collective is shown where it sits. The stacks are `faulthandler`'s:
it reads them without running the threads' code and bounds each stack (100 frames); the
whole report is bounded too (`MAX_BYTES`). Nothing here reads a TensorFlow variable: a
report must come even when a peer or a parameter server that holds one has stopped answering.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import tempfile
import threading
from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from engine.model_dir import write_atomically

MAX_BYTES = 256 * 1024  # Dozens of threads' stacks fit; a report never grows a model_dir by much.
DIAGNOSTICS_DIR = "diagnostics"


def task_name(task_type: str | None, task_index: int | None) -> str:
    """`worker-1` for a task of a cluster, `main` for a process of its own: the report's file
    is `<task>.txt`."""
    return f"{task_type}-{task_index}" if task_type else "main"


def report(progress: Mapping[str, Any], *, task: str) -> str:
    """The report of `task`: a header with `progress` (e.g. the last completed step), the threads'
    names, then every thread's stack, most recent call first; cut to `MAX_BYTES`."""
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    lines = [f"engine diagnostics of {task}, pid {os.getpid()}, {now}"]
    lines += [f"{name}: {value}" for name, value in progress.items()]
    lines.append("threads: " + ", ".join(f"{thread.name} ({thread.ident:#x})" for thread in _threads()))
    text = "\n".join(lines) + "\n\n" + _stacks()
    if len(text.encode()) > MAX_BYTES:
        kept = text.encode()[: MAX_BYTES - 100].decode(errors="ignore")
        text = f"{kept}\n... cut at {MAX_BYTES} bytes\n"
    return text


def write_report(directory: str, task: str, text: str) -> str:
    """Writes `text` to `directory/<task>.txt` atomically, on any file system the model_dir may
    be on (a reader never sees half a report; a second request replaces the first); returns
    the path. A `directory` that is a symbolic link (a model_dir from someone else) is refused:
    the report would land wherever it points."""
    if os.path.islink(directory):
        raise OSError(f"{directory} is a symbolic link; remove it to get reports there")
    tf.io.gfile.makedirs(directory)
    path = os.path.join(directory, f"{task}.txt")
    write_atomically(path, text)
    return path


def _threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.ident is not None]


def _stacks() -> str:
    """Every thread's stack as faulthandler writes it (it needs a file descriptor)."""
    with tempfile.TemporaryFile("w+") as dumped:
        faulthandler.dump_traceback(dumped, all_threads=True)
        dumped.seek(0)
        return dumped.read()
