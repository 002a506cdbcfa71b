"""The catalogue of model forms the conformance suite runs through the engine and through
Keras (tests/unit/loop/test_conformance.py), and the subprocess that resumes them (its `__main__`).

Each form is what a user builds: the Keras model, its data (numpy, nested as the model
takes it), the loss as `compile` takes it and as the engine takes it (the same Keras loss
with `reduction=None`), loss weights and metrics. A form says where Keras itself is not
the reference and why (`fit_replicas`), and which comparisons cannot hold by their nature
(`accumulates`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np

GLOBAL_BATCH = 8
TRAIN_STEPS = 4
NUM_TRAIN = GLOBAL_BATCH * TRAIN_STEPS
# Two full eval batches and one of a single example: on two replicas the last batch leaves
# replica 1 empty, which every layer must survive and every count must see.
NUM_EVAL = 2 * GLOBAL_BATCH + 1
SEED = 7
CLASSES = 3
VOCAB, TOKENS = 12, 6


def sce() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def mse() -> keras.losses.Loss:
    return keras.losses.MeanSquaredError()


def per_element(loss: keras.losses.Loss) -> keras.losses.Loss:
    """The same Keras loss, unreduced: what the engine takes."""
    config = loss.get_config()
    config["reduction"] = None
    return type(loss).from_config(config)


def accuracy() -> list[keras.metrics.Metric]:
    return [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]


class MeanMaxLogit(keras.metrics.Metric):
    """A user's own metric (state of its own, an __init__ argument, get_config)."""

    def __init__(self, scale: float = 1.0, name: str = "mean_max_logit", **kwargs: Any):
        super().__init__(name=name, **kwargs)
        self.scale = scale
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        values = keras.ops.max(y_pred, axis=-1) * self.scale
        self.total.assign_add(keras.ops.sum(values))
        self.count.assign_add(keras.ops.cast(keras.ops.shape(values)[0], "float32"))

    def result(self) -> Any:
        return keras.ops.divide_no_nan(self.total, self.count)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "scale": self.scale}


@dataclass(frozen=True)
class Form:
    name: str
    build: Callable[[], keras.Model]
    data: Callable[[int, int], tuple]  # (examples, seed) -> (x, y) or (x, y, sample_weight)
    loss: Callable[[], Any]  # As compile() takes it: a Keras loss, or nested like the outputs.
    loss_weights: Any = None
    metrics: Callable[[], list] = list
    weighted_metrics: Callable[[], list] = list
    # Replicas of the Keras fit the engine is compared with: None, the engine's own count; 1
    # where Keras is not the same across replicas and the engine is (the reason in `note`).
    fit_replicas: int | None = None
    # Whether accumulating gradients over micro-batches equals one large batch: not for layers
    # whose forward pass depends on the batch (random draws per call, batch statistics).
    accumulates: bool = True
    note: str = ""
    learning_rate: float = 0.1
    optimizer: str = "sgd"
    train_steps: int = TRAIN_STEPS  # Fewer where later steps are chaotic (the reason in `note`).
    slow: bool = False
    extra: dict = field(default_factory=dict)

    def engine_loss(self) -> Any:
        loss = self.loss()
        if isinstance(loss, dict):
            return {key: per_element(value) for key, value in loss.items()}
        if isinstance(loss, (list, tuple)):
            return [per_element(value) for value in loss]
        return per_element(loss)

    def make_optimizer(self) -> keras.optimizers.Optimizer:
        if self.optimizer == "adam":
            return keras.optimizers.Adam(self.learning_rate)
        return keras.optimizers.SGD(self.learning_rate, momentum=0.5)

    def model(self) -> keras.Model:
        """The model, each build starting from the same weights and seeds."""
        keras.utils.set_random_seed(SEED)
        return self.build()


# ------------------------------------------------------------------ data


def features(n: int, seed: int, shape: tuple[int, ...] = (6,)) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, *shape)).astype("float32")


def classes_of(x: np.ndarray) -> np.ndarray:
    flat = x.reshape(len(x), -1)
    return (np.floor(flat[:, 0] * 2) % CLASSES).astype("int32")


def table(n: int, seed: int) -> tuple:
    x = features(n, seed)
    return x, classes_of(x)


def weighted_table(n: int, seed: int) -> tuple:
    x, y = table(n, seed)
    return x, y, np.random.default_rng(seed + 1).uniform(0.0, 2.0, size=n).astype("float32")


def images(n: int, seed: int) -> tuple:
    x = features(n, seed, (8, 8, 2))
    return x, classes_of(x)


def tokens(n: int, seed: int) -> tuple:
    """Padded sequences (0 is padding, lengths 1..TOKENS) with a label per token."""
    rng = np.random.default_rng(seed)
    x = rng.integers(1, VOCAB, size=(n, TOKENS)).astype("int32")
    lengths = rng.integers(1, TOKENS + 1, size=n)
    for row, length in enumerate(lengths):
        x[row, length:] = 0
    y = ((x + np.roll(x, 1, axis=1)) % CLASSES).astype("int32")
    return x, y


def two_tables(n: int, seed: int) -> tuple:
    a, b = features(n, seed), features(n, seed + 1, (4,))
    return (a, b), (classes_of(a), (a[:, :1] - b[:, :1]).astype("float32"))


def two_tables_dict(n: int, seed: int) -> tuple:
    (a, b), (cls, value) = two_tables(n, seed)
    return {"a": a, "b": b}, {"cls": cls, "value": value}


def pairs(n: int, seed: int) -> tuple:
    a, b = features(n, seed), features(n, seed + 1)
    return (a, b), classes_of(a - b)


def small_images(n: int, seed: int) -> tuple:
    x = features(n, seed, (32, 32, 3))
    return x, classes_of(x)


# ------------------------------------------------------------------ models


def dense() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(16, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3)),
            keras.layers.Dense(CLASSES),
        ]
    )


def conv() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((8, 8, 2)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(CLASSES),
        ]
    )


def dropout() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dropout(0.3),
            keras.layers.GaussianNoise(0.2),
            keras.layers.GaussianDropout(0.2),
            keras.layers.AlphaDropout(0.1),
            keras.layers.Dense(CLASSES),
        ]
    )


def spatial_dropout() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((8, 8, 2)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.SpatialDropout2D(0.3),
            keras.layers.Flatten(),
            keras.layers.Dense(CLASSES),
        ]
    )


def augmented() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((8, 8, 2)),
            keras.layers.RandomFlip(),
            keras.layers.RandomTranslation(0.2, 0.2),
            keras.layers.RandomZoom(0.2),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(CLASSES),
        ]
    )


def batch_norm(synchronized: bool) -> Callable[[], keras.Model]:
    def build() -> keras.Model:
        return keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(16),
                keras.layers.BatchNormalization(synchronized=synchronized, momentum=0.5),
                keras.layers.Activation("relu"),
                keras.layers.Dense(CLASSES),
            ]
        )

    return build


def conv_batch_norm() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((8, 8, 2)),
            keras.layers.Conv2D(4, 3),
            keras.layers.BatchNormalization(momentum=0.5),
            keras.layers.Activation("relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(CLASSES),
        ]
    )


def layer_norm() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(16),
            keras.layers.LayerNormalization(),
            keras.layers.Activation("relu"),
            keras.layers.Dense(CLASSES),
        ]
    )


def masked_recurrent(layer: type) -> Callable[[], keras.Model]:
    def build() -> keras.Model:
        inputs = keras.Input((TOKENS,), dtype="int32")
        hidden = keras.layers.Embedding(VOCAB, 8, mask_zero=True)(inputs)
        hidden = layer(8, return_sequences=True)(hidden)
        return keras.Model(inputs, keras.layers.Dense(CLASSES)(hidden))

    return build


def masked_attention() -> keras.Model:
    inputs = keras.Input((TOKENS,), dtype="int32")
    hidden = keras.layers.Embedding(VOCAB, 8, mask_zero=True)(inputs)
    attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(hidden, hidden)
    hidden = keras.layers.LayerNormalization()(keras.layers.Add()([hidden, attended]))
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(hidden))


def two_headed_list() -> keras.Model:
    a, b = keras.Input((6,), name="a"), keras.Input((4,), name="b")
    hidden = keras.layers.Dense(16, activation="relu")(keras.layers.Concatenate()([a, b]))
    return keras.Model([a, b], [keras.layers.Dense(CLASSES)(hidden), keras.layers.Dense(1)(hidden)])


def two_headed_dict() -> keras.Model:
    a, b = keras.Input((6,), name="a"), keras.Input((4,), name="b")
    hidden = keras.layers.Dense(16, activation="relu")(keras.layers.Concatenate()([a, b]))
    outputs = {
        "cls": keras.layers.Dense(CLASSES, name="cls")(hidden),
        "value": keras.layers.Dense(1, name="value")(hidden),
    }
    return keras.Model({"a": a, "b": b}, outputs)


def shared_tower() -> keras.Model:
    a, b = keras.Input((6,)), keras.Input((6,))
    tower = keras.layers.Dense(8, activation="tanh")
    joined = keras.layers.Subtract()([tower(a), tower(b)])
    return keras.Model([a, b], keras.layers.Dense(CLASSES)(joined))


def mobilenet() -> keras.Model:
    """MobileNetV3Small at the smallest input it takes (32x32), whole: its squeeze-and-excite
    gates and hard-swish are what no other form has (the minimalistic form, a quarter cheaper,
    drops both)."""
    return keras.applications.MobileNetV3Small(
        input_shape=(32, 32, 3), weights=None, classes=CLASSES, classifier_activation=None, minimalistic=False
    )


RANDOM = "random draws depend on each call's (micro-)batch shape"
BATCH_STATS = "batch statistics of a micro-batch are not those of the whole batch"
PER_REPLICA_TOKENS = (
    "Keras fit divides each replica's batch by its own token count and averages the replicas; the engine "
    "divides by the global batch's, so it equals fit on ONE replica"
)

FORMS = [
    Form("dense", dense, table, sce, metrics=accuracy),
    Form(
        "dense_sample_weights",
        dense,
        weighted_table,
        sce,
        weighted_metrics=lambda: [keras.metrics.SparseCategoricalAccuracy(name="weighted_accuracy")],
    ),
    Form("conv", conv, images, sce, metrics=accuracy, optimizer="adam", learning_rate=0.01),
    Form("dropout", dropout, table, sce, metrics=accuracy, accumulates=False, note=RANDOM),
    Form("spatial_dropout", spatial_dropout, images, sce, accumulates=False, note=RANDOM),
    Form("augmentation", augmented, images, sce, accumulates=False, note=RANDOM),
    Form(
        "batch_norm",
        batch_norm(False),
        table,
        sce,
        metrics=accuracy,
        accumulates=False,
        note=f"{BATCH_STATS}; the moving statistics are compared with the mean of fit's replica copies",
    ),
    Form("batch_norm_synchronized", batch_norm(True), table, sce, accumulates=False, note=BATCH_STATS),
    Form("conv_batch_norm", conv_batch_norm, images, sce, accumulates=False, note=BATCH_STATS),
    Form("layer_norm", layer_norm, table, sce, metrics=accuracy),
    Form(
        "masked_lstm",
        masked_recurrent(keras.layers.LSTM),
        tokens,
        sce,
        metrics=accuracy,
        fit_replicas=1,
        note=PER_REPLICA_TOKENS,
    ),
    Form(
        "masked_gru",
        masked_recurrent(keras.layers.GRU),
        tokens,
        sce,
        metrics=accuracy,
        fit_replicas=1,
        note=PER_REPLICA_TOKENS,
    ),
    Form(
        "masked_attention",
        masked_attention,
        tokens,
        sce,
        metrics=accuracy,
        fit_replicas=1,
        note=PER_REPLICA_TOKENS,
        optimizer="adam",
        learning_rate=0.01,
    ),
    Form("two_outputs_list", two_headed_list, two_tables, lambda: [sce(), mse()], loss_weights=[1.0, 0.5]),
    Form(
        "two_outputs_dict",
        two_headed_dict,
        two_tables_dict,
        lambda: {"cls": sce(), "value": mse()},
        loss_weights={"cls": 0.3, "value": 2.0},
    ),
    Form("shared_layers", shared_tower, pairs, sce, metrics=lambda: [MeanMaxLogit(scale=2.0)]),
    Form(
        "mobilenet_v3_small",
        mobilenet,
        small_images,
        sce,
        accumulates=False,
        note=(
            f"{BATCH_STATS}; Dropout. One step: on two replicas a BatchNormalization over 4 examples of 1x1 "
            "maps (the last blocks at 32x32) multiplies rounding differences ~30x a step; after step 1 the "
            "weights equal fit's to 1e-6, after step 2 they differ at 4e-5, after step 4 at 0.1"
        ),
        slow=True,
        learning_rate=0.01,
        train_steps=1,
    ),
]
BY_NAME = {form.name: form for form in FORMS}


# The forms whose state a resume must carry: random state (augmentation), replica-local
# statistics (batch_norm), masks with an Embedding's sparse gradients and momentum
# (masked_attention), several outputs as a dict. Dropout, a masked GRU and two heads as a
# list resume after kill -9 from the command line (test_fault_tolerance); plain weights and
# Adam's slots in the resume tests of test_fault_tolerance and test_keras_parity.
RESUMED = ("augmentation", "batch_norm", "masked_attention", "two_outputs_dict")


def trained_weights(form: Form, strategy: Any, steps: int, model_dir: str | None) -> list[np.ndarray]:
    """Every variable of the form's model (random state included) after training to `steps`
    with the engine, two steps a loop, checkpoints in `model_dir`."""
    import tensorflow as tf
    from helpers import make_trainer

    import engine

    with strategy.scope():
        model = form.model()
        optimizer = form.make_optimizer()
    x, y, *weights = form.data(NUM_TRAIN, SEED)
    arrays = (x, y, *weights)
    as_tuples = lambda v: tuple(v) if isinstance(v, list) else v  # noqa: E731
    trainer = make_trainer(
        strategy,
        model=model,
        optimizer=optimizer,
        train_data=tf.data.Dataset.from_tensor_slices(tuple(as_tuples(a) for a in arrays)).batch(GLOBAL_BATCH),
        global_batch_size=GLOBAL_BATCH,
        loss_fn=form.engine_loss(),
        loss_weights=form.loss_weights,
        cadence=engine.Cadence(steps_per_loop=2),
        model_dir=model_dir,
    )
    trainer.train(steps)
    trainer.close()
    return [np.asarray(tf.convert_to_tensor(v)) for v in engine.variables.all_variables(model)]


def train_half(root: str, strategy: Any) -> None:
    """Each RESUMED form trained to step 2 in `root`/<form>, and its uninterrupted run to
    TRAIN_STEPS (no checkpoints), saved as `root`/<form>.whole.npz. The conformance test runs
    this in its own process (one interpreter and TensorFlow start fewer) and the resume in a new
    one."""
    for name in RESUMED:
        form = BY_NAME[name]
        np.savez(f"{root}/{name}.whole.npz", *trained_weights(form, strategy, TRAIN_STEPS, None))
        trained_weights(form, strategy, 2, f"{root}/{name}")


def main(argv: list[str]) -> None:
    """`conformance_forms.py half DIR`: `train_half(DIR)`; `... resume DIR` resumes DIR/<form>
    to TRAIN_STEPS in this new process (DIR/<form>.resumed.npz). Two replicas, as the suite's
    processes have them."""
    import engine

    engine.configure_cpu_devices(2)
    strategy = engine.build_strategy("mirrored", cpu_devices=2)
    what, root = argv
    if what == "half":
        train_half(root, strategy)
        return
    for name in RESUMED:
        model_dir = f"{root}/{name}"
        np.savez(f"{root}/{name}.resumed.npz", *trained_weights(BY_NAME[name], strategy, TRAIN_STEPS, model_dir))


if __name__ == "__main__":
    main(sys.argv[1:])
