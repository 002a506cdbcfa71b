"""Model zoo: every model builds, outputs float32 logits (also under a mixed
policy), and FLOPs are counted as by hand."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from models import ModelSpec, flops_per_example, get_model_spec, model_names

SMALL_MODELS = [name for name in model_names() if name != "resnet50"]
IMAGE_MODELS = [name for name in SMALL_MODELS if name != "wide_deep"]  # wide_deep reads numbers, then ids.


@pytest.fixture(params=["float32", "mixed_bfloat16"])
def policy(request: pytest.FixtureRequest):
    """Build under a global policy, always restoring float32 afterwards."""
    keras.mixed_precision.set_global_policy(request.param)
    try:
        yield request.param
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _check_logits(model: keras.Model, input_shape: tuple[int, ...], policy: str) -> None:
    batch = np.random.RandomState(0).rand(2, *input_shape).astype(np.float32)
    logits = model(batch, training=False)
    assert tuple(logits.shape) == (2, 10)
    assert logits.dtype == "float32"
    head = model.layers[-1]
    assert isinstance(head, keras.layers.Dense)
    assert head.activation is keras.activations.linear, "logits, not softmax"
    assert head.compute_dtype == "float32"
    # The rest of the model really runs in the policy's compute dtype.
    expected = "bfloat16" if policy == "mixed_bfloat16" else "float32"
    assert model.layers[1].compute_dtype == expected
    assert np.all(np.isfinite(logits))


@pytest.mark.parametrize("name", SMALL_MODELS)
def test_small_models_map_a_batch_to_float32_logits(name: str, policy: str) -> None:
    spec = get_model_spec(name)
    model = spec.build(spec.default_input_shape, 10)
    _check_logits(model, spec.default_input_shape, policy)


def test_resnet50_builds_offline_with_float32_logits_under_bfloat16() -> None:
    # Built once only (23.6M parameters); the mixed policy is the harder case.
    spec = get_model_spec("resnet50")
    assert spec.default_input_shape == (224, 224, 3)
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = spec.build(spec.default_input_shape, 10)
        _check_logits(model, spec.default_input_shape, "mixed_bfloat16")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert model.count_params() == 23_608_202  # 23,587,712 backbone + 2048*10+10 head


def test_models_accept_other_input_shapes_and_class_counts() -> None:
    for name in IMAGE_MODELS:
        model = get_model_spec(name).build((32, 32, 3), 7)
        assert tuple(model.output.shape) == (None, 7), name
    assert tuple(get_model_spec("wide_deep").build((4 + 9,), 7).output.shape) == (None, 7)
    with pytest.raises(
        ValueError, match=r"wide_deep reads rows of 4 numbers then ids .* not examples of shape \(32, 32, 3\)"
    ):
        get_model_spec("wide_deep").build((32, 32, 3), 7)


def test_registry_lists_models_and_rejects_unknown_names() -> None:
    assert model_names() == ["cnn", "mlp", "resnet", "resnet50", "wide_deep", "wide_mlp"]
    spec = get_model_spec("cnn")
    assert isinstance(spec, ModelSpec) and spec.default_input_shape == (28, 28, 1)
    with pytest.raises(ValueError) as error:
        get_model_spec("vgg")
    assert str(error.value) == (
        "unknown model 'vgg'; choose one of: cnn, mlp, resnet, resnet50, wide_deep, wide_mlp"
    )


def test_cnn_flops_match_hand_count() -> None:
    model = get_model_spec("cnn").build((28, 28, 1), 10)
    macs = (
        26 * 26 * 32 * (3 * 3 * 1)  # conv1: 28->26, 32 filters of 3x3x1
        + 11 * 11 * 64 * (3 * 3 * 32)  # conv2 after pool 26->13: 13->11, 64 of 3x3x32
        + (5 * 5 * 64) * 64  # dense on the 5x5x64 flattened map after pool 11->5
        + 64 * 10  # logits
    )
    assert flops_per_example(model) == 2 * macs == 5_056_000


def test_flops_count_dense_per_position_and_depthwise_convs() -> None:
    inputs = keras.Input(shape=(6, 6, 4))
    x = keras.layers.DepthwiseConv2D(3, depth_multiplier=2)(inputs)  # 4x4x8 out
    x = keras.layers.Dense(5)(x)  # applied at 4x4 positions
    model = keras.Model(inputs, x)
    macs = 4 * 4 * (3 * 3 * 4 * 2) + 4 * 4 * (8 * 5)
    assert flops_per_example(model) == 2 * macs
