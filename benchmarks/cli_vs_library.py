r"""The command line's steady examples/s against the library's (`engine.Trainer`) on the same
model and data, in one process, alternating.

    python -m benchmarks.cli_vs_library --repeats=5 [--model=cnn --dataset=digits] [--json=out.json]

A repeat runs each side once, which goes first alternating (cli, library | library, cli | ...),
so that drift of a shared machine hits both alike:

- `cli`: `python -m engine.main --mode=train ...` inside this process, as a test's
  `main_in_process` runs it: absl's flag parsing, `RunConfig`, the console, the job with the hooks
  the flags give, its checkpoints (`--checkpoint_every`), TensorBoard summaries, records and
  summary table, in a fresh model_dir each time. Its rate: metrics.json's `examples_per_second`.
- `library`: `engine.Trainer` over the same model, optimizer, data (kept on the devices, as the
  command line keeps them), loss and metrics, built by the command line's own builders
  (`engine.cli.run`), everything else the library's defaults: no model_dir, nothing written. Its
  rate: `Trainer.steady_examples_per_second`.

Two rates a side, both leaving out the first compiled loop (tracing and compiling):

- `steady`: the compiled loops alone, their results read back: what metrics.json reports, the
  acceptance figure (the command line within 3 % of the library).
- `wall`: from the end of the first loop to the end of the last (the times of the progress lines
  both sides log, one a loop), whatever runs between loops included: hooks, log lines, summaries,
  checkpoints. `per-loop ms` is what the command line adds to each loop on this clock,
  (1/cli - 1/library) x the examples of a loop.
- `cpu`: the same span on this process's CPU clock (every thread): examples per CPU second. On a
  machine shared with other work the wall clocks stretch with the other tenants' load; the CPU
  clock less so, so its per-loop ms is the steadier figure of what the command line adds.

The ratios are cli/library of the medians, and the median of each repeat's own ratio (the two
runs of a repeat are next to each other in time). `--strategy=mirrored` builds a new
MirroredStrategy every run in one process; where that fails here, run the default strategy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from engine.lean_imports import import_tensorflow_lean

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SIDES = ("cli", "library")
RATES = ("steady", "wall", "cpu")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The benchmark's own arguments (argparse: absl's FLAGS hold the engine's flags, parsed per run)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.cli_vs_library", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="Runs of each side, alternating which goes first."
    )
    parser.add_argument("--train_steps", type=int, default=1000, help="Global steps of every run.")
    parser.add_argument("--steps_per_loop", type=int, default=50, help="Steps per compiled loop.")
    parser.add_argument("--model", default="cnn", help="Model name (engine.main --model).")
    parser.add_argument("--dataset", default="digits", help="Data (engine.main --dataset).")
    parser.add_argument("--global_batch_size", type=int, default=64)
    parser.add_argument("--strategy", default="default", choices=("default", "one_device", "mirrored"))
    parser.add_argument("--cpu_devices", type=int, default=1)
    parser.add_argument(
        "--cli_flags", default="", help="More engine.main flags for the cli side, comma-separated."
    )
    parser.add_argument("--json", default=None, help="Also write every run and the summary here.")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.train_steps < 2 * args.steps_per_loop:
        parser.error(f"--repeats={args.repeats} must be >= 1 and --train_steps >= 2 loops of --steps_per_loop")
    return args


def common_flags(args: argparse.Namespace) -> list[str]:
    """What both sides are given: the model, data, batch, loop, steps and strategy."""
    return [
        f"--model={args.model}",
        f"--dataset={args.dataset}",
        f"--global_batch_size={args.global_batch_size}",
        f"--steps_per_loop={args.steps_per_loop}",
        f"--train_steps={args.train_steps}",
        f"--strategy={args.strategy}",
        f"--cpu_devices={args.cpu_devices}",
        "--mode=train",
    ]


class _LoopEnds(logging.Handler):
    """The step, time and this process's CPU time of every progress line the engine logs: the end
    of each compiled loop (the handler runs in the thread that logs, as the line is logged)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.ends: list[tuple[int, float]] = []
        self.cpu_ends: list[tuple[int, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("step ") and "/" in message.split()[1]:
            step = int(message.split()[1].split("/")[0])
            self.ends.append((step, record.created))
            self.cpu_ends.append((step, time.process_time()))


@contextlib.contextmanager
def loop_ends() -> Iterator[_LoopEnds]:
    handler = _LoopEnds()
    engine_logger = logging.getLogger("engine")
    engine_logger.addHandler(handler)
    try:
        yield handler
    finally:
        engine_logger.removeHandler(handler)


def wall_rate(ends: Sequence[tuple[int, float]], global_batch_size: int) -> float | None:
    """Examples/s from the end of the first loop to the end of the last; None below two loops."""
    if len(ends) < 2 or ends[-1][1] <= ends[0][1]:
        return None
    (first_step, first_time), (last_step, last_time) = ends[0], ends[-1]
    return (last_step - first_step) * global_batch_size / (last_time - first_time)


def run_cli(args: argparse.Namespace, scratch: str) -> dict[str, Any]:
    """One `engine.main` run in this process, in a fresh model_dir: its metrics.json rate and its wall rate."""
    from absl import flags

    from engine.cli import main_command

    model_dir = tempfile.mkdtemp(prefix="cli-", dir=scratch)
    extra = [flag for flag in args.cli_flags.split(",") if flag]
    with loop_ends() as loops:
        try:
            argv = main_command.parse_flags(
                ["engine.main", *common_flags(args), f"--model_dir={model_dir}", *extra]
            )
            code = main_command.main_with_clean_errors(argv)
        finally:
            flags.FLAGS.unparse_flags()
    if code != 0:
        raise RuntimeError(f"engine.main exited {code}")
    metrics = json.loads(Path(model_dir, "metrics.json").read_text())
    return {
        "steady": metrics["examples_per_second"],
        "wall": wall_rate(loops.ends, args.global_batch_size),
        "cpu": wall_rate(loops.cpu_ends, args.global_batch_size),
        "global_step": metrics["global_step"],
        "loss": metrics["train"].get("loss"),
    }


def run_library(args: argparse.Namespace) -> dict[str, Any]:
    """`engine.Trainer` on what the command line builds from the same flags, the library's defaults
    for the rest: its steady rate and its wall rate."""
    import engine
    from engine.cli.config.settings import RunConfig
    from engine.cli.run.assembly import build_model_and_optimizer, prepare_process
    from engine.cli.run.job import train_and_eval_data
    from engine.cli.run.run_task import resolve_task

    config = RunConfig(
        model=args.model,
        dataset=args.dataset,
        global_batch_size=args.global_batch_size,
        steps_per_loop=args.steps_per_loop,
        train_steps=args.train_steps,
        strategy=args.strategy,
        cpu_devices=args.cpu_devices,
        mode="train",
    )
    prepare_process(config.devices, config.numerics)  # The seeds and precision the command line sets.
    strategy = engine.build_strategy(config.strategy, cpu_devices=config.cpu_devices)
    task = resolve_task(config.problem)
    total_steps = config.total_steps(task.source.num_train_examples)
    model, optimizer = build_model_and_optimizer(config.optimization, strategy, task, total_steps)
    train_data, _ = train_and_eval_data(config, task.source)
    trainer = engine.Trainer(
        strategy=strategy,
        model=model,
        optimizer=optimizer,
        train_data=train_data,
        global_batch_size=config.global_batch_size,
        cadence=engine.Cadence(steps_per_loop=config.steps_per_loop),
        **task.trainer_arguments(model),
    )
    with loop_ends() as loops:
        logs = trainer.train(total_steps)
    trainer.close()
    return {
        "steady": trainer.steady_examples_per_second,
        "wall": wall_rate(loops.ends, args.global_batch_size),
        "cpu": wall_rate(loops.cpu_ends, args.global_batch_size),
        "global_step": trainer.step,
        "loss": logs.get("loss"),
    }


def order(repeat: int) -> tuple[str, ...]:
    """cli, library | library, cli | ...: which side goes first alternates."""
    return SIDES if repeat % 2 == 0 else SIDES[::-1]


def summarize(records: Sequence[dict[str, Any]], examples_per_loop: int) -> dict[str, Any]:
    """Each side's median rates; cli/library of the medians and the median of the repeats' own
    ratios; the milliseconds the command line adds to a loop (from the medians)."""
    summary: dict[str, Any] = {}
    for key in RATES:
        medians = {}
        for side in SIDES:
            rates = [r[key] for r in records if r["side"] == side and r.get(key)]
            medians[side] = statistics.median(rates) if rates else None
        cli, library = medians["cli"], medians["library"]
        pairs = []
        for repeat in sorted({r["repeat"] for r in records}):
            both = {r["side"]: r.get(key) for r in records if r["repeat"] == repeat}
            if both.get("cli") and both.get("library"):
                pairs.append(both["cli"] / both["library"])
        summary[key] = {
            **{f"{side}_median": medians[side] for side in SIDES},
            "ratio_of_medians": cli / library if cli and library else None,
            "median_pair_ratio": statistics.median(pairs) if pairs else None,
            "per_loop_ms": (examples_per_loop / cli - examples_per_loop / library) * 1000
            if cli and library
            else None,
        }
    return summary


def _figure(value: float | None, form: str) -> str:
    return "-" if value is None else format(value, form)


def format_table(records: Sequence[dict[str, Any]], summary: dict[str, Any]) -> str:
    rows = [("repeat", "side", "steady ex/s", "wall ex/s", "cpu ex/s", "global_step")]
    for record in records:
        rows.append(
            (
                str(record["repeat"]),
                record["side"],
                _figure(record.get("steady"), ",.0f"),
                _figure(record.get("wall"), ",.0f"),
                _figure(record.get("cpu"), ",.0f"),
                str(record.get("global_step")),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    for key in RATES:
        figures = summary[key]
        lines.append(
            f"{key}: median cli {_figure(figures['cli_median'], ',.0f')} library "
            f"{_figure(figures['library_median'], ',.0f')} ex/s; cli/library "
            f"{_figure(figures['ratio_of_medians'], '.3f')} (median of the repeats' ratios "
            f"{_figure(figures['median_pair_ratio'], '.3f')}); the cli adds "
            f"{_figure(figures['per_loop_ms'], '.2f')} ms a loop"
        )
    return "\n".join(lines)


def compare(args: argparse.Namespace) -> dict[str, Any]:
    records = []
    with tempfile.TemporaryDirectory(prefix="cli-vs-library-") as scratch:
        for repeat in range(args.repeats):
            for side in order(repeat):
                print(f"repeat {repeat + 1}/{args.repeats}: {side} ...", file=sys.stderr, flush=True)
                began = time.perf_counter()
                result = run_cli(args, scratch) if side == "cli" else run_library(args)
                result["seconds"] = time.perf_counter() - began
                records.append({"repeat": repeat + 1, "side": side, **result})
    summary = summarize(records, args.steps_per_loop * args.global_batch_size)
    return {"settings": vars(args), "runs": records, "summary": summary}


def _as_engine_main() -> None:
    """The log set-up `engine.main`'s process has (`main_command.run_cli`): absl's handler at INFO."""
    from absl import logging as absl_logging

    from engine.cli.config.flag_names import FlagTermsFilter
    from engine.cli.process import console

    absl_logging.use_absl_handler()
    absl_logging.set_verbosity(absl_logging.INFO)
    absl_logging.get_absl_handler().addFilter(FlagTermsFilter())
    absl_logging.get_absl_handler().addFilter(console.TensorFlowPerSaveLines())


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import_tensorflow_lean()
    _as_engine_main()
    result = compare(args)
    print(format_table(result["runs"], result["summary"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
