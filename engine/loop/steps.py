"""What one replica does for one batch: the per-replica train and eval steps.

A replica step maps a batch to a dict of scalar tensors (what the loop
averages over replicas and steps and then logs). `compiled.py` runs these with
`strategy.run`; nothing here knows about loops, iterators or devices.

The loss arithmetic is the part custom loops most often get wrong:
per-element losses are summed on each replica and divided by the number of
real elements in the GLOBAL batch (`engine.losses`), so that summing
gradients across replicas (what the optimizer's all-reduce does) yields the
gradient of the global-batch mean; regularization losses are divided by the
number of replicas for the same reason.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import keras
import tensorflow as tf

from engine.compat import engine_graph_code, keras_mask, set_keras_mask, user_code
from engine.errors import UserError
from engine.losses import EvalLoss, LossTerm, Objective, describe_structure
from engine.stragglers import ComputeClock
from engine.variables import regularization_losses, trainable_variables

Batch = Any
# What the standard step adds to its outputs: 1.0 where its update (gradients included) was
# finite on this replica. The loop takes it out again and counts the step as non-finite
# where any replica reported 0.0, as it counts a non-finite loss.
STEP_FINITE = "engine/step_finite"
# What the standard step adds to its outputs: the examples the step held over all replicas
# (fewer than the global batch in a partial last batch), for the loop's examples/s.
STEP_EXAMPLES = "engine/examples"
ReplicaStep = Callable[[Batch], Mapping[str, tf.Tensor]]
# Maps (labels, outputs) to one loss value per example (or per element), unreduced.
PerExampleLoss = Callable[[Any, Any], tf.Tensor]
# Maps an eval batch to (labels, predictions) or (labels, predictions, sample_weight).
EvalStep = Callable[[Batch], tuple]


def unpack_batch(batch: Batch, *, what: str = "step_fn") -> tuple[Any, tf.Tensor, tf.Tensor | None]:
    """`(features, labels[, sample_weight])` as Keras `fit` takes it; features
    may be a tensor, a tuple or a dict (a multi-input model).

    Anything else is refused at trace time, before a step runs: a dict
    batch would otherwise be unpacked into its two keys.
    """
    if isinstance(batch, (tuple, list)) and len(batch) in (2, 3):
        features, labels, *rest = batch
        return features, labels, (rest[0] if rest else None)
    shape = describe_structure(batch)
    raise UserError(
        f"the standard step takes batches of (features, labels) or (features, labels, sample_weight), "
        f"got {shape}; map the dataset to that structure, or pass {what}= to take this batch yourself"
    )


def call_model(model: Any, inputs: tf.Tensor, *, training: bool) -> tf.Tensor:
    """Calls a Keras model or a plain `tf.Module`, passing `training` only
    where the call accepts it (a research model's `__call__` may not)."""
    if isinstance(model, keras.Model) or _accepts_training(model):
        return user_code(model)(inputs, training=training)
    return user_code(model)(inputs)


def inference_outputs(model: Any, features: Any) -> Any:
    """The model's outputs in inference mode for a replica's batch, which may be empty (its
    share of a partial last batch, on several replicas).

    An empty batch is run as one row of zeros and cut back to none: some kernels return
    wrong shapes for zero examples (oneDNN's Conv2D on CPU gives the input's shape, which
    then fails the next layer), and a batch of zeros costs as little as any. Where the batch
    size is static it cannot be empty, and the call is plain.
    """
    context = tf.distribute.get_replica_context()
    leaves = tf.nest.flatten(features)
    if context is None or context.num_replicas_in_sync == 1 or not leaves or _static_batch_size(features):
        return call_model(model, features, training=False)
    size = tf.shape(leaves[0])[0]
    missing = tf.maximum(1 - size, 0)

    def padded(tensor: tf.Tensor) -> tf.Tensor:
        zeros = tf.zeros(tf.concat([[missing], tf.shape(tensor)[1:]], 0), tensor.dtype)
        return tf.concat([tensor, zeros], 0)

    def cut(output: tf.Tensor) -> tf.Tensor:
        kept = output[:size]
        mask = keras_mask(output)
        if mask is not None:
            set_keras_mask(kept, mask[:size])
        return kept

    outputs = call_model(model, tf.nest.map_structure(padded, features), training=False)
    return tf.nest.map_structure(cut, outputs)


def _accepts_training(model: Any) -> bool:
    try:
        parameters = inspect.signature(model.__call__).parameters
    except (TypeError, ValueError):
        return False
    return "training" in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def regularization_loss(model: Any) -> tf.Tensor:
    """The sum of the model's regularization losses, found through Keras and `tf.Module`
    nesting both ways (`engine.variables.regularization_losses`); 0 where there are none."""
    losses = regularization_losses(model)
    if not losses:
        return tf.constant(0.0)
    return tf.add_n([tf.cast(loss, tf.float32) for loss in losses])


def _static_batch_size(structure: Any) -> int | None:
    leaves = tf.nest.flatten(structure)
    shape = leaves[0].shape if leaves else None
    return shape[0] if shape is not None and shape.rank else None


def examples_in_step(labels: tf.Tensor, global_batch_size: int) -> tf.Tensor:
    """How many examples this step holds over all replicas, as float32.

    A full batch (its size known when traced) holds `global_batch_size`; a
    batch whose size is only known at run time may be a dataset's partial
    last one, unevenly split over replicas (some may hold none), so its
    count is summed over the replicas: one scalar all-reduce a step, only
    for such data. Keras `fit` divides such a batch by what it holds, too.
    """
    context = tf.distribute.get_replica_context()
    num_replicas = context.num_replicas_in_sync if context is not None else 1
    if _static_batch_size(labels) == global_batch_size // num_replicas:
        return tf.constant(float(global_batch_size))
    local = examples_in_batch(labels)
    if num_replicas > 1:
        local = context.all_reduce(tf.distribute.ReduceOp.SUM, local)
    return tf.maximum(local, 1.0)


def make_train_step(
    *,
    model: Any,
    optimizer: keras.optimizers.Optimizer,
    objective: Objective | None,
    global_batch_size: int,
    metrics: Sequence[keras.metrics.Metric] = (),
    weighted_metrics: Sequence[keras.metrics.Metric] = (),
    extra_loss: Callable[[Any, Any, Any, Any], tf.Tensor] | None = None,
    clip_norm: float | None = None,
    grad_accum_steps: int = 1,
    jit_compile: bool = False,
    skip_nonfinite: bool = False,
    grad_norm: bool = False,
    compute_clock: ComputeClock | None = None,
) -> ReplicaStep:
    """The standard supervised replica step for `(features, labels)` batches: a
    `StandardStep`, whose docstring says what each argument does."""
    return StandardStep(
        model=model,
        optimizer=optimizer,
        objective=objective,
        global_batch_size=global_batch_size,
        metrics=metrics,
        weighted_metrics=weighted_metrics,
        extra_loss=extra_loss,
        clip_norm=clip_norm,
        grad_accum_steps=grad_accum_steps,
        jit_compile=jit_compile,
        skip_nonfinite=skip_nonfinite,
        grad_norm=grad_norm,
        compute_clock=compute_clock,
    )


# One micro-batch of a replica's batch: (features, labels, sample_weight).
Part = tuple[Any, Any, Any]


@dataclasses.dataclass(eq=False, repr=False, kw_only=True)
class StandardStep:
    """The standard supervised replica step for `(features, labels)` batches, as methods of
    one object (`__call__` is the replica step); `make_train_step` builds it.

    - The loss is `objective`'s (`engine.losses`): each output's per-element
      losses summed over its real elements (Keras's output mask) on every
      replica and micro-batch, divided by how many the whole step holds. Where
      that count follows from the batch size (no mask, static shapes) it costs
      nothing; otherwise it is one scalar all-reduce a step, and with
      `grad_accum_steps > 1` the later micro-batches are also run forward once
      without gradients to count theirs before the first update is computed.
    - `grad_accum_steps` splits the replica's batch into that many
      micro-batches and sums their gradients before one update: less memory,
      the same update as the whole batch. Sparse gradients (an Embedding's
      IndexedSlices) are summed as such.
    - `clip_norm` clips the GLOBAL gradient (after the cross-replica sum),
      so every replica applies the same clipped update.
    - `jit_compile` compiles the forward and backward pass with XLA; the
      cross-replica reduction and the optimizer update stay outside it.
    - A `keras.optimizers.LossScaleOptimizer` (float16) gets its loss scaled
      and its gradients unscaled by the optimizer itself.
    - `metrics` are updated without sample weights and `weighted_metrics`
      with them, as Keras `compile(metrics=, weighted_metrics=)` does; both see
      the outputs' masks, as in Keras.
    - Every step reports `STEP_FINITE` (loss and, without loss scaling, the
      gradients finite on this replica) for the loop's non-finite count, and
      `STEP_EXAMPLES` (the examples it held) for the loop's examples/s.
    - `skip_nonfinite` leaves the variables untouched on a step whose loss
      or gradients are not finite on any replica (one extra scalar
      all-reduce a step); the step's loss is still returned, so the loop
      counts it. Under loss scaling only the loss is checked: overflowing
      gradients are the loss scale's business.
    - `grad_norm` adds `grad_norm` to the outputs: the global norm of the
      all-reduced gradient (before clipping). With `clip_norm` or one replica
      it comes free; otherwise it costs one more all-reduce of the gradients
      a step, which is why it is asked for. Not under loss scaling, where an
      overflowing (skipped) step has no finite norm to report.
    - `extra_loss(features, labels, outputs, sample_weight)`: a replica's loss beyond the
      objective's (a Keras model's own `compute_loss`: `engine.keras_model`), added divided by
      the number of replicas (and micro-batches): counted once per step, as regularization is.
      Without an `objective` it is the whole loss.
    - `compute_clock` (`engine.stragglers`) adds each step's time from its batch to its
      gradients, before any all-reduce, to this replica's clock: which worker is slow.
    """

    model: Any
    optimizer: keras.optimizers.Optimizer
    objective: Objective | None
    global_batch_size: int
    metrics: Sequence[keras.metrics.Metric] = ()
    weighted_metrics: Sequence[keras.metrics.Metric] = ()
    extra_loss: Callable[[Any, Any, Any, Any], tf.Tensor] | None = None
    clip_norm: float | None = None
    grad_accum_steps: int = 1
    jit_compile: bool = False
    skip_nonfinite: bool = False
    grad_norm: bool = False
    compute_clock: ComputeClock | None = None

    def __post_init__(self) -> None:
        self.uses_loss_scale = isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)
        self.variables = trainable_variables(self.model)
        self.reports_norm = self.grad_norm and not self.uses_loss_scale
        # Under XLA the forward and backward pass only; the counts' all-reduce stays outside it.
        self.compiled_gradients = (
            tf.function(self.compute_gradients, jit_compile=True) if self.jit_compile else None
        )

    @engine_graph_code
    def __call__(self, batch: Batch) -> dict[str, tf.Tensor]:
        """The replica step: gradients, then the update, then the metrics; returns the outputs."""
        features, labels, sample_weight = unpack_batch(batch)
        num_examples = examples_in_step(labels, self.global_batch_size)
        clock = self.compute_clock
        started = clock.start(features) if clock is not None else None
        gradients, loss, outputs = self.gradients_of(features, labels, sample_weight, num_examples)
        if clock is not None:
            clock.stop(started, gradients)
        result = {"loss": loss, STEP_EXAMPLES: num_examples}
        gradients = self.clipped(gradients, result)
        # The loop counts a step with a non-finite gradient as it counts a non-finite loss.
        result[STEP_FINITE] = self.apply(loss, gradients)
        for metric in self.metrics:
            user_code(metric.update_state)(labels, outputs)
        for metric in self.weighted_metrics:
            user_code(metric.update_state)(labels, outputs, sample_weight=sample_weight)
        return result

    def split(self, structure: Any) -> list[Any]:
        """`structure` cut into `grad_accum_steps` micro-batches (None stays None in each)."""
        parts = self.grad_accum_steps
        if structure is None or parts == 1:
            return [structure] * parts
        leaves = [_split_examples(t, parts) for t in tf.nest.flatten(structure)]
        return [tf.nest.pack_sequence_as(structure, [pieces[i] for pieces in leaves]) for i in range(parts)]

    def micro_batches(self, features: Any, labels: Any, sample_weight: Any) -> list[Part]:
        """The batch as `grad_accum_steps` micro-batches of (features, labels, sample_weight)."""
        return list(zip(self.split(features), self.split(labels), self.split(sample_weight), strict=True))

    def step_counts(
        self, terms: list[LossTerm], later_parts: list[Part], num_examples: tf.Tensor
    ) -> list[tf.Tensor]:
        """Each term's count of real elements over the whole step: from the example count
        where it follows from it, else counted (the later micro-batches run forward once
        for it) and all-reduced."""
        counted = [index for index, term in enumerate(terms) if term.per_example is None]
        local = [terms[index].count for index in counted]
        if counted and later_parts:
            assert self.objective is not None, "a counted term is an objective's"
            for part_features, part_labels, part_weight in later_parts:
                outputs = call_model(self.model, part_features, training=False)
                later = self.objective.terms(part_labels, outputs, part_weight)
                local = [total + later[index].count for total, index in zip(local, counted, strict=True)]
        reduced = _sum_over_replicas(local)
        counts: list[tf.Tensor] = []
        for term in terms:
            if term.per_example is None:
                counts.append(reduced.pop(0))
            else:
                counts.append(num_examples * float(term.per_example))
        return counts

    def part_loss(
        self, tape: tf.GradientTape, parts: list[Part], index: int, num_examples: tf.Tensor, counts: Any
    ) -> tuple[Any, tf.Tensor, Any]:
        """Micro-batch `index`'s forward pass and its share of the step's data loss (the
        objective's and `extra_loss`'s); returns (outputs, that loss, the step's counts, taken
        at the first micro-batch where not given: every micro-batch divides by them)."""
        part_features, part_labels, part_weight = parts[index]
        outputs = call_model(self.model, part_features, training=True)
        objective = self.objective
        terms = objective.terms(part_labels, outputs, part_weight) if objective is not None else []
        if counts is None:  # Known before any gradient: every micro-batch divides by them.
            with tape.stop_recording():
                counts = self.step_counts(terms, parts[index + 1 :], num_examples)
        loss = objective.combine(terms, counts) if objective is not None else tf.constant(0.0)
        if self.extra_loss is not None:
            beyond = self.extra_loss(part_features, part_labels, outputs, part_weight)
            loss += beyond / float(_num_replicas() * self.grad_accum_steps)
        return outputs, loss, counts

    @engine_graph_code
    def compute_gradients(self, features, labels, sample_weight, num_examples, counts=None):
        """(the replica's gradients summed over its micro-batches, its loss as the loop averages
        it, the model's outputs for the whole batch)."""
        gradients = None
        data_loss = tf.constant(0.0)
        reg_loss = tf.constant(0.0)
        all_outputs = []
        parts = self.micro_batches(features, labels, sample_weight)
        for index in range(len(parts)):
            with tf.GradientTape() as tape:
                outputs, part_loss, counts = self.part_loss(tape, parts, index, num_examples, counts)
                reg_loss = regularization_loss(self.model)
                loss = part_loss + tf.nn.scale_regularization_loss(reg_loss) / self.grad_accum_steps
                if self.uses_loss_scale:
                    loss = self.optimizer.scale_loss(loss)
            part_gradients = tape.gradient(loss, self.variables)
            gradients = part_gradients if gradients is None else add_gradients(gradients, part_gradients)
            data_loss += part_loss
            all_outputs.append(outputs)
        self.check_variables()
        # The loop averages the loss over replicas: R x (this replica's share of the global mean).
        return gradients, _num_replicas() * data_loss + reg_loss, concat_outputs(all_outputs)

    def check_variables(self) -> None:
        """Refuses a model that created variables in its first call: they would not train."""
        if len(trainable_variables(self.model)) != len(self.variables):
            raise UserError(
                f"the model ({type(self.model).__name__}) created variables in its first call, after the "
                "Trainer had collected them, so they would not train: build every layer (give it an "
                "input shape, or call the model once) inside strategy.scope() before creating the Trainer"
            )

    def counted_terms(self, part: Part) -> bool:
        """Whether a loss term's count is counted (a mask, a dynamic shape) rather than known
        from the example count: found by tracing the forward pass in a graph of its own (never
        run), so the step's graph gains nothing where every count is known."""
        found: list[bool] = []
        model, objective = self.model, self.objective
        assert objective is not None, "asked only of an objective"

        @engine_graph_code
        def probe(part_features, part_labels, part_weight):
            outputs = call_model(model, part_features, training=False)
            found.extend(term.per_example is None for term in objective.terms(part_labels, outputs, part_weight))
            return tf.constant(0)

        specs = [
            None if piece is None else tf.nest.map_structure(tf.TensorSpec.from_tensor, piece) for piece in part
        ]
        tf.function(probe).get_concrete_function(*specs)
        return any(found)

    def counts_outside_xla(self, features, labels, sample_weight, num_examples) -> list[tf.Tensor] | None:
        """Under XLA the counts' all-reduce cannot run inside the compiled pass: where a count
        must be counted, every micro-batch runs forward once more here (without gradients)
        and the counts go into the pass; None where every count is known."""
        parts = self.micro_batches(features, labels, sample_weight)
        if self.objective is None or not self.counted_terms(parts[0]):
            return None
        part_features, part_labels, part_weight = parts[0]
        outputs = call_model(self.model, part_features, training=False)
        first = self.objective.terms(part_labels, outputs, part_weight)
        return self.step_counts(first, parts[1:], num_examples)

    def gradients_of(self, features, labels, sample_weight, num_examples):
        """`compute_gradients`, compiled with XLA under `jit_compile` (the counts taken outside it)."""
        if self.compiled_gradients is None:
            return self.compute_gradients(features, labels, sample_weight, num_examples)
        counts = self.counts_outside_xla(features, labels, sample_weight, num_examples)
        return self.compiled_gradients(features, labels, sample_weight, num_examples, counts)

    def clipped(self, gradients: list[Any], result: dict[str, tf.Tensor]) -> list[Any]:
        """The gradients clipped by `clip_norm`, the global norm added to `result` where asked."""
        if self.clip_norm is not None:
            gradients, norm = _clip_global_norm(gradients, self.clip_norm, self.optimizer, self.uses_loss_scale)
            if self.reports_norm:
                result["grad_norm"] = norm
        elif self.reports_norm:
            result["grad_norm"] = _global_norm(gradients)
        return gradients

    def apply(self, loss: tf.Tensor, gradients: list[Any]) -> tf.Tensor:
        """Applies the update (with `skip_nonfinite`, only where finite on every replica);
        returns 1.0 where the step was finite on this replica (`STEP_FINITE`), else 0.0."""
        # Overflow under loss scaling is the scale's business.
        checked = [] if self.uses_loss_scale else gradients
        if self.skip_nonfinite:
            finite = _finite_on_all_replicas(loss, checked)
            _apply_if_finite(finite, self.optimizer, gradients, self.variables)
        else:
            finite = _locally_finite(loss, checked)
            self.optimizer.apply(gradients, self.variables)
        return tf.cast(finite, tf.float32)


def _num_replicas() -> int:
    return tf.distribute.get_replica_context().num_replicas_in_sync


def _sum_over_replicas(values: list[tf.Tensor]) -> list[tf.Tensor]:
    """`values` summed over every replica of the step, in one all-reduce of them stacked."""
    if not values:
        return []
    context = tf.distribute.get_replica_context()
    stacked = tf.stack(values)
    if context is not None and context.num_replicas_in_sync > 1:
        stacked = context.all_reduce(tf.distribute.ReduceOp.SUM, stacked)
    return tf.unstack(stacked, num=len(values))


def add_gradients(left: list[Any], right: list[Any]) -> list[Any]:
    """Gradients summed, each kept as it is: two IndexedSlices (an Embedding's) stay sparse
    (their rows concatenated, which the optimizer adds up as one slice a row); a dense one
    with a sparse one becomes dense."""
    summed = []
    for a, b in zip(left, right, strict=True):
        if a is None or b is None:
            summed.append(b if a is None else a)
        elif isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
            summed.append(
                tf.IndexedSlices(
                    tf.concat([a.values, b.values], 0), tf.concat([a.indices, b.indices], 0), a.dense_shape
                )
            )
        else:
            summed.append(tf.convert_to_tensor(a) + tf.convert_to_tensor(b))
    return summed


def scale_gradient(gradient: Any, factor: Any) -> Any:
    """`gradient * factor`, for a dense gradient or IndexedSlices (which do not multiply)."""
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values * factor, gradient.indices, gradient.dense_shape)
    return None if gradient is None else gradient * factor


def concat_outputs(parts: list[Any]) -> Any:
    """The micro-batches' outputs as one batch, nested as the model's, each keeping its Keras
    mask (the metrics apply it)."""
    if len(parts) == 1:
        return parts[0]

    def concat(*tensors: tf.Tensor) -> tf.Tensor:
        joined = tf.concat(tensors, 0)
        masks = [keras_mask(t) for t in tensors]
        if all(mask is not None for mask in masks):
            set_keras_mask(joined, tf.concat(masks, 0))
        return joined

    return tf.nest.map_structure(concat, *parts)


def _global_norm(gradients) -> tf.Tensor:
    """The norm of the gradient summed over replicas (what the optimizer applies)."""
    context = tf.distribute.get_replica_context()
    if context.num_replicas_in_sync > 1:
        gradients = context.all_reduce(tf.distribute.ReduceOp.SUM, gradients)
    return tf.linalg.global_norm([combined_rows(g) for g in gradients])


def _clip_global_norm(gradients, clip_norm, optimizer, uses_loss_scale):
    """Clips by the norm of the all-reduced gradient; returns the gradients and that norm.

    Each replica holds only its share of the gradient, so the norm must be taken after the
    sum. Each replica then hands the optimizer its OWN gradient times the global clip factor:
    the optimizer's sum is the clipped total, and sparse gradients keep their rows as
    without clipping (handing it 1/N of the summed total instead repeated every row N times,
    which Adam squares one by one: 0.12 from one replica on an Embedding).
    """
    context = tf.distribute.get_replica_context()
    # IndexedSlices rows of one index added up first: the norm of the gradient, not of its pieces.
    total = [combined_rows(g) for g in context.all_reduce(tf.distribute.ReduceOp.SUM, gradients)]
    threshold = clip_norm
    if uses_loss_scale:  # The gradients are still multiplied by the loss scale.
        threshold = clip_norm * tf.cast(optimizer.dynamic_scale, tf.float32)
    norm = tf.linalg.global_norm(total)
    # tf.clip_by_global_norm's factor: 1 at or below the threshold (NaN where the norm is not finite).
    factor = threshold * tf.minimum(1.0 / norm, 1.0 / threshold)
    if uses_loss_scale:
        norm = norm / tf.cast(optimizer.dynamic_scale, norm.dtype)
    return [None if g is None else scale_gradient(g, tf.cast(factor, _values(g).dtype)) for g in gradients], norm


def combined_rows(gradient: Any) -> Any:
    """IndexedSlices with each index once, its rows added up (an Embedding's gradient holds a row
    per occurrence of a token; the replicas' sum and accumulation concatenate more): their norm
    is then the gradient's norm, which the rows' own norm over-counts. Dense gradients as they are."""
    if not isinstance(gradient, tf.IndexedSlices):
        return gradient
    indices, positions = tf.unique(gradient.indices)
    values = tf.math.unsorted_segment_sum(gradient.values, positions, tf.shape(indices)[0])
    return tf.IndexedSlices(values, indices, gradient.dense_shape)


def _split_examples(tensor: tf.Tensor, parts: int) -> list[tf.Tensor]:
    """`tensor` cut into `parts` micro-batches along the batch; a batch that does not divide
    (a partial last batch) is cut as evenly as it goes, some parts possibly empty."""
    size = tensor.shape[0] if tensor.shape.rank else None
    if size is not None and size % parts == 0:
        return tf.split(tensor, parts)
    total = tf.shape(tensor)[0]
    sizes = total // parts + tf.cast(tf.range(parts) < total % parts, total.dtype)
    return tf.split(tensor, sizes, num=parts)


def _locally_finite(loss: tf.Tensor, gradients) -> tf.Tensor:
    """Whether this replica's loss and gradients are finite: one sum a gradient (NaN and Inf
    survive a sum), no all-reduce (the loop's averaging of the outputs does that)."""
    sums = [tf.reduce_sum(tf.cast(_values(g), tf.float32)) for g in gradients if g is not None]
    return tf.math.is_finite(tf.add_n([tf.cast(loss, tf.float32), *sums]))


def _values(gradient: Any) -> tf.Tensor:
    """A gradient's stored values: the rows of IndexedSlices (never made dense to be checked)."""
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def _finite_on_all_replicas(loss: tf.Tensor, gradients) -> tf.Tensor:
    local = _locally_finite(loss, gradients)
    context = tf.distribute.get_replica_context()
    bad = context.all_reduce(tf.distribute.ReduceOp.SUM, 1.0 - tf.cast(local, tf.float32))
    return tf.equal(bad, 0.0)


def _apply_if_finite(finite, optimizer, gradients, variables) -> None:
    """Applies the update only when `finite` (equal on every replica).

    The condition is taken in cross-replica context, as Keras's
    LossScaleOptimizer does: tf.distribute cannot run a `cond` in replica
    context whose branch calls `merge_call`, which `optimizer.apply` does.
    """

    def in_cross_replica(distribution, finite, gradients):
        agreed = distribution.experimental_local_results(finite)[0]

        def apply():
            distribution.extended.call_for_each_replica(
                lambda grads: optimizer.apply(grads, variables), args=(gradients,)
            )
            return tf.constant(True)

        tf.cond(agreed, apply, lambda: tf.constant(False))

    tf.distribute.get_replica_context().merge_call(in_cross_replica, args=(finite, gradients))


def make_eval_step(
    *,
    model: Any,
    objective: Objective,
    loss_metric: EvalLoss,
    metrics: Sequence[keras.metrics.Metric] = (),
    weighted_metrics: Sequence[keras.metrics.Metric] = (),
    eval_step_fn: EvalStep | None = None,
) -> Callable[[Batch], None]:
    """The eval replica step: updates metrics only.

    Metrics accumulate sums and counts per replica that are added up when
    read, so a partial last batch, or a replica that gets an empty batch,
    counts exactly as many examples as it holds. Batches are unpacked as in
    training; `eval_step_fn(batch) -> (labels, predictions[, sample_weight])`
    takes any other structure (it calls the model itself).

    The loss is the objective's over the whole eval set (`engine.losses.EvalLoss`):
    sum(w * l) over the real elements of every batch divided by their number, plus
    the model's regularization loss, Keras `evaluate`'s numbers where every batch
    holds as many real elements. `metrics` get no sample weights and
    `weighted_metrics` get them, as in Keras `compile`.
    """

    @engine_graph_code
    def eval_step(batch: Batch) -> None:
        if eval_step_fn is None:
            features, labels, sample_weight = unpack_batch(batch, what="eval_step_fn")
            outputs = inference_outputs(model, features)
        else:
            labels, outputs, sample_weight = _eval_outputs(user_code(eval_step_fn)(batch))
        examples = examples_in_batch(labels)
        loss_metric.update_state(
            objective.terms(labels, outputs, sample_weight), regularization_loss(model), examples
        )
        for metric in metrics:
            user_code(metric.update_state)(labels, outputs)
        for metric in weighted_metrics:
            user_code(metric.update_state)(labels, outputs, sample_weight=sample_weight)

    return eval_step


def examples_in_batch(labels: Any) -> tf.Tensor:
    """How many examples a batch holds (float32): the batch size of its labels' first tensor,
    however they are nested (a tuple or dict of labels counts its examples once)."""
    leaves = tf.nest.flatten(labels)
    if not leaves:
        return tf.constant(0.0)
    return tf.cast(tf.shape(leaves[0])[0], tf.float32)


def _eval_outputs(outputs: Any) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor | None]:
    if isinstance(outputs, (tuple, list)) and len(outputs) in (2, 3):
        labels, predictions, *rest = outputs
        return labels, predictions, (rest[0] if rest else None)
    raise UserError(
        f"eval_step_fn must return (labels, predictions) or (labels, predictions, sample_weight), "
        f"got a {type(outputs).__name__}"
    )
