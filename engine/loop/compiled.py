"""The compiled functions: the only place that calls `strategy.run`.

The train function runs `num_steps` steps in a `tf.range` loop inside one
`tf.function`. `num_steps` is a tensor, so loops of different lengths (the
last one of a run, one cut short by an evaluation) reuse one trace, and the
per-call Python overhead is paid once per loop instead of once per step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import tensorflow as tf

from engine.compat import engine_graph_code, user_code
from engine.errors import UserError
from engine.loop.replica_state import average_over_replicas
from engine.loop.steps import STEP_EXAMPLES, STEP_FINITE, Batch, ReplicaStep
from engine.resident import ResidentData, ResidentEvalData
from engine.stragglers import InputClock

# loop(where the batches come from: an iterator, or resident tensors and a start step; num_steps).
TrainLoop = Callable[..., dict]


class BatchSizeMismatch(Exception):
    """Raised while tracing when a replica's batch has a static size other than expected."""

    def __init__(self, size: int):
        super().__init__(f"per-replica batch size {size}")
        self.size = size


EvalLoop = Callable[[tf.distribute.DistributedIterator, tf.Tensor], tf.Tensor]


@dataclass(frozen=True)
class LoopResult:
    """What one compiled train call did: the step outputs' means and, apart from them (a
    step output may take any name), the counts the outer loop decides on."""

    # Each step output's mean over the loop's finite steps (the loss's weighted by their examples),
    # or its last value (keep_last).
    logs: dict[str, float]
    steps_run: int  # Fewer than asked when the data ran out; 0: not one batch was left.
    nonfinite_steps: int
    first_nonfinite_index: int  # 0-based in this loop; -1: none.
    first_batch_size: int = -1  # The size that failed the first-batch check; -1: none did.
    first_nonfinite_loss: float = float("nan")  # The "loss" output of that step (NaN: none, or no "loss").

    @classmethod
    def from_outputs(cls, outputs: Mapping[str, Any]) -> LoopResult:
        """From what a compiled loop returned (tensors, or values fetched from a worker)."""
        return cls(
            logs={name: float(value) for name, value in outputs["logs"].items()},
            steps_run=int(outputs["steps_run"]),
            nonfinite_steps=int(outputs["nonfinite_steps"]),
            first_nonfinite_index=int(outputs["first_nonfinite_index"]),
            first_batch_size=int(outputs.get("first_batch_size", -1)),
            first_nonfinite_loss=(
                float(outputs["first_nonfinite_loss"])
                if "first_nonfinite_loss" in outputs
                and "loss" in outputs["logs"]
                and int(outputs["first_nonfinite_index"]) >= 0
                else float("nan")
            ),
        )


# Values of the first-batch check a train loop takes (see make_train_loop).
CHECK_NONE, CHECK_NOT_LARGER, CHECK_EXACT = 0, 1, 2


def _check_outputs(outputs: Mapping[str, tf.Tensor]) -> None:
    for name, value in outputs.items():
        shape = tf.convert_to_tensor(value).shape
        if shape.rank not in (None, 0) and shape.num_elements() != 1:
            raise UserError(
                f"step output {name!r} has shape {shape.as_list()}: a step returns scalars (e.g. tf.reduce_mean)"
            )


@engine_graph_code
def run_step(
    strategy: tf.distribute.Strategy,
    replica_fn: Callable[..., Mapping[str, tf.Tensor]],
    args: tuple,
    *,
    max_loss: float | None = None,
) -> tuple[dict[str, tf.Tensor], tf.Tensor]:
    """`replica_fn(*args)` on every replica; its outputs averaged over replicas in ONE
    all-reduce of their stacked values, and whether all of them (and the standard
    step's `STEP_FINITE` on every replica) are finite and the "loss" at most `max_loss`
    (a finite spike counts as a non-finite step)."""
    names: list[str] = []

    @engine_graph_code
    def stacked_step(*replica_args) -> tf.Tensor:
        outputs = dict(user_code(replica_fn)(*replica_args) or {})
        _check_outputs(outputs)
        if not names:  # Traced once per replica; every replica returns the same names.
            names.extend(outputs)
        values = [tf.cast(tf.reshape(outputs[name], []), tf.float32) for name in names]
        return tf.stack(values or [tf.constant(0.0)])

    per_replica = strategy.run(stacked_step, args=args)
    means = strategy.reduce(tf.distribute.ReduceOp.MEAN, per_replica, axis=None)
    reduced = dict(zip(names, tf.unstack(means, num=max(len(names), 1)), strict=False))
    finite = tf.reduce_all([tf.math.is_finite(v) for v in reduced.values()] or [True])
    step_finite = reduced.pop(STEP_FINITE, None)
    if step_finite is not None:  # 1.0 only where every replica reported 1.0.
        finite = tf.logical_and(finite, tf.equal(step_finite, 1.0))
    if max_loss is not None:
        if "loss" not in reduced:
            raise UserError(
                f"`max_loss={max_loss}` watches the step's 'loss' output, but the step returns "
                f"{sorted(reduced) or 'nothing'}; return {{'loss': ...}} from step_fn or drop `max_loss`"
            )
        finite = tf.logical_and(finite, reduced["loss"] <= max_loss)
    return reduced, finite


class LoopState(NamedTuple):
    """A train loop's running state, carried from step to step inside the compiled loop.

    The sums start empty and take the step's length at its first step, so that the step is
    traced once, inside the loop: a step peeled off the loop to learn its outputs would be
    traced, optimized and held twice.
    """

    sums: tf.Tensor  # The finite steps' outputs summed (keep_last: the last one's), in the order of `names`.
    finite_steps: tf.Tensor  # float32.
    nonfinite_steps: tf.Tensor  # int32.
    first_nonfinite_index: tf.Tensor  # 0-based in this loop; -1: none yet.
    first_nonfinite_loss: tf.Tensor  # That step's "loss" output; _NO_LOSS: none yet.


# The graph's placeholder for "no loss to report" (no non-finite step yet, or a step without a
# "loss" output): a finite 0, since --check_numerics fails on any NaN constant; LoopResult reads
# it as NaN where it means nothing.
_NO_LOSS = 0.0
# The shapes the state keeps across the loop's iterations (the sums are empty before the first step).
_SCALAR = tf.TensorShape([])
_STATE_SHAPES = LoopState(tf.TensorShape([None]), _SCALAR, _SCALAR, _SCALAR, _SCALAR)


@engine_graph_code
def _empty_state() -> LoopState:
    return LoopState(tf.zeros([0]), tf.constant(0.0), tf.constant(0), tf.constant(-1), tf.constant(_NO_LOSS))


@engine_graph_code
def _sized(sums: tf.Tensor, size: int) -> tf.Tensor:
    """`sums` with zeros appended up to `size` entries (the empty sums before the first step)."""
    return tf.pad(sums, [[0, size - tf.shape(sums)[0]]])


@engine_graph_code
def _accumulate(
    state: LoopState,
    index: tf.Tensor,
    names: Sequence[str],
    outputs: dict[str, tf.Tensor],
    finite: tf.Tensor,
    keep_last: bool = False,
) -> LoopState:
    """Adds step `index` to the loop's running sums of finite outputs and its non-finite count;
    with `keep_last`, the sums hold the last finite step's outputs instead (a step that
    reports running results, such as a Keras model's own train_step)."""
    values = tf.stack([_summand(outputs, name) for name in names]) if names else tf.zeros([0])
    previous = _sized(state.sums, len(names))
    sums = tf.where(finite, values, previous) if keep_last else previous + tf.where(finite, values, 0.0)
    newly_bad = tf.logical_and(tf.logical_not(finite), state.first_nonfinite_index < 0)
    return LoopState(
        sums=sums,
        finite_steps=state.finite_steps + tf.cast(finite, tf.float32),
        nonfinite_steps=state.nonfinite_steps + 1 - tf.cast(finite, tf.int32),
        first_nonfinite_index=tf.where(newly_bad, index, state.first_nonfinite_index),
        first_nonfinite_loss=tf.where(
            newly_bad, outputs.get("loss", tf.constant(_NO_LOSS)), state.first_nonfinite_loss
        ),
    )


def _weighs_loss_by_examples(outputs: Mapping[str, Any]) -> bool:
    """Whether the step counts its examples (`STEP_EXAMPLES`, the standard step): its "loss" is then
    averaged over the loop weighted by them, as `fit`'s loss tracker weighs each batch by its size,
    so that a partial last batch weighs what it holds (a step_fn's outputs are plain means)."""
    return "loss" in outputs and STEP_EXAMPLES in outputs


@engine_graph_code
def _summand(outputs: Mapping[str, tf.Tensor], name: str) -> tf.Tensor:
    """What step output `name` adds to the loop's sum: the loss times the step's examples where
    it is weighted by them (`_weighs_loss_by_examples`), else the output."""
    if name == "loss" and _weighs_loss_by_examples(outputs):
        return outputs["loss"] * outputs[STEP_EXAMPLES]
    return outputs[name]


@engine_graph_code
def _loop_outputs(
    state: LoopState, names: Sequence[str], steps_run: tf.Tensor, keep_last: bool = False
) -> dict[str, tf.Tensor]:
    sums = _sized(state.sums, len(names))
    divisor = tf.constant(1.0) if keep_last else tf.maximum(state.finite_steps, 1.0)
    means = {name: sums[i] / divisor for i, name in enumerate(names)}
    if not keep_last and _weighs_loss_by_examples(means):  # Over the finite steps' examples (none: 0).
        means["loss"] = tf.math.divide_no_nan(sums[names.index("loss")], sums[names.index(STEP_EXAMPLES)])
    return {
        "logs": means,
        "nonfinite_steps": state.nonfinite_steps,
        "first_nonfinite_index": state.first_nonfinite_index,
        "first_nonfinite_loss": state.first_nonfinite_loss,
        "steps_run": steps_run,
    }


def make_train_loop(
    strategy: tf.distribute.Strategy,
    replica_step: ReplicaStep,
    global_step: tf.Variable | None,
    *,
    per_replica_batch_size: int | None = None,
    max_loss: float | None = None,
    replica_state: Sequence[Any] = (),
    input_clock: InputClock | None = None,
    keep_last: bool = False,
) -> TrainLoop:
    """Returns `loop(iterator, num_steps) -> {name: mean over the loop}`.

    Each step's outputs are averaged over replicas, then over the steps of the loop whose outputs
    are all finite. More entries say whether any were not: `nonfinite_steps` (how many) and
    `first_nonfinite_index` (the 0-based index in this loop of the first, or -1), so the host can
    stop or count without a per-step sync (a loss above `max_loss` counts as non-finite;
    `first_nonfinite_loss` is that step's); and `steps_run`, fewer than `num_steps` when the data
    ran out (0: not one batch was left). The step is traced once, inside the `tf.range` loop.

    With `per_replica_batch_size`, the call's first batch can be checked on every replica before
    any step runs, as `first_batch_check` asks: not at all (`CHECK_NONE`, the default: a batch
    inside the stream, which may be its partial last one), not larger (`CHECK_NOT_LARGER`: the
    first batch after a resume) or exactly (`CHECK_EXACT`: the first batch of a run from step 0).
    Where it fails, the call runs no step and returns `steps_run=0` and the offending size as
    `first_batch_size` (where the shape is static, tracing raises `BatchSizeMismatch`).

    `replica_state` (`engine.loop.replica_state`): variables each replica updates on its own,
    averaged over the replicas after the loop's last step. `input_clock` (`engine.stragglers`):
    the time each get_next of the iterator waited is added to it. `keep_last`: the logs are the
    last finite step's outputs, not their mean (a step whose outputs are running results
    already: `engine.keras_model.KerasTrainStep`).

    With `global_step=None` the loop does not count steps: the parameter-server coordinator
    counts the steps it scheduled, because a closure retried after a worker failure may have
    run some steps twice.
    """
    parts = _TrainLoopParts(
        strategy=strategy,
        replica_step=replica_step,
        global_step=global_step,
        per_replica_batch_size=per_replica_batch_size,
        max_loss=max_loss,
        replica_state=replica_state,
        input_clock=input_clock,
        keep_last=keep_last,
    )

    @tf.function
    def train_loop(iterator, num_steps: tf.Tensor, first_batch_check=CHECK_NONE) -> dict[str, tf.Tensor]:
        # Every batch is taken as an optional, so a finite dataset ends the loop early instead of
        # failing it, and a call with no batch at all runs no step (a step whose batch is missing
        # might still count an optimizer iteration).
        first_batch = parts.next_batch(iterator)
        run, first_size = parts.check_first_batch(first_batch, first_batch_check)
        names: list[str] = []  # The step's output names, known once the step is traced.

        def run_steps() -> dict[str, tf.Tensor]:
            batch, state, steps_run = first_batch, _empty_state(), tf.constant(0)
            for index in tf.range(num_steps):
                tf.autograph.experimental.set_loop_options(shape_invariants=[(state, _STATE_SHAPES)])
                outputs, finite = parts.one_step(batch.get_value())
                names[:] = outputs
                state = _accumulate(state, index, names, outputs, finite, keep_last)
                steps_run += 1
                if index + 1 < num_steps:  # No batch is taken that the loop will not run.
                    batch = parts.next_batch(iterator)
                if not batch.has_value():
                    break
            return parts.outputs(state, names, steps_run)

        # tf.cond traces run_steps first, so the step's output names are known to _no_steps.
        outputs = tf.cond(run, run_steps, lambda: _no_steps(names))
        if per_replica_batch_size is not None:
            outputs["first_batch_size"] = first_size
        return outputs

    return train_loop


@dataclass(frozen=True, eq=False)
class _TrainLoopParts:
    """The parts of `make_train_loop`'s loop that need no AutoGraph (its steps loop does)."""

    strategy: tf.distribute.Strategy
    replica_step: ReplicaStep
    global_step: tf.Variable | None
    per_replica_batch_size: int | None
    max_loss: float | None
    replica_state: Sequence[Any]  # Read when the loop is traced.
    input_clock: InputClock | None
    keep_last: bool

    @engine_graph_code
    def one_step(self, batch: Batch) -> tuple[dict[str, tf.Tensor], tf.Tensor]:
        reduced = run_step(self.strategy, self.replica_step, (batch,), max_loss=self.max_loss)
        if self.global_step is not None:
            self.global_step.assign_add(1)
        return reduced

    @engine_graph_code
    def next_batch(self, iterator) -> tf.experimental.Optional:
        if self.input_clock is None:
            return iterator.get_next_as_optional()
        started = self.input_clock.start()
        batch = iterator.get_next_as_optional()
        self.input_clock.stop(started, batch)
        return batch

    @engine_graph_code
    def check_first_batch(self, first_batch, first_batch_check) -> tuple[tf.Tensor, tf.Tensor]:
        """(whether the loop runs: a first batch came and passed `first_batch_check`; the size
        that failed it, or -1)."""
        run, first_size = first_batch.has_value(), tf.constant(-1, tf.int64)
        if self.per_replica_batch_size is None:
            return run, first_size
        check = tf.convert_to_tensor(first_batch_check, tf.int32)
        first_size = tf.cond(
            tf.logical_and(run, check > CHECK_NONE),
            lambda: self.mismatched_size(first_batch.get_value(), exact=check >= CHECK_EXACT),
            lambda: tf.constant(-1, tf.int64),
        )
        return tf.logical_and(run, first_size < 0), first_size

    @engine_graph_code
    def mismatched_size(self, batch, *, exact: tf.Tensor) -> tf.Tensor:
        """The first replica batch size that is larger than `per_replica_batch_size` (or, where
        `exact`, other than it), or -1. Not `exact`: a smaller batch may be the data's last."""
        expected = self.per_replica_batch_size
        leaves = tf.nest.flatten(batch)
        if not leaves:
            return tf.constant(-1, tf.int64)
        sizes = []
        for local in self.strategy.experimental_local_results(leaves[0]):
            static = local.shape[0] if local.shape.rank else None
            if static is not None and static != expected:
                raise BatchSizeMismatch(static)
            sizes.append(tf.shape(local, out_type=tf.int64)[0])
        sizes = tf.stack(sizes)
        wrong = tf.logical_or(sizes > expected, tf.logical_and(exact, tf.not_equal(sizes, expected)))
        return tf.where(tf.reduce_any(wrong), tf.gather(sizes, tf.argmax(tf.cast(wrong, tf.int32))), -1)

    @engine_graph_code
    def outputs(self, state: LoopState, names: Sequence[str], steps_run: tf.Tensor) -> dict[str, tf.Tensor]:
        """What the loop returns after its last step, the replicas' own state averaged first."""
        average_over_replicas(self.strategy, list(self.replica_state))
        return _loop_outputs(state, names, steps_run, self.keep_last)


@engine_graph_code
def _no_steps(names: Sequence[str]) -> dict[str, tf.Tensor]:
    """What a call that runs no step returns, with the step's output names."""
    return {
        "logs": {name: tf.constant(0.0) for name in names},
        "nonfinite_steps": tf.constant(0),
        "first_nonfinite_index": tf.constant(-1),
        "first_nonfinite_loss": tf.constant(_NO_LOSS),
        "steps_run": tf.constant(0),
    }


def make_resident_train_loop(
    strategy: tf.distribute.Strategy,
    replica_step: ReplicaStep,
    global_step: tf.Variable,
    data: ResidentData,
    *,
    global_batch_size: int,
    max_loss: float | None = None,
    replica_state: Sequence[Any] = (),
    keep_last: bool = False,
) -> TrainLoop:
    """Returns `loop((replica_tensors, start_position), num_steps)`, with the outputs of
    `make_train_loop`'s loop (`replica_state` likewise averaged at its end), for training
    data kept on the replicas' devices.

    Each replica computes the example indices of all the loop's steps at its
    start (`ResidentData.replica_indices`), then gathers each step's batch
    from its own copy of the data: no iterator, no host work per step. The
    stream never ends, so `steps_run` is always `num_steps`.
    """

    @engine_graph_code
    def loop_indices(first_step: tf.Tensor, num_steps: tf.Tensor) -> tf.Tensor:
        return data.replica_indices(first_step, num_steps, global_batch_size=global_batch_size)

    @engine_graph_code
    def resident_step(replica_tensors, indices: tf.Tensor, index: tf.Tensor):
        return user_code(replica_step)(data.gather(replica_tensors, indices[index]))

    @engine_graph_code
    def one_step(replica_tensors, indices, index: tf.Tensor) -> tuple[dict[str, tf.Tensor], tf.Tensor]:
        reduced = run_step(strategy, resident_step, (replica_tensors, indices, index), max_loss=max_loss)
        global_step.assign_add(1)
        return reduced

    @tf.function
    @engine_graph_code  # Its loop is a tf.while_loop as written: see `_steps_loop`.
    def train_loop(inputs, num_steps: tf.Tensor) -> dict[str, tf.Tensor]:
        replica_tensors, start_position = inputs  # The stream position of the first step (engine.data).
        indices = strategy.run(loop_indices, args=(start_position, num_steps))  # Every step's, on each replica.
        names: list[str] = []

        def step(index: tf.Tensor, state: LoopState) -> LoopState:
            outputs, finite = one_step(replica_tensors, indices, index)
            names[:] = outputs
            return _accumulate(state, index, names, outputs, finite, keep_last)

        state = _steps_loop(num_steps, step)
        average_over_replicas(strategy, list(replica_state))
        return _loop_outputs(state, names, num_steps, keep_last)

    return train_loop


@engine_graph_code
def _steps_loop(num_steps: tf.Tensor, step: Callable[[tf.Tensor, LoopState], LoopState]) -> LoopState:
    """`state = step(index, state)` for index in [0, num_steps), as the tf.while_loop AutoGraph
    makes of a `for index in tf.range(num_steps)` loop. Written out so that the loop function
    needs no conversion: AutoGraph's conversion of a loop function cost ~0.1 s of every
    process's first call (the user's code inside is still converted: `user_code`)."""

    def body(index: tf.Tensor, state: LoopState) -> tuple[tf.Tensor, LoopState]:
        return index + 1, step(index, state)

    _, state = tf.while_loop(
        lambda index, state: index < num_steps,
        body,
        (tf.constant(0, num_steps.dtype), _empty_state()),
        shape_invariants=(_SCALAR, _STATE_SHAPES),
        maximum_iterations=num_steps,
    )
    return state


def make_eval_loop(strategy: tf.distribute.Strategy, replica_step: Callable[[Batch], None]) -> EvalLoop:
    """Returns `loop(iterator, max_batches) -> exhausted`: the step over at
    most `max_batches` more batches of the iterator, and whether it ran out.

    Evaluating in such bounded calls lets the host check for a stop request
    between them: one compiled call over the whole eval set keeps a SIGTERM
    waiting as long as the set is large. `get_next_as_optional` keeps the
    exact-evaluation rules of a `for batch in dataset` loop (partial last
    batch, replicas with an empty batch): every example counts once.
    """

    @tf.function
    def eval_loop(iterator, max_batches: tf.Tensor) -> tf.Tensor:
        exhausted = tf.constant(False)
        for _ in tf.range(max_batches):
            optional = iterator.get_next_as_optional()
            if not optional.has_value():
                exhausted = tf.constant(True)
                break
            strategy.run(replica_step, args=(optional.get_value(),))
        return exhausted

    return eval_loop


def make_resident_eval_loop(
    strategy: tf.distribute.Strategy, replica_step: Callable[[Batch], None], data: ResidentEvalData
) -> EvalLoop:
    """Returns `loop((replica_tensors, first_batch), max_batches) -> exhausted`: the step over
    global batches [first_batch, first_batch + max_batches) of the eval split kept on the
    replicas' devices, and whether that reached its end. No iterator: each replica slices its
    part of a batch from its own copy (`ResidentEvalData.replica_batch`)."""
    num_batches = data.num_batches

    @engine_graph_code
    def resident_step(replica_tensors, batch_index: tf.Tensor) -> None:
        user_code(replica_step)(data.replica_batch(replica_tensors, batch_index))

    @tf.function
    @engine_graph_code  # Its loop is a tf.while_loop as written (see `_steps_loop`).
    def eval_loop(inputs, max_batches: tf.Tensor) -> tf.Tensor:
        replica_tensors, first_batch = inputs
        end = tf.minimum(first_batch + max_batches, num_batches)

        def body(batch_index: tf.Tensor) -> tf.Tensor:
            strategy.run(resident_step, args=(replica_tensors, batch_index))
            return batch_index + 1

        tf.while_loop(lambda batch_index: batch_index < end, body, (first_batch,))
        return end >= num_batches

    return eval_loop
