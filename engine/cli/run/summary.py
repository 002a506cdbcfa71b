"""The summary table that ends a run of `engine.main` (train, train_and_eval, eval,
continuous_eval): the final train and eval metrics, the best checkpoint, the steady
throughput, the step, and where everything was written. Its figures are metrics.json's,
in the progress lines' form (`format_logs`), so that the screen and the file agree.

    summary
                     train       eval
      loss           0.0636      0.0811
      ...
      step           500
      throughput     7,214 examples/s
      goodput        0.93: train 41.2 s, compile 1.8 s, eval 0.9 s, ... of 44.9 s
      model_dir      runs/digits

TFLOP/s (and MFU) follow the throughput where the progress lines show them: on an
accelerator, or where `--peak_tflops` gives an MFU. On a terminal a long value goes on
under its column; into a file or a pipe a row is one line.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import Any

from engine import model_dir as model_dir_lib
from engine.callbacks.progress import format_logs, on_accelerator
from engine.cli.config.settings import RunConfig
from engine.cli.config.settings.sections import DecisionSettings
from engine.cli.run.run_record import read_record, record_path
from engine.errors import printable
from engine.goodput import breakdown_line
from engine.hooks.best_checkpoint import BEST_FILE, BEST_SUBDIR
from engine.logger import message_width, wrap_line

# Train logs that are rates of the last loop, not figures of the run: the steady throughput replaces them.
_LOOP_RATES = ("steps_per_second", "examples_per_second", "tflops", "mfu")
# Modes that end with a summary table (predict prints its own line).
SUMMARY_MODES = ("train", "train_and_eval", "eval", "continuous_eval")
_COLUMN = 12


def summary_table(config: RunConfig, result: Mapping[str, Any]) -> str | None:
    """The table that ends a run: its metrics (train and eval columns), the best checkpoint,
    throughput, the step, and where everything was written. The figures are metrics.json's,
    in the progress lines' form. None for a run that has none (predict, stopped by a signal)."""
    if config.mode not in SUMMARY_MODES or "exit_status" in result or result.get("global_step") is None:
        return None
    # Where the model_dir is now (the flag): a copied one's metrics.json names where it was written.
    model_dir = config.model_dir or result.get("model_dir")
    evaluating = config.mode in ("eval", "continuous_eval")
    record: Mapping[str, Any] = result if evaluating or not model_dir else read_record(model_dir) or result
    train = {} if evaluating else {k: v for k, v in (record.get("train") or {}).items() if k not in _LOOP_RATES}
    evaluation = (result if evaluating else record).get("eval") or {}
    columns = {name: logs for name, logs in (("train", train), ("eval", evaluation)) if logs}
    rows: list[tuple[str, str]] = []
    if columns:
        rows.append(("", _columns(list(columns))))
        for metric in dict.fromkeys(name for logs in columns.values() for name in logs):
            rows.append((metric, _columns([_figure(logs.get(metric)) for logs in columns.values()])))
    rows.append(("step", str(record.get("global_step"))))
    speed = record.get("examples_per_second")
    if speed and not evaluating:
        flops = _model_flops(record.get("train") or {}, speed)
        rows.append(("throughput", f"{_figure(speed)} examples/s{flops}"))
    goodput = record.get("goodput")
    if isinstance(goodput, Mapping) and not evaluating:
        with contextlib.suppress(KeyError, TypeError, ValueError):  # A record an older engine wrote.
            rows.append(("goodput", breakdown_line(goodput).removeprefix("goodput ")))
    best = _best_checkpoint(config.decisions, model_dir)
    if best is not None:
        rows.append(("best checkpoint", best))
    if model_dir:
        rows.append(("model_dir", model_dir))
        rows.append(("metrics.json", record_path(model_dir)))
    if config.export_dir and not evaluating:
        rows.append(("export_dir", config.export_dir))
    if model_dir:
        rows.append(("TensorBoard", f"tensorboard --logdir {model_dir}"))
    # Metric names and figures are metrics.json's and best.json's: text of a model_dir, printed escaped.
    rows = [(printable(name), printable(value)) for name, value in rows]
    return "\n".join(["summary", *_table_lines(rows, message_width())])


def _table_lines(rows: list[tuple[str, str]], width: int | None) -> list[str]:
    """`  name  value` a row, the values in one column; on a terminal (`width`), a long value goes
    on under its column, broken between its fields."""
    column = max(len(name) for name, _ in rows) + 4
    lines = []
    for name, value in rows:
        if width is not None:
            value = wrap_line(value, max(width - column, 20), indent="").replace("\n", "\n" + " " * column)
        lines.append(f"  {name:<{column - 4}}  {value}".rstrip())
    return lines


def _model_flops(train: Mapping[str, Any], speed: float) -> str:
    """`, 0.0827 TFLOP/s, MFU 0.0414` at the steady rate `speed` (the last loop's logs give the
    FLOPs per example: tflops / examples_per_second); '' where the model's FLOPs are unknown, and
    on a CPU unless a peak was given (an MFU): as the progress lines (`engine.callbacks.progress`)."""
    tflops, rate = train.get("tflops"), train.get("examples_per_second")
    if not tflops or not rate or not (train.get("mfu") or on_accelerator(None)):
        return ""
    achieved = tflops / rate * speed
    text = f", {_figure(achieved)} TFLOP/s"
    if train.get("mfu"):
        text += f", MFU {_figure(train['mfu'] / tflops * achieved)}"
    return text


def _columns(cells: list[str]) -> str:
    return "".join(f"{cell:<{_COLUMN}}" for cell in cells).rstrip()


def _figure(value: Any) -> str:
    """A number as the progress lines show it (`format_logs`); '-' for none."""
    if value is None:
        return "-"
    return format_logs({"": value})[1:]


def _best_checkpoint(decisions: DecisionSettings, model_dir: str | None) -> str | None:
    """--best_checkpoint_metric: `accuracy=0.9764 at step 400: <model_dir>/best/ckpt-400` (best/best.json)."""
    if not decisions.best_checkpoint_metric or not model_dir:
        return None
    best = model_dir_lib.read_json(os.path.join(model_dir, BEST_SUBDIR, BEST_FILE), what="the best checkpoint")
    if not isinstance(best, dict) or "checkpoint" not in best:
        return "none yet"
    where = os.path.join(model_dir, BEST_SUBDIR, str(best["checkpoint"]))
    return f"{best.get('metric')}={_figure(best.get('value'))} at step {best.get('step')}: {where}"
