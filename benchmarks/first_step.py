r"""Time to the first steps: where a fresh process's time goes before it trains, the engine's
first compiled loop against Keras `fit`'s first steps on the same model, data and batch.

    python -m benchmarks.first_step --model=cnn --steps=50 --repeats=3 --json=benchmarks/out/first_step.json

Each measurement is a fresh process (tracing, compiling and TensorFlow's own first-use
costs are what is measured, so nothing may be warm), the runners alternating. A process
reports, in seconds from its own start:

- `import_s`: TensorFlow, Keras and the engine imported;
- `build_s`: the model and Adam built, the data made ready (the engine: the in-memory
  synthetic split kept on the device, as the command line does; `fit`: its tf.data stream);
- `first_s`: the first `--steps` steps: `trainer.train` with one compiled loop of them,
  against `model.fit` of one epoch with `steps_per_execution` the same: tracing, compiling
  and the steps;
- `second_s`: the next `--steps` steps, traced already: `first_s - second_s` is the cost
  of the first call (`first_call_s`);
- `traces`: how often the engine traced its training loop (1: traced once).

Prints one JSON object: the medians of each runner and `first_ratio` (engine's `first_s`
over `fit`'s; at most 1.0 is the target) and `first_call_ratio` (the same for the cost of
the first call alone).
"""

from __future__ import annotations

import statistics

from absl import app, flags

from benchmarks.fresh_process import measure_in_fresh_process, report

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The flags, defined when run as a program: the test imports this module beside others' flags."""
    flags.DEFINE_string("model", "cnn", "Model name from the models registry.")
    flags.DEFINE_integer("steps", 50, "Steps of the first loop (and of the second).")
    flags.DEFINE_integer("global_batch_size", 64, "Global batch size.")
    flags.DEFINE_integer("repeats", 3, "Processes of each runner, alternating.")
    flags.DEFINE_string("json", None, "Also write the result here.")


RUNNERS = ("engine", "fit")

# One measurement, in a process of its own: argv = runner, model, steps, global batch size.
_MEASURE = """
import json, sys, time
began = time.perf_counter()
runner, model_name, steps, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
import keras, tensorflow as tf
import engine
from input import get_data_source
from models.registry import get_model_spec
phases = {"import_s": time.perf_counter() - began}
keras.utils.set_random_seed(0)
spec = get_model_spec(model_name)
source = get_data_source("synthetic", image_shape=spec.default_input_shape, num_classes=10)
model = spec.build(spec.default_input_shape, 10)
optimizer = keras.optimizers.Adam(1e-3)
metrics = [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]
if runner == "engine":
    from engine.cli.config.settings import DEFAULT_DEVICE_DATA_MB
    from engine.cli.run.job import resident_train_data
    def streamed(input_context, start_step):
        return source.train_dataset(
            global_batch_size=batch, seed=0, start_step=start_step, input_context=input_context
        )
    strategy = engine.build_strategy("default")
    data = resident_train_data(source, global_batch_size=batch, seed=0, device_data_mb=DEFAULT_DEVICE_DATA_MB,
                               host_data=streamed) or streamed
    trainer = engine.Trainer(
        strategy=strategy, model=model, optimizer=optimizer, train_data=data, global_batch_size=batch,
        loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None), metrics=metrics,
        cadence=engine.Cadence(steps_per_loop=steps),
    )
    def train(target): trainer.train(target)
else:
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=metrics, steps_per_execution=steps)
    dataset = source.train_dataset(global_batch_size=batch, seed=0)
    def train(target): model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)
phases["build_s"] = time.perf_counter() - began
mark = time.perf_counter()
train(steps)
phases["first_s"] = time.perf_counter() - mark
mark = time.perf_counter()
train(2 * steps)
phases["second_s"] = time.perf_counter() - mark
phases["first_call_s"] = phases["first_s"] - phases["second_s"]
if runner == "engine":
    phases["traces"] = trainer.train_loop.experimental_get_tracing_count()
print(json.dumps(phases))
"""


def measure(runner: str, model: str, steps: int, global_batch_size: int) -> dict[str, float]:
    return measure_in_fresh_process(_MEASURE, runner, model, str(steps), str(global_batch_size), timeout=900)


def summarize(runs: dict[str, list[dict[str, float]]]) -> dict[str, object]:
    """The medians of each runner's phases and the engine-over-fit ratios of the first steps."""
    medians = {
        runner: {key: round(statistics.median(run[key] for run in measured), 3) for key in measured[0]}
        for runner, measured in runs.items()
    }
    engine, fit = medians["engine"], medians["fit"]
    return {
        **medians,
        "first_ratio": round(engine["first_s"] / fit["first_s"], 2),
        "first_call_ratio": round(engine["first_call_s"] / max(fit["first_call_s"], 1e-3), 2),
    }


def main(argv: list[str]) -> None:
    del argv
    runs: dict[str, list[dict[str, float]]] = {runner: [] for runner in RUNNERS}
    for _ in range(FLAGS.repeats):
        for runner in RUNNERS:
            runs[runner].append(measure(runner, FLAGS.model, FLAGS.steps, FLAGS.global_batch_size))
    result = {"model": FLAGS.model, "steps": FLAGS.steps, "global_batch_size": FLAGS.global_batch_size}
    result.update(summarize(runs))
    report(result, FLAGS.json)


if __name__ == "__main__":
    define_flags()
    app.run(main)
