"""What one replica does for one batch: the per-replica train and eval steps.

A replica step maps a batch to a dict of scalar tensors (what the loop
averages over replicas and steps and then logs). `loop.py` runs these with
`strategy.run`; nothing here knows about loops, iterators or devices.

The loss arithmetic is the part custom loops most often get wrong:
per-example losses are summed on each replica and divided by the GLOBAL
batch size (`tf.nn.compute_average_loss`), so that summing gradients across
replicas (what the optimizer's all-reduce does) yields the gradient of the
global-batch mean; regularization losses are divided by the number of
replicas for the same reason.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import keras
import tensorflow as tf

from engine.errors import UserError
from engine.variables import regularization_losses, trainable_variables

Batch = Any
# What the standard step adds to its outputs: 1.0 where its update (gradients included) was
# finite on this replica. The loop takes it out again and counts the step as non-finite
# where any replica reported 0.0, as it counts a non-finite loss.
STEP_FINITE = "engine/step_finite"
ReplicaStep = Callable[[Batch], Mapping[str, tf.Tensor]]
# Maps (labels, logits) to one loss value per example, unreduced.
PerExampleLoss = Callable[[tf.Tensor, tf.Tensor], tf.Tensor]
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
    shape = (
        f"a dict with keys {sorted(batch)}"
        if isinstance(batch, Mapping)
        else (
            f"a {type(batch).__name__} of {len(batch)}"
            if isinstance(batch, (tuple, list))
            else f"a {type(batch).__name__}"
        )
    )
    raise UserError(
        f"the standard step takes batches of (features, labels) or (features, labels, sample_weight), "
        f"got {shape}; map the dataset to that structure, or pass {what}= to take this batch yourself"
    )


def call_model(model: Any, inputs: tf.Tensor, *, training: bool) -> tf.Tensor:
    """Calls a Keras model or a plain `tf.Module`, passing `training` only
    where the call accepts it (a research model's `__call__` may not)."""
    if isinstance(model, keras.Model) or _accepts_training(model):
        return model(inputs, training=training)
    return model(inputs)


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
    local = tf.cast(tf.shape(labels)[0], tf.float32)
    if num_replicas > 1:
        local = context.all_reduce(tf.distribute.ReduceOp.SUM, local)
    return tf.maximum(local, 1.0)


def make_train_step(
    *,
    model: Any,
    optimizer: keras.optimizers.Optimizer,
    loss_fn: PerExampleLoss,
    global_batch_size: int,
    metrics: Sequence[keras.metrics.Metric] = (),
    weighted_metrics: Sequence[keras.metrics.Metric] = (),
    clip_norm: float | None = None,
    grad_accum_steps: int = 1,
    jit_compile: bool = False,
    skip_nonfinite: bool = False,
    grad_norm: bool = False,
) -> ReplicaStep:
    """The standard supervised replica step for `(features, labels)` batches.

    - `grad_accum_steps` splits the replica's batch into that many
      micro-batches and sums their gradients before one update: less memory,
      the same update as the whole batch.
    - `clip_norm` clips the GLOBAL gradient (after the cross-replica sum),
      so every replica applies the same clipped update.
    - `jit_compile` compiles the forward and backward pass with XLA; the
      cross-replica reduction and the optimizer update stay outside it.
    - A `keras.optimizers.LossScaleOptimizer` (float16) gets its loss scaled
      and its gradients unscaled by the optimizer itself.
    - The loss is the examples' sum over all replicas divided by how many the
      step holds: `global_batch_size`, or fewer in a partial last batch
      (`examples_in_step`), the mean Keras `fit` takes.
    - `metrics` are updated without sample weights and `weighted_metrics`
      with them, as Keras `compile(metrics=, weighted_metrics=)` does.
    - Every step reports `STEP_FINITE` (loss and, without loss scaling, the
      gradients finite on this replica) for the loop's non-finite count.
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
    """
    uses_loss_scale = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    variables = trainable_variables(model)
    grad_norm = grad_norm and not uses_loss_scale

    def split(structure):
        if structure is None or grad_accum_steps == 1:
            return [structure] * grad_accum_steps
        leaves = [_split_examples(t, grad_accum_steps) for t in tf.nest.flatten(structure)]
        return [
            tf.nest.pack_sequence_as(structure, [parts[i] for parts in leaves]) for i in range(grad_accum_steps)
        ]

    def compute_gradients(features, labels: tf.Tensor, sample_weight: tf.Tensor | None, num_examples):
        gradients = None
        data_loss_sum = tf.constant(0.0)
        reg_loss = tf.constant(0.0)
        all_logits = []
        for part_features, part_labels, part_weight in zip(
            split(features), split(labels), split(sample_weight), strict=True
        ):
            with tf.GradientTape() as tape:
                logits = call_model(model, part_features, training=True)
                per_example = tf.cast(loss_fn(part_labels, logits), tf.float32)
                if part_weight is not None:
                    per_example = per_example * tf.cast(part_weight, tf.float32)
                reg_loss = regularization_loss(model)
                loss = (
                    tf.reduce_sum(per_example) / num_examples
                    + tf.nn.scale_regularization_loss(reg_loss) / grad_accum_steps
                )
                if uses_loss_scale:
                    loss = optimizer.scale_loss(loss)
            part_gradients = tape.gradient(loss, variables)
            gradients = (
                part_gradients
                if gradients is None
                else [g + p for g, p in zip(gradients, part_gradients, strict=True)]
            )
            data_loss_sum += tf.reduce_sum(per_example)
            all_logits.append(logits)
        if len(trainable_variables(model)) != len(variables):
            raise UserError(
                f"the model ({type(model).__name__}) created variables in its first call, after the "
                "Trainer had collected them, so they would not train: build every layer (give it an "
                "input shape, or call the model once) inside strategy.scope() before creating the Trainer"
            )
        logits = all_logits[0] if len(all_logits) == 1 else tf.concat(all_logits, 0)
        # The loop averages this over replicas: R x (this replica's share of the global mean).
        num_replicas = tf.distribute.get_replica_context().num_replicas_in_sync
        return gradients, num_replicas * data_loss_sum / num_examples + reg_loss, logits

    if jit_compile:
        compute_gradients = tf.function(compute_gradients, jit_compile=True)

    def train_step(batch: Batch) -> dict[str, tf.Tensor]:
        features, labels, sample_weight = unpack_batch(batch)
        num_examples = examples_in_step(labels, global_batch_size)
        gradients, loss, logits = compute_gradients(features, labels, sample_weight, num_examples)
        outputs = {"loss": loss}
        if clip_norm is not None:
            gradients, norm = _clip_global_norm(gradients, clip_norm, optimizer, uses_loss_scale)
            if grad_norm:
                outputs["grad_norm"] = norm
        elif grad_norm:
            outputs["grad_norm"] = _global_norm(gradients)
        checked = [] if uses_loss_scale else gradients  # Overflow under loss scaling is the scale's business.
        if skip_nonfinite:
            finite = _finite_on_all_replicas(loss, checked)
            _apply_if_finite(finite, optimizer, gradients, variables)
        else:
            finite = _locally_finite(loss, checked)
            optimizer.apply(gradients, variables)
        # The loop counts a step with a non-finite gradient as it counts a non-finite loss.
        outputs[STEP_FINITE] = tf.cast(finite, tf.float32)
        for metric in metrics:
            metric.update_state(labels, logits)
        for metric in weighted_metrics:
            metric.update_state(labels, logits, sample_weight=sample_weight)
        return outputs

    return train_step


def _global_norm(gradients) -> tf.Tensor:
    """The norm of the gradient summed over replicas (what the optimizer applies)."""
    context = tf.distribute.get_replica_context()
    if context.num_replicas_in_sync > 1:
        gradients = context.all_reduce(tf.distribute.ReduceOp.SUM, gradients)
    return tf.linalg.global_norm(gradients)


def _clip_global_norm(gradients, clip_norm, optimizer, uses_loss_scale):
    """Clips by the norm of the all-reduced gradient; returns the gradients and that norm.

    Each replica holds only its share of the gradient, so the norm must be
    taken after the sum. The optimizer sums across replicas again, which is
    why each replica hands it 1/num_replicas of the clipped total.
    """
    context = tf.distribute.get_replica_context()
    num_replicas = context.num_replicas_in_sync
    total = context.all_reduce(tf.distribute.ReduceOp.SUM, gradients)
    threshold = clip_norm
    if uses_loss_scale:  # The gradients are still multiplied by the loss scale.
        threshold = clip_norm * tf.cast(optimizer.dynamic_scale, tf.float32)
    clipped, norm = tf.clip_by_global_norm(total, threshold)
    if uses_loss_scale:
        norm = norm / tf.cast(optimizer.dynamic_scale, norm.dtype)
    return [g / num_replicas for g in clipped], norm


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
    sums = [tf.reduce_sum(tf.cast(g, tf.float32)) for g in gradients if g is not None]
    return tf.math.is_finite(tf.add_n([tf.cast(loss, tf.float32), *sums]))


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
    loss_fn: PerExampleLoss,
    loss_metric: keras.metrics.Mean,
    count_metric: keras.metrics.Sum,
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

    The loss is Keras `evaluate`'s: each example contributes `w * l` plus
    the model's regularization loss, averaged over all N examples, i.e.
    sum(w * l) / N + regularization (`loss_metric` is an unweighted mean).
    `metrics` get no sample weights and `weighted_metrics` get them, as in
    Keras `compile`.
    """

    def eval_step(batch: Batch) -> None:
        if eval_step_fn is None:
            features, labels, sample_weight = unpack_batch(batch, what="eval_step_fn")
            logits = call_model(model, features, training=False)
        else:
            labels, logits, sample_weight = _eval_outputs(eval_step_fn(batch))
        per_example = tf.cast(loss_fn(labels, logits), tf.float32)
        if sample_weight is not None:
            per_example = per_example * tf.cast(sample_weight, tf.float32)
        loss_metric.update_state(per_example + regularization_loss(model))
        count_metric.update_state(tf.cast(tf.shape(labels)[0], tf.float32))
        for metric in metrics:
            metric.update_state(labels, logits)
        for metric in weighted_metrics:
            metric.update_state(labels, logits, sample_weight=sample_weight)

    return eval_step


def _eval_outputs(outputs: Any) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor | None]:
    if isinstance(outputs, (tuple, list)) and len(outputs) in (2, 3):
        labels, predictions, *rest = outputs
        return labels, predictions, (rest[0] if rest else None)
    raise UserError(
        f"eval_step_fn must return (labels, predictions) or (labels, predictions, sample_weight), "
        f"got a {type(outputs).__name__}"
    )
