"""The data forms the engine takes, and how each one is positioned on resume.

A distributed iterator cannot be checkpointed (see shared notes), so a
resumed run rebuilds its training data at the restored global step. Doing
that exactly depends on what one element of the user's data is, so the
forms are declared, not guessed:

- `GlobalBatches(dataset=ds)`: a `tf.data.Dataset` of GLOBAL batches, split
  across replicas by `strategy.experimental_distribute_dataset`. Each step
  takes one element, so a resume skips `start_step` elements (exact for a
  deterministic pipeline: seeded shuffles).
- `GlobalBatches(from_step=fn)`: `fn(start_step)` returns the global batches
  from global step `start_step` on; it positions itself.
- `PerReplicaBatches(fn=fn)`: `fn(input_context)` returns one input
  pipeline's PER-REPLICA batches (`strategy.distribute_datasets_from_function`).
  Each step takes `input_context.num_replicas_in_sync //
  input_context.num_input_pipelines` elements of every pipeline (2 for one
  pipeline feeding 2 replicas), so a resume skips `start_step` times that.
- `PerReplicaBatches(from_step=fn)`: `fn(input_context, start_step)` starts
  its pipeline at global step `start_step` itself, i.e. after
  `steps_to_elements(input_context, start_step)` of its elements.
- `engine.ResidentData`: arrays kept on the devices; batch k is a function
  of (seed, k), so there is nothing to skip.

What the forms are positioned at is the stream POSITION, not the step: the
global step plus the `DataPosition` offset, the batches that rollbacks
skipped (`engine.loop.rollback`; 0 in a run without one). Every form above can
start at any position, so skipping is as exact as resuming.

Each form takes `service=engine.DataService(address=...)`: its pipelines,
positioned as above, run on the data workers of a tf.data service, and the
training process only reads their batches (`distribute_train_data`). With one
data worker the batches are those of local input, in order, so a run and its
resume are the same as without the service. With several, the order is the
order the workers answer in, and a resume cannot be exact
(`service_resume_note` says what it does instead).

Plain values are read as the form they can only be: a `tf.data.Dataset` is
`GlobalBatches(dataset=)`; a function of one parameter is
`PerReplicaBatches(fn=)` (tf.distribute's own convention); a function whose
parameters are `(start_step)` or `(input_context, start_step)` by those
names is the `from_step` form. A one-parameter function whose parameter
names a step (`lambda step: ...`) is refused as ambiguous.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, TypeAlias

import tensorflow as tf

from engine.errors import UserError
from engine.options import DataService

DatasetFn = Callable[..., tf.data.Dataset]
# What `Trainer(train_data=)` and `eval_data=` accept; `engine.ResidentData` too for training,
# `engine.ResidentEvalData` for evaluation.
Data: TypeAlias = Any


@dataclasses.dataclass(frozen=True)
class GlobalBatches:
    """Global batches: `dataset` (skipped forward on resume) or `from_step(start_step)`
    (positions itself). Give exactly one."""

    dataset: tf.data.Dataset | None = None
    from_step: Callable[[int], tf.data.Dataset] | None = None
    service: DataService | None = None  # Where the pipeline runs: a tf.data service (None: here).

    def __post_init__(self) -> None:
        _exactly_one("GlobalBatches", dataset=self.dataset, from_step=self.from_step)
        if self.dataset is not None and not isinstance(self.dataset, tf.data.Dataset):
            raise UserError(
                f"GlobalBatches(dataset=) takes a tf.data.Dataset, got {type(self.dataset).__name__}"
            )
        _check_service("GlobalBatches", self.service)


@dataclasses.dataclass(frozen=True)
class PerReplicaBatches:
    """One input pipeline's per-replica batches: `fn(input_context)` (skipped forward on
    resume) or `from_step(input_context, start_step)` (positions itself). Give exactly one."""

    fn: Callable[[tf.distribute.InputContext], tf.data.Dataset] | None = None
    from_step: Callable[[tf.distribute.InputContext, int], tf.data.Dataset] | None = None
    service: DataService | None = None  # Where the pipelines run: a tf.data service (None: here).

    def __post_init__(self) -> None:
        _exactly_one("PerReplicaBatches", fn=self.fn, from_step=self.from_step)
        _check_service("PerReplicaBatches", self.service)


DataForm: TypeAlias = GlobalBatches | PerReplicaBatches


class DataPosition(tf.Module):
    """Where the training stream stands apart from the global step, checkpointed with it.

    Global step k (the (k+1)-th update) trains on stream position `k + offset`:
    `offset` counts the batches skipped after loss spikes, `rollbacks` the
    rollbacks that skipped them (`engine.loop.rollback`). Both are part of the
    checkpoint, so a resume after a rollback reads the same batches.
    """

    def __init__(self) -> None:
        super().__init__(name="data_position")
        self.offset = tf.Variable(0, dtype=tf.int64, trainable=False, name="offset")
        self.rollbacks = tf.Variable(0, dtype=tf.int64, trainable=False, name="rollbacks")

    def at(self, step: int) -> int:
        """The stream position of global step `step`."""
        return step + int(self.offset.numpy())


def _exactly_one(form: str, **given: Any) -> None:
    named = [name for name, value in given.items() if value is not None]
    if len(named) != 1:
        raise UserError(f"{form} takes exactly one of {', '.join(f'{n}=' for n in given)}; got {len(named)}")


def _check_service(form: str, service: Any) -> None:
    if service is not None and not isinstance(service, DataService):
        raise UserError(
            f"{form}(service=) takes an engine.DataService(address=...), got {type(service).__name__}"
        )


def with_service(data: Any, service: DataService | None, *, what: str = "train_data") -> DataForm:
    """`data` as its declared form (`as_train_form`), its pipelines run by `service` (None: here)."""
    return dataclasses.replace(as_train_form(data, what=what), service=service)


def through_service(dataset: tf.data.Dataset, service: DataService, *, position: int) -> tf.data.Dataset:
    """`dataset` (one pipeline, positioned at stream `position`) run by the service's data workers.

    The whole positioned pipeline travels to the workers, so each worker starts at `position`
    itself: no batch is read here only to be dropped. A named job gets the position in its name,
    so that a resumed run (or a rollback) starts a job of its own instead of joining the old one's
    stream where it stood; its hosts, all at the same position, share it, each batch going to one
    of them, so tf.distribute must not shard it again.
    """
    job_name = None if service.job_name is None else f"{service.job_name}_at_{position}"
    served = dataset.apply(
        tf.data.experimental.service.distribute(
            processing_mode=service.processing_mode, service=service.target, job_name=job_name
        )
    )
    if job_name is None:
        return served
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return served.with_options(options)


def service_resume_note(service: DataService, position: int) -> str:
    """What reading from `service` at stream `position` (> 0: a resume or a rollback) means, in one
    line: the workers start at the position, which is exact with one worker and not with several."""
    if service.processing_mode == "parallel_epochs":
        several = (
            "with N workers each runs the whole stream from there and the run reads them in the order they "
            "answer (a seeded pipeline's batches then come N times; the batches after the resume are not "
            "the uninterrupted run's)"
        )
    else:
        several = (
            "with N workers each skips that many of its own batches, so up to N times as many of this epoch "
            "are never trained"
        )
    return (
        f"input from the {service.describe()} starts at the batches of step {position}: every data worker "
        f"skips the earlier ones itself; exact with one data worker, not with several: {several}"
    )


def steps_to_elements(input_context: tf.distribute.InputContext, steps: int) -> int:
    """How many elements of one per-replica pipeline `steps` global steps consume:
    every step takes one per-replica batch for each replica the pipeline feeds."""
    replicas_per_pipeline = input_context.num_replicas_in_sync // max(input_context.num_input_pipelines, 1)
    return steps * max(replicas_per_pipeline, 1)


def _required_parameters(fn: Callable) -> list[str] | None:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    return [
        p.name
        for p in parameters
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]


def as_train_form(data: Any, *, what: str = "train_data") -> DataForm:
    """`data` as a declared form (see the module docstring), or a UserError saying how to declare it."""
    if isinstance(data, (GlobalBatches, PerReplicaBatches)):
        return data
    if isinstance(data, tf.data.Dataset):
        return GlobalBatches(dataset=data)
    if not callable(data):
        raise UserError(
            f"{what} must be a tf.data.Dataset, a function or one of engine.GlobalBatches, "
            f"engine.PerReplicaBatches, engine.ResidentData; got {type(data).__name__}"
        )
    names = _required_parameters(data)
    if names == ["start_step"]:
        return GlobalBatches(from_step=data)
    if names is not None and len(names) == 2 and names[1] == "start_step":
        return PerReplicaBatches(from_step=data)
    if names is not None and len(names) == 1 and "step" not in names[0].lower():
        return PerReplicaBatches(fn=data)
    signature = f"({', '.join(names)})" if names is not None else "(?)"
    raise UserError(
        f"{what}={getattr(data, '__name__', type(data).__name__)}{signature}: cannot tell its data form; "
        "declare it: engine.PerReplicaBatches(fn=f) for f(input_context), "
        "engine.PerReplicaBatches(from_step=f) for f(input_context, start_step), "
        "engine.GlobalBatches(from_step=f) for f(start_step) of global batches"
    )


def yields_global_batches(form: DataForm) -> bool:
    return isinstance(form, GlobalBatches)


def pipeline_at(
    form: DataForm, input_context: tf.distribute.InputContext, *, start_step: int
) -> tf.data.Dataset:
    """One input pipeline of `form`, positioned at global step `start_step`."""
    if isinstance(form, GlobalBatches):
        if form.from_step is not None:
            return form.from_step(start_step)
        assert form.dataset is not None, "checked by GlobalBatches"
        return form.dataset.skip(start_step)
    if form.from_step is not None:
        return form.from_step(input_context, start_step)
    assert form.fn is not None, "checked by PerReplicaBatches"
    return form.fn(input_context).skip(steps_to_elements(input_context, start_step))


def distribute_train_data(
    strategy: tf.distribute.Strategy, form: DataForm, *, start_step: int
) -> tf.distribute.DistributedDataset:
    """Distributes training data positioned at global step `start_step`."""
    if isinstance(form, GlobalBatches):
        return strategy.experimental_distribute_dataset(
            _served_pipeline_at(form, tf.distribute.InputContext(), start_step=start_step)
        )
    return strategy.distribute_datasets_from_function(
        lambda input_context: _served_pipeline_at(form, input_context, start_step=start_step)
    )


def _served_pipeline_at(
    form: DataForm, input_context: tf.distribute.InputContext, *, start_step: int
) -> tf.data.Dataset:
    """`pipeline_at`, run by the form's data service if it names one: after the user's whole
    pipeline (batched as the form says) and its positioning, before tf.distribute splits the
    batches among the replicas (`through_service`)."""
    pipeline = pipeline_at(form, input_context, start_step=start_step)
    if form.service is None:
        return pipeline
    return through_service(pipeline, form.service, position=start_step)


def as_eval_form(data: Any) -> DataForm:
    """Eval data: global batches (`Dataset`) or `fn(input_context)` of per-replica batches, read once."""
    form = as_train_form(data, what="eval_data")
    if form.service is not None:
        raise UserError(
            "eval_data is read by the training process itself: pass it without service= "
            "(the tf.data service feeds train_data)"
        )
    if form.from_step is not None:
        raise UserError(
            "eval_data is read whole from its start at every evaluation: pass a tf.data.Dataset "
            "or fn(input_context), not a function of start_step"
        )
    return form


def element_spec(strategy: tf.distribute.Strategy, data: DataForm) -> Any:
    """The batches' element spec: the dataset's own, or that of one pipeline of a function form
    (built here once, not iterated: building a tf.data pipeline reads nothing)."""
    if isinstance(data, GlobalBatches) and data.dataset is not None:
        return data.dataset.element_spec
    context = tf.distribute.InputContext(num_replicas_in_sync=strategy.num_replicas_in_sync)
    return pipeline_at(data, context, start_step=0).element_spec


def distribute_eval_data(strategy: tf.distribute.Strategy, form: DataForm) -> tf.distribute.DistributedDataset:
    """Distributes a finite eval set; partial and empty batches are kept."""
    if isinstance(form, GlobalBatches):
        return strategy.experimental_distribute_dataset(form.dataset)
    assert form.fn is not None, "as_eval_form refuses from_step"
    return strategy.distribute_datasets_from_function(form.fn)


def eval_dataset_on_one_replica(form: DataForm) -> tf.data.Dataset:
    """The whole eval set as global batches on one replica (the parameter-server coordinator)."""
    if isinstance(form, GlobalBatches):
        assert form.dataset is not None, "as_eval_form refuses from_step"
        return form.dataset
    assert form.fn is not None, "as_eval_form refuses from_step"
    return form.fn(tf.distribute.InputContext())
