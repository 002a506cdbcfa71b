"""`models.Standardization`: a table's statistics inside the model, and still there after a
`tf.train.Checkpoint` restore (what eval and predict from a model_dir do), where Keras's
`Normalization` keeps computing with the statistics it had before the restore."""

import keras
import numpy as np
import tensorflow as tf

from models import Standardization, set_table_statistics, standardized


def _base(columns: int) -> keras.Model:
    inputs = keras.Input((columns,))
    return keras.Model(inputs, keras.layers.Dense(1, kernel_initializer="ones")(inputs), name="base")


def test_columns_are_standardized_and_outputs_scaled_back_by_the_training_statistics():
    features = np.array([[1.0, 5.0, 3.0], [3.0, 5.0, 7.0]], np.float32)  # The middle column is constant.
    labels = np.array([100.0, 300.0], np.float32)
    model = standardized(_base(3), (3,), outputs_too=True)
    set_table_statistics(model, features, labels)
    standardize = model.get_layer("standardize_features")
    np.testing.assert_array_equal(standardize(features), [[-1.0, 0.0, -1.0], [1.0, 0.0, 1.0]])
    # The base sums the standardized columns (-2 and 2); the output is scaled to the labels (mean 200, std 100).
    np.testing.assert_allclose(model(features), [[0.0], [400.0]])


def test_the_statistics_come_back_with_a_checkpoint_where_keras_normalization_loses_them(tmp_path):
    features = np.random.default_rng(0).normal(5.0, 3.0, size=(64, 4)).astype(np.float32)
    trained = standardized(_base(4), (4,), outputs_too=False)
    set_table_statistics(trained, features, None)
    path = tf.train.Checkpoint(model=trained).write(str(tmp_path / "ours"))
    rebuilt = standardized(_base(4), (4,), outputs_too=False)  # As predict rebuilds it: no data.
    tf.train.Checkpoint(model=rebuilt).read(path).assert_existing_objects_matched()
    np.testing.assert_array_equal(rebuilt(features), trained(features))

    # Why not keras.layers.Normalization: restored, its weights are right but not its output.
    adapted = keras.layers.Normalization()
    adapted.adapt(features)
    keras_path = tf.train.Checkpoint(layer=adapted).write(str(tmp_path / "keras"))
    fresh = keras.layers.Normalization()
    fresh.build((None, 4))
    tf.train.Checkpoint(layer=fresh).read(keras_path).assert_existing_objects_matched()
    np.testing.assert_array_equal(fresh.adapt_mean.numpy(), adapted.adapt_mean.numpy())
    assert not np.allclose(fresh(features), adapted(features))  # Still mean 0, variance 1.


def test_the_layer_serializes_with_its_direction():
    layer = Standardization(inverse=True, name="scale_outputs")
    copy = Standardization.from_config(layer.get_config())
    assert copy.inverse and copy.name == "scale_outputs" and copy.dtype == "float32"
