"""A model that does not fit the data is refused before the run writes anything:
one line naming both shapes, exit 2, the model_dir as it was."""

import textwrap

import pytest
from helpers import main_in_process, one_error_line, snapshot

MISFITS = """
import keras


def wrong_input(input_shape, num_classes):
    return keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Flatten(), keras.layers.Dense(num_classes)])


def flat_input(input_shape, num_classes):
    return keras.Sequential([keras.Input((784,)), keras.layers.Dense(num_classes)])


def two_outputs_one_narrow(input_shape, num_classes):
    images = keras.Input(input_shape)
    flat = keras.layers.Flatten()(images)
    return keras.Model(images, [keras.layers.Dense(num_classes)(flat), keras.layers.Dense(3)(flat)])


def per_pixel_logits(input_shape, num_classes):
    return keras.Sequential([keras.Input(input_shape), keras.layers.Dense(num_classes)])


class Narrow(keras.Model):
    def __init__(self, num_classes):
        super().__init__()
        self.flatten = keras.layers.Flatten()
        self.logits = keras.layers.Dense(num_classes)

    def call(self, images):
        return self.logits(self.flatten(images))[:, :3]


def subclassed_three_classes(input_shape, num_classes):
    model = Narrow(num_classes)
    model(keras.ops.zeros((1, *input_shape)))
    return model
"""

CASES = [
    (
        "wrong_input",
        "takes inputs of shape (None, 32, 32, 3) but the data's examples have shape (None, 28, 28, 1)",
    ),
    ("flat_input", "takes inputs of shape (None, 784) but the data's examples have shape (None, 28, 28, 1)"),
    # Several outputs train each against the labels (an auxiliary head): each must fit them.
    ("two_outputs_one_narrow", "outputs shape (None, 3); the data's labels need 10 outputs"),
    ("per_pixel_logits", "outputs shape (None, 28, 28, 10); the data's labels need 10 outputs"),
    ("subclassed_three_classes", "outputs shape (None, 3); the data's labels need 10 outputs"),
]


@pytest.mark.cli
@pytest.mark.parametrize("function,message", CASES, ids=[function for function, _ in CASES])
def test_a_misfit_model_is_refused_before_any_write(tmp_path, monkeypatch, function, message):
    (tmp_path / "misfit_nets.py").write_text(textwrap.dedent(MISFITS))
    monkeypatch.syspath_prepend(str(tmp_path))
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    (model_dir / "notes.txt").write_text("an earlier run's files")
    before = snapshot(model_dir)
    result = main_in_process(f"--model=misfit_nets:{function}", "--train_steps=3", f"--model_dir={model_dir}")
    line = one_error_line(result)
    assert f"--model=misfit_nets:{function}" in line and message in line, line
    assert snapshot(model_dir) == before
    assert sorted(p.name for p in model_dir.iterdir()) == ["notes.txt"]  # No settings, event file or lock.


@pytest.mark.cli
@pytest.mark.parametrize("mode", ["eval", "continuous_eval"])
def test_a_misfit_model_is_refused_by_the_evaluator_too(tmp_path, monkeypatch, mode):
    (tmp_path / "misfit_nets.py").write_text(textwrap.dedent(MISFITS))
    monkeypatch.syspath_prepend(str(tmp_path))
    model_dir = tmp_path / "run"
    if mode == "eval":  # Evaluates a trained model_dir (a misfit one could not have trained it).
        trained = main_in_process("--model=mlp", "--train_steps=2", "--mode=train", f"--model_dir={model_dir}")
        assert trained.returncode == 0, trained.stderr[-2000:]
        # As an older run's (its config.yaml would refuse another --model before the fit check).
        (model_dir / "config.yaml").unlink()
    else:
        model_dir.mkdir()
    (model_dir / "notes.txt").write_text("an earlier run's files")
    before = snapshot(model_dir)
    result = main_in_process("--model=misfit_nets:wrong_input", f"--mode={mode}", f"--model_dir={model_dir}")
    line = one_error_line(result)
    assert "--model=misfit_nets:wrong_input" in line and CASES[0][1] in line, line
    assert snapshot(model_dir) == before
