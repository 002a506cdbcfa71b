"""The train loop's running state (`engine.loop.compiled.LoopState`): what it adds up from step
to step and what the loop reports from it, checked against the same sums done in numpy.

Covers: engine/loop/compiled.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from engine.loop.compiled import LoopState, _accumulate, _empty_state, _loop_outputs
from engine.loop.steps import STEP_EXAMPLES

NAMES = ["loss", STEP_EXAMPLES, "accuracy"]
# Three steps: a full batch, one whose loss passed max_loss (not finite for the loop), a partial one.
STEPS = [
    ({"loss": 2.0, STEP_EXAMPLES: 8.0, "accuracy": 0.5}, True),
    ({"loss": 50.0, STEP_EXAMPLES: 8.0, "accuracy": 0.25}, False),
    ({"loss": 1.0, STEP_EXAMPLES: 2.0, "accuracy": 1.0}, True),
]


def run_state(keep_last: bool, names: list[str] = NAMES) -> tuple[LoopState, dict]:
    state = _empty_state()
    for index, (values, finite) in enumerate(STEPS):
        outputs = {name: tf.constant(values[name]) for name in names}
        state = _accumulate(state, tf.constant(index), names, outputs, tf.constant(finite), keep_last)
    return state, _loop_outputs(state, names, tf.constant(len(STEPS)), keep_last)


def test_the_state_counts_finite_steps_and_remembers_the_first_other_one():
    state, outputs = run_state(keep_last=False)
    assert isinstance(state, LoopState)
    assert float(state.finite_steps) == 2.0
    assert int(state.nonfinite_steps) == int(outputs["nonfinite_steps"]) == 1
    assert int(state.first_nonfinite_index) == int(outputs["first_nonfinite_index"]) == 1
    assert float(state.first_nonfinite_loss) == float(outputs["first_nonfinite_loss"]) == 50.0
    good = [values for values, finite in STEPS if finite]
    # The loss weighted by each step's examples (a partial batch weighs what it holds), the rest plain means.
    losses, examples = np.array([v["loss"] for v in good]), np.array([v[STEP_EXAMPLES] for v in good])
    expected_loss = float(np.sum(losses * examples) / np.sum(examples))
    assert float(outputs["logs"]["loss"]) == pytest.approx(expected_loss, rel=1e-6)
    assert float(outputs["logs"]["accuracy"]) == pytest.approx(np.mean([v["accuracy"] for v in good]), rel=1e-6)


def test_keep_last_reports_the_last_finite_steps_outputs_as_they_are():
    # As a Keras model's own train_step reports: its running loss and metrics, no example count.
    state, outputs = run_state(keep_last=True, names=["loss", "accuracy"])
    last = {name: STEPS[-1][0][name] for name in ("loss", "accuracy")}
    assert {name: float(value) for name, value in outputs["logs"].items()} == pytest.approx(last)
    assert int(state.nonfinite_steps) == 1


def test_a_loop_with_no_finite_step_reports_zeros_not_nan():
    state = _empty_state()
    outputs = {"loss": tf.constant(float("nan")), STEP_EXAMPLES: tf.constant(8.0)}
    state = _accumulate(state, tf.constant(0), ["loss", STEP_EXAMPLES], outputs, tf.constant(False))
    logs = _loop_outputs(state, ["loss", STEP_EXAMPLES], tf.constant(1))["logs"]
    assert float(logs["loss"]) == 0.0
    assert int(state.first_nonfinite_index) == 0
