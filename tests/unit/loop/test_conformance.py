"""The engine against Keras, model form by model form, on one and two replicas (issue 28).

Every form of tests/conformance_forms.py (dense and conv, every layer that draws random
numbers, batch and layer normalization, masked sequences into LSTM, GRU and attention,
several inputs and outputs as lists and dicts with per-output losses and weights, shared
layers, a keras.applications model, a custom metric) is trained by the engine and by Keras
`fit` from the same weights on the same batches, and compared:

- training: every weight after TRAIN_STEPS steps (fewer where a form says why), and the loss
  and metrics fit reports;
- evaluation: loss, metrics and the exact example count against `evaluate` of the engine's
  weights on one batch holding the whole eval set (the mean over all its real elements);
  the eval set ends with a batch of one example, which leaves replica 1 empty;
- prediction: every row of every output, in order, against `predict`;
- accumulation: two micro-batches a step train as one large batch;
- resume: a run stopped half-way and resumed in a new process ends bitwise where the
  uninterrupted run ends.

The fast tier (-m "not slow") keeps the one-replica cases of training, evaluation and
prediction; the rest train for seconds more and run in the full suite.

Where Keras is not the same across replicas and the engine is, the form says why and the
engine is compared with fit on one replica (`Form.fit_replicas`); BatchNormalization's
moving statistics, which each of fit's replicas keeps for itself, are compared with the
mean of fit's replica copies, which is what the engine keeps (`engine.loop.replica_state`).
Tolerances: 1e-5 relative (and 1e-6 absolute, for values near 0) unless a form says why.

Covers: engine/loop/steps.py, engine/loop/replica_state.py.
"""

from __future__ import annotations

import functools
import gc
import subprocess
import sys

import conformance_forms as forms
import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import COMMAND_START, REPO, make_trainer, python_env

import engine

RTOL, ATOL = 1e-5, 1e-6
REPLICAS = (1, 2)


def strategy_of(replicas: int) -> tf.distribute.Strategy:
    return engine.build_strategy("mirrored" if replicas > 1 else "default", cpu_devices=2)


def as_tuples(structure):
    """Lists as tuples: tf.data stacks a list of arrays into one tensor, a tuple stays several."""
    if isinstance(structure, list):
        return tuple(as_tuples(item) for item in structure)
    if isinstance(structure, dict):
        return {key: as_tuples(value) for key, value in structure.items()}
    return structure


def batches(arrays: tuple, batch: int) -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices(as_tuples(arrays)).batch(batch)


def train_batches(form: forms.Form) -> tf.data.Dataset:
    """The training batches, all full: a static batch size. (On two replicas an Embedding model's
    batches that may be partial run the last one in a call of its own, engine.loop.variable_length,
    and the logs compared with fit's epoch are then the last call's.)"""
    arrays = as_tuples(train_arrays(form))
    return tf.data.Dataset.from_tensor_slices(arrays).batch(forms.GLOBAL_BATCH, drop_remainder=True)


def train_arrays(form: forms.Form) -> tuple:
    return form.data(forms.GLOBAL_BATCH * form.train_steps, forms.SEED)


def eval_arrays(form: forms.Form) -> tuple:
    return form.data(forms.NUM_EVAL, forms.SEED + 100)


def replica_mean(variable) -> np.ndarray:
    """A variable's value, as the mean of its replica copies (equal where they are in sync)."""
    inner = variable.value if isinstance(variable, keras.Variable) else variable
    copies = tf.distribute.get_strategy().experimental_local_results(inner)
    if isinstance(inner, tf.distribute.DistributedValues):
        copies = inner.values
    return np.mean([np.asarray(copy) for copy in copies], axis=0)


def compile_like(model: keras.Model, form: forms.Form) -> None:
    model.compile(
        optimizer=form.make_optimizer(),
        loss=form.loss(),
        loss_weights=form.loss_weights,
        metrics=form.metrics() or None,
        weighted_metrics=form.weighted_metrics() or None,
    )


@functools.cache
def keras_fit(name: str, replicas: int) -> tuple[list[np.ndarray], dict[str, float]]:
    """The weights and the reported logs of Keras fit over the form's training batches."""
    form = forms.BY_NAME[name]
    strategy = strategy_of(replicas)
    with strategy.scope():
        model = form.model()
        compile_like(model, form)
    history = model.fit(train_batches(form), epochs=1, verbose=0, shuffle=False)
    return [replica_mean(w) for w in model.weights], {k: v[-1] for k, v in history.history.items()}


@functools.cache
def engine_run(name: str, replicas: int, grad_accum_steps: int = 1) -> tuple[engine.Trainer, dict[str, float]]:
    form = forms.BY_NAME[name]
    strategy = strategy_of(replicas)
    with strategy.scope():
        model = form.model()
        optimizer = form.make_optimizer()
    trainer = make_trainer(
        strategy,
        model=model,
        optimizer=optimizer,
        train_data=train_batches(form),
        eval_data=batches(eval_arrays(form), forms.GLOBAL_BATCH),
        global_batch_size=forms.GLOBAL_BATCH,
        loss_fn=form.engine_loss(),
        loss_weights=form.loss_weights,
        metrics=form.metrics(),
        weighted_metrics=form.weighted_metrics(),
        cadence=engine.Cadence(steps_per_loop=form.train_steps),
        step=engine.StepOptions(grad_accum_steps=grad_accum_steps),
    )
    logs = trainer.train(form.train_steps)
    return trainer, logs


@functools.cache
def keras_clone(name: str) -> keras.Model:
    """The form's Keras model on one replica, compiled: one per form (its evaluate and predict
    functions traced once), given the weights to check before each use."""
    form = forms.BY_NAME[name]
    with engine.build_strategy("default").scope():
        model = form.model()
        compile_like(model, form)
    return model


def keras_reference(name: str, replicas: int) -> keras.Model:
    """A Keras model on one replica holding the engine's trained weights: what evaluate and
    predict of those weights give."""
    trainer, _ = engine_run(name, replicas)
    model = keras_clone(name)
    model.set_weights([replica_mean(w) for w in trainer.model.weights])
    return model


@pytest.fixture(scope="module", autouse=True)
def _cached_runs_frozen_after_the_module():
    """The cached runs hold every form's models and traced graphs (over a million objects) for the
    rest of the worker: frozen after the module, they are no longer walked by each of its later
    full collections. (Freeing them costs more: the worker ends without finalization.)"""
    yield
    gc.freeze()


def params(*, accumulating: bool = False):
    """Every form on one and two replicas. The fast tier keeps training, evaluation and
    prediction on one replica; two replicas, accumulation and the forms marked slow (a
    keras.applications model) are in the full suite, which CI runs."""
    cases = []
    for form in forms.FORMS:
        if accumulating and not form.accumulates:
            continue  # Cannot hold by nature: the form's note says why.
        for replicas in REPLICAS:
            marks = [pytest.mark.slow] if form.slow or replicas > 1 or accumulating else []
            cases.append(pytest.param(form.name, replicas, id=f"{form.name}-{replicas}", marks=marks))
    return cases


def assert_close(actual, expected, what: str) -> None:
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=ATOL, err_msg=what)


@pytest.mark.parametrize("name, replicas", params())
def test_training_equals_fit(name, replicas):
    form = forms.BY_NAME[name]
    fit_weights, fit_logs = keras_fit(name, form.fit_replicas or replicas)
    trainer, logs = engine_run(name, replicas)
    weights = [replica_mean(w) for w in trainer.model.weights]
    assert len(weights) == len(fit_weights)
    for variable, actual, expected in zip(trainer.model.weights, weights, fit_weights, strict=True):
        assert_close(actual, expected, variable.path)
    reported = {key: value for key, value in fit_logs.items() if key in logs}
    assert "loss" in reported and set(reported) >= {m.name for m in trainer.train_metrics}
    for key, value in reported.items():
        assert_close(logs[key], value, key)


@pytest.mark.parametrize("name, replicas", params())
def test_evaluation_equals_evaluate_with_exact_counts(name, replicas):
    form = forms.BY_NAME[name]
    trainer, _ = engine_run(name, replicas)
    results = trainer.evaluate()
    assert results["num_examples"] == forms.NUM_EVAL
    x, y, *weights = as_tuples(eval_arrays(form))
    expected = keras_reference(name, replicas).evaluate(
        x,
        y,
        sample_weight=weights[0] if weights else None,
        batch_size=forms.NUM_EVAL,
        verbose=0,
        return_dict=True,
    )
    compared = [key for key in expected if key in results]
    assert "loss" in compared and set(compared) >= {m.name for m in trainer.eval_metrics}
    for key in compared:
        assert_close(results[key], expected[key], key)


@pytest.mark.parametrize("name, replicas", params())
def test_predict_returns_every_row_of_every_output_in_order(name, replicas):
    form = forms.BY_NAME[name]
    trainer, _ = engine_run(name, replicas)
    x = as_tuples(eval_arrays(form)[0])
    predicted = trainer.predict(x)
    expected = keras_reference(name, replicas).predict(x, batch_size=forms.GLOBAL_BATCH, verbose=0)
    tf.nest.assert_same_structure(as_tuples(expected), as_tuples(predicted))
    for actual, reference in zip(tf.nest.flatten(predicted), tf.nest.flatten(expected), strict=True):
        assert actual.shape == reference.shape and len(actual) == forms.NUM_EVAL
        assert_close(actual, reference, "predictions")


@pytest.mark.parametrize("name, replicas", params(accumulating=True))
def test_accumulating_two_micro_batches_equals_one_batch(name, replicas):
    whole, whole_logs = engine_run(name, replicas)
    accumulated, logs = engine_run(name, replicas, grad_accum_steps=2)
    for one_batch, two_parts in zip(whole.model.weights, accumulated.model.weights, strict=True):
        assert_close(replica_mean(two_parts), replica_mean(one_batch), one_batch.path)
    assert_close(logs["loss"], whole_logs["loss"], "loss")


# conformance_forms.py's `main`, in a process that starts as the engine's commands do.
RESUME = f"""
import sys
sys.path.insert(0, {str(REPO / "tests")!r})
import conformance_forms
conformance_forms.main(sys.argv[1:])
"""


@pytest.mark.slow
@pytest.mark.process
def test_a_run_resumed_in_a_new_process_ends_bitwise_where_the_uninterrupted_run_ends(tmp_path):
    """Forms whose state a resume must carry (conformance_forms.RESUMED): every variable,
    random state included, on two replicas, checkpointed at step 2 in this process and resumed
    in a new one, against the uninterrupted run with the same loops (in this process)."""
    forms.train_half(str(tmp_path), strategy_of(2))
    done = subprocess.run(
        [sys.executable, "-c", COMMAND_START + RESUME, "resume", str(tmp_path)],
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for name in forms.RESUMED:
        whole, resumed = np.load(tmp_path / f"{name}.whole.npz"), np.load(tmp_path / f"{name}.resumed.npz")
        assert len(whole.files) == len(resumed.files) > 0
        for key in whole.files:
            np.testing.assert_array_equal(resumed[key], whole[key], err_msg=f"{name} {key}")
