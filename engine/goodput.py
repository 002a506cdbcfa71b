"""Goodput: where a run's wall time went, so that a user sees how much of it trained.

A `GoodputClock` starts when the run starts (the Trainer's creation, or an earlier
origin the command line gives it: the process's start) and books the time of each
phase the outer loop runs: `train` (steady training calls), `compile` (calls that
traced a compiled function: tracing, graph building, XLA compilation and the steps
that first call ran), `eval`, `checkpoint` (the loop blocked saving), `restore`.
Phases may nest (a save inside an evaluation): a phase's time excludes the phases
inside it, so no second is booked twice and the parts never sum past the total.
`startup` is what passed from the origin to the first training call, less the
phases booked before it (the restore). `fraction` = train / total.

A training call that traced also ran its steps, which trained the model as a steady call's
do: where the run has steady training calls too, those steps are booked to `train` at the
steady calls' time per step, and only the rest of that call to `compile` (with a loop of
100 one-second steps, the first call's 100 s are training, not compilation). A run of one
call has no steady time to go by: its whole call stays `compile`.

Also here: training TFLOP/s and model FLOPs utilisation (MFU) from examples/s, for
a model whose FLOPs per example are known.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

PHASES = ("train", "compile", "eval", "checkpoint", "restore")
# The keys of `GoodputClock.figures()`, in the order the breakdown line and the table show them.
FIGURES = ("total_s", "startup_s", "compile_s", "train_s", "eval_s", "checkpoint_s", "restore_s", "fraction")
SCALAR_PREFIX = "goodput/"
# Set by `engine.launch --max_restarts` in the tasks of a restarted cluster: the restarts so far and
# the wall time they lost (each failed cluster's whole time, from its start to its successor's).
RESTARTS_ENV = "ENGINE_RESTARTS"
RESTARTS_LOST_ENV = "ENGINE_RESTARTS_LOST_S"


@dataclass
class Span:
    """One running phase; `phase` may be changed before it ends (a call found to have traced)."""

    phase: str
    began: float
    inner: float = 0.0  # Seconds of the phases that ran inside this one.
    steps: int = 0  # Training steps the block ran (a training call's caller sets it).


class GoodputClock:
    """Books wall time by phase (exclusive of nested phases); see the module docstring.

    Args:
      origin: `time.time()` of the run's start; default: now.
    """

    def __init__(self, origin: float | None = None):
        now = time.time()
        self._origin = now if origin is None else min(origin, now)
        self._seconds = dict.fromkeys(PHASES, 0.0)
        self._stack: list[Span] = []
        self._first_train_at: float | None = None  # time.time() of the first training call
        self._booked_before_first_train = 0.0
        self._steps = {"train": 0, "compile": 0}  # Steps run by steady training calls, by tracing ones.

    def start_from(self, origin: float) -> None:
        """Moves the origin earlier (e.g. to the process's start); a later one is ignored."""
        self._origin = min(self._origin, origin)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[Span]:
        """Books the block's wall time to `name` (or to the `phase` the block sets on the span)."""
        if name == "train" and self._first_train_at is None:
            self._first_train_at = time.time()
            self._booked_before_first_train = sum(self._seconds.values()) + sum(s.inner for s in self._stack)
        span = Span(name, time.perf_counter())
        self._stack.append(span)
        try:
            yield span
        finally:
            elapsed = time.perf_counter() - span.began
            self._stack.pop()
            if span.phase not in self._seconds:
                raise ValueError(f"unknown goodput phase {span.phase!r}; one of {', '.join(PHASES)}")
            self._seconds[span.phase] += max(elapsed - span.inner, 0.0)
            if span.steps and span.phase in self._steps:
                self._steps[span.phase] += span.steps
            if self._stack:
                self._stack[-1].inner += elapsed

    @contextlib.contextmanager
    def call(self, function: Any, phase: str) -> Iterator[Span]:
        """Books a call of the tf.function `function` to `phase`, or to `compile` where the call
        traced it (its tracing count went up): the first call of each trace, measured apart. A
        training call's caller sets the span's `steps` (see the module docstring)."""
        before = tracing_count(function)
        with self.phase(phase) as span:
            yield span
            if tracing_count(function) != before:
                span.phase = "compile"

    def seconds(self, phase: str) -> float:
        return self._seconds[phase]

    def current(self) -> tuple[str, float] | None:
        """The innermost phase under way and its seconds so far, or None between phases. Safe to
        call from another thread (a diagnostics report): it only reads the stack's last entry."""
        stack = list(self._stack)
        if not stack:
            return None
        return stack[-1].phase, time.perf_counter() - stack[-1].began

    def figures(self, now: float | None = None) -> dict[str, float]:
        """`{total_s, startup_s, compile_s, train_s, eval_s, checkpoint_s, restore_s, fraction}` so far."""
        now = time.time() if now is None else now
        total = max(now - self._origin, 0.0)
        first = self._first_train_at if self._first_train_at is not None else now
        startup = max(first - self._origin - self._booked_before_first_train, 0.0)
        booked = {f"{name}_s": seconds for name, seconds in self._seconds.items()}
        trained = self._steps_trained_while_compiling()
        booked["compile_s"] -= trained
        booked["train_s"] += trained
        parts = startup + sum(booked.values())
        total = max(total, parts)  # Clock granularity: the parts never exceed the total.
        figures = {"total_s": total, "startup_s": startup, **booked}
        figures["fraction"] = booked["train_s"] / total if total > 0 else 0.0
        return {name: figures[name] for name in FIGURES}

    def _steps_trained_while_compiling(self) -> float:
        """The tracing calls' steps at the steady calls' seconds per step (none without steady calls)."""
        if not self._steps["compile"] or not self._steps["train"]:
            return 0.0
        per_step = self._seconds["train"] / self._steps["train"]
        return min(self._steps["compile"] * per_step, self._seconds["compile"])


def process_start_time() -> float:
    """`time.time()` at which this process started (Linux: its age from /proc); elsewhere this
    module's import, which an engine process reaches within its first seconds."""
    try:
        with open("/proc/self/stat") as stat_file:
            ticks = int(stat_file.read().rsplit(")", 1)[1].split()[19])  # Field 22: starttime.
        with open("/proc/uptime") as uptime_file:
            uptime = float(uptime_file.read().split()[0])
        age = uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT
    return min(time.time() - max(age, 0.0), _IMPORTED_AT)


_IMPORTED_AT = time.time()


def restarts_from_environment() -> dict[str, float]:
    """`{"restarts", "restarts_lost_s"}` as `engine.launch` set them; {} in a run never restarted."""
    try:
        restarts = int(os.environ.get(RESTARTS_ENV, "0"))
        lost = float(os.environ.get(RESTARTS_LOST_ENV, "0"))
    except ValueError:
        return {}
    return {"restarts": restarts, "restarts_lost_s": lost} if restarts > 0 else {}


def tracing_count(function: Any) -> int | None:
    """How often a tf.function traced; None for a plain callable (its calls never count as compile)."""
    count = getattr(function, "experimental_get_tracing_count", None)
    return count() if callable(count) else None


def breakdown_line(figures: Mapping[str, float]) -> str:
    """`goodput 0.93: train 41.2 s, compile 1.8 s, eval 0.9 s, checkpoint 0.4 s, restore 0 s,
    startup 0.6 s of 44.9 s` (and the restarts' lost time, where there were any)."""
    parts = ", ".join(
        f"{name} {_seconds(figures[f'{name}_s'])}"
        for name in ("train", "compile", "eval", "checkpoint", "restore", "startup")
    )
    line = f"goodput {figures['fraction']:.2f}: {parts} of {_seconds(figures['total_s'])}"
    if figures.get("restarts"):
        lost = _seconds(figures.get("restarts_lost_s", 0.0))
        line += f"; {int(figures['restarts'])} restart(s) lost {lost} before"
    return line


def _seconds(value: float) -> str:
    return "0 s" if value < 0.05 else f"{value:.1f} s"


def scalars(figures: Mapping[str, float]) -> dict[str, float]:
    """The figures as TensorBoard scalars: `goodput/fraction`, `goodput/train_s`, ..."""
    return {SCALAR_PREFIX + name: float(value) for name, value in figures.items()}


@dataclass(frozen=True)
class ModelFlops:
    """Training FLOPs per example (3x the forward pass: forward + two backward matmuls) and
    the peak the achieved rate is judged against; either may be unknown (None)."""

    train_flops_per_example: int | None = None
    peak_tflops: float | None = None

    @classmethod
    def from_forward(cls, forward_flops_per_example: int | None, peak_tflops: float | None) -> ModelFlops:
        train = 3 * forward_flops_per_example if forward_flops_per_example else None
        return cls(train, peak_tflops if peak_tflops and peak_tflops > 0 else None)

    def rates(self, examples_per_second: float) -> dict[str, float]:
        """`{"tflops": achieved TFLOP/s, "mfu": achieved / peak}`: each only where it is known."""
        if not self.train_flops_per_example:
            return {}
        achieved = self.train_flops_per_example * examples_per_second / 1e12
        rates = {"tflops": achieved}
        if self.peak_tflops:
            rates["mfu"] = achieved / self.peak_tflops
        return rates


class TimedFunction:
    """A tf.function whose every call is booked on a clock (`GoodputClock.call`): a call that
    traced as compile, the others as `phase`. Anything else is the function's own."""

    def __init__(self, function: Any, clock: GoodputClock, phase: str):
        self._function = function
        self._clock = clock
        self._phase = phase

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._clock.call(self._function, self._phase):
            return self._function(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._function, name)
