"""A model variable that tf.train.Checkpoint cannot reach is refused before anything is written."""

import keras
import numpy as np
import pytest
from helpers import NUM_CLASSES, NUM_FEATURES, make_trainer, small_trainer

import engine


class ListedStatistics(keras.layers.Layer):
    """A kernel, and a running mean of its inputs kept in a list: the optimizer's checkpoint
    entry reaches the trainable kernel, but nothing reaches the mean."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(NUM_FEATURES, NUM_CLASSES), name="kernel")
        mean = self.add_weight(shape=(NUM_FEATURES,), initializer="zeros", trainable=False, name="mean")
        self.statistics = [mean]

    def call(self, x, training=False):
        if training:
            self.statistics[0].assign(0.9 * self.statistics[0] + 0.1 * keras.ops.mean(x, axis=0))
        return (x - self.statistics[0]) @ self.kernel


class AttributeStatistics(ListedStatistics):
    """The same variables, each on an attribute of its layer: saved."""

    def build(self, input_shape):
        super().build(input_shape)
        self.mean = self.statistics[0]


def model_of(strategy, layer):
    with strategy.scope():
        model = keras.Sequential([keras.Input((NUM_FEATURES,)), layer], name="model")
        optimizer = keras.optimizers.SGD(0.1)
    return model, optimizer


def test_a_layer_keeping_variables_in_a_list_is_refused_before_the_model_dir_is_written(default, tmp_path):
    model, optimizer = model_of(default, ListedStatistics(name="listed"))
    model_dir = tmp_path / "run"
    with pytest.raises(engine.UserError, match="would be left out of its checkpoints") as raised:
        small_trainer(model_dir, model=model, optimizer=optimizer)
    message = str(raised.value)
    named = message.split("would")[0]
    assert "'model/listed/mean'" in named and "kernel" not in named  # The optimizer saves the kernel.
    assert "setattr" in message and "\n" not in message
    assert not model_dir.exists()
    make_trainer(model=model, optimizer=optimizer).train(2)  # Without a model_dir nothing is lost: it trains.


def test_variables_on_attributes_are_saved_and_resume(default, tmp_path):
    model, optimizer = model_of(default, AttributeStatistics())
    small_trainer(tmp_path, model=model, optimizer=optimizer).train(4)
    fresh, fresh_optimizer = model_of(default, AttributeStatistics())
    resumed = small_trainer(tmp_path, model=fresh, optimizer=fresh_optimizer)
    assert resumed.step == 4
    for saved, restored in zip(model.get_weights(), fresh.get_weights(), strict=True):
        np.testing.assert_array_equal(saved, restored)
