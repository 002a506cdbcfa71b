"""The start-up log's model description: Keras's summary, or a tf.Module's variables."""

import re

import keras
import tensorflow as tf

from engine.cli.run.model_summary import model_summary
from models import get_model_spec


def test_a_keras_model_is_described_by_its_own_summary():
    text = model_summary(get_model_spec("cnn").build((28, 28, 1), 10))
    assert 'Model: "cnn"' in text
    # Keras numbers a default layer name when the process made one before (conv2d_3): any number.
    assert (
        re.search(r"conv2d(_\d+)? \(Conv2D\)", text)
        and "(None, 26, 26, 32)" in text
        and "logits (Dense)" in text
    )
    assert "Total params: 121,930" in text


class Research(tf.Module):
    def __init__(self):
        self.w = tf.Variable(tf.zeros([6, 3]), name="w")
        self.steps = tf.Variable(0, trainable=False, name="steps")
        self.head = keras.layers.Dense(2, name="head")
        self.head.build((None, 3))


def test_a_tf_module_lists_its_variables_and_their_count():
    text = model_summary(Research())
    lines = text.splitlines()
    assert lines[0] == "Research (tf.Module): 4 variables"
    assert any(line.split()[:1] == ["w"] and "(6, 3)" in line and "float32" in line for line in lines)
    assert any(line.split()[:1] == ["steps"] and "int32" in line for line in lines)
    assert any(
        line.split()[:1] == ["head/kernel"] and "(3, 2)" in line for line in lines
    )  # A Keras layer inside.
    assert lines[-1] == " Total params: 27 (trainable: 26)"
