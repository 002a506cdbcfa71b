"""`<model_dir>/metrics.json`: the run's record, which no mode's write may shorten.

Training writes its final figures (`global_step`, `train`, `eval`,
`examples_per_second`, `rollbacks` with `--on_nonfinite=rollback`); every
evaluation a mode records (the one at the end of training, `--mode=eval`,
a continuous evaluator's) is appended to
`evaluations` as `{"step", "mode", "eval"}`. The top-level `eval` is the
newest evaluation of the checkpoint at `global_step`. Each write reads the
record first and keeps what it does not replace, so `--mode=eval` after
training keeps the training figures, and training after `--mode=eval`
keeps that evaluation.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from engine import model_dir as model_dir_lib
from engine.errors import UserError

METRICS_FILE = "metrics.json"


def record_path(model_dir: str) -> str:
    return os.path.join(model_dir, METRICS_FILE)


def read_record(model_dir: str) -> dict[str, Any]:
    """The record so far ({} when there is none)."""
    path = record_path(model_dir)
    record = model_dir_lib.read_json(path, what="the results of the run")
    if record is None:
        return {}
    if not isinstance(record, dict):
        raise UserError(f"{path} is damaged (not a JSON object); move it away, the run writes its results there")
    return record


def _evaluation(step: int, mode: str, logs: Mapping[str, float]) -> dict[str, Any]:
    return {"step": step, "mode": mode, "eval": dict(logs)}


def record_training(model_dir: str, result: Mapping[str, Any], *, mode: str) -> dict[str, Any]:
    """Writes training's final `result` over the record's training figures; its final
    evaluation (if any) joins the evaluations recorded before. Returns what was written."""
    previous = read_record(model_dir)
    evaluations = list(previous.get("evaluations", []))
    if result.get("eval"):
        evaluations.append(_evaluation(result["global_step"], mode, result["eval"]))
    record = {**result, "evaluations": evaluations}
    model_dir_lib.write_json(record_path(model_dir), record)
    return record


def record_evaluations(
    model_dir: str, evaluations: Sequence[tuple[int, Mapping[str, float]]], *, mode: str
) -> dict[str, Any]:
    """Appends evaluations `[(step, logs)]` of `mode`; the newest of the checkpoint at the
    record's `global_step` becomes its `eval` (a record without training figures takes the
    last evaluation's step as its `global_step`). Returns what was written."""
    record = read_record(model_dir)
    if not evaluations:
        return record
    if "global_step" not in record:
        record.update({"global_step": evaluations[-1][0], "model_dir": model_dir})
    record["evaluations"] = [
        *record.get("evaluations", []),
        *(_evaluation(step, mode, logs) for step, logs in evaluations),
    ]
    for step, logs in evaluations:
        if step == record["global_step"]:
            record["eval"] = dict(logs)
    model_dir_lib.write_json(record_path(model_dir), record)
    return record
