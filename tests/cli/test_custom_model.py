"""`--model=package.module:function`: a user's own model from the command line,
run from a working directory that also holds the user's `models.py` and
`input.py` (which neither break the CLI nor are replaced by the engine's). The
training run is a real process started there; the refusals of bad user models run
in-process as if started there (`helpers.main_in_process(cwd=...)`).

Covers: engine/cli/process/own_packages.py, engine/user_code.py.
"""

import json
import textwrap
from pathlib import Path

import pytest
from helpers import main_in_process, run_main, snapshot

USER_NET = """
import keras
import models  # The user's own models.py and input.py, not the engine's packages.
import input as user_input

assert models.OWNER == "user" and user_input.OWNER == "user", (models.__file__, user_input.__file__)


def build(input_shape, num_classes):
    return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                             keras.layers.Dense(24, activation="relu", name="user_hidden"),
                             keras.layers.Dense(num_classes, name="user_logits")])


def not_a_model(input_shape, num_classes):
    return "a string"


def with_softmax(input_shape, num_classes):
    return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                             keras.layers.Dense(num_classes, activation="softmax")])


def wrong_classes(input_shape, num_classes):
    return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(), keras.layers.Dense(3)])


def compiled(input_shape, num_classes):
    model = keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(), keras.layers.Dense(num_classes)])
    model.compile(optimizer="adam", loss="mse")
    return model
"""


def user_project(directory: Path) -> Path:
    """A working directory as ML projects have it: models.py, input.py and a package."""
    (directory / "models.py").write_text('OWNER = "user"\n')
    (directory / "input.py").write_text('OWNER = "user"\n')
    (directory / "nets").mkdir()
    (directory / "nets" / "__init__.py").write_text("")
    (directory / "nets" / "small.py").write_text(textwrap.dedent(USER_NET))
    (directory / "broken.py").write_text("import keras\nimport not_installed_anywhere\n")
    return directory


@pytest.mark.process
@pytest.mark.slow  # a real `python -m engine.main` from the user's directory
def test_a_users_model_trains_from_the_cli_beside_their_models_and_input_py(tmp_path):
    project = user_project(tmp_path)
    result = run_main(
        "--model=nets.small:build", "--train_steps=30", "--eval_every=0", "--model_dir=run", cwd=project
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((project / "run" / "metrics.json").read_text())
    assert metrics["global_step"] == 30
    assert metrics["eval"]["num_examples"] == 297  # The engine's digits data set, through its own `input`.
    assert metrics["eval"]["accuracy"] > 0.3  # Learned something: chance is 0.1.
    # The start-up log shows the user's model in Keras's summary.
    assert "user_hidden (Dense)" in result.stderr and "Total params: 19,090" in result.stderr
    # The checkpoint holds the user's model: its 28*28 -> 24 hidden layer is in no built-in model.
    import tensorflow as tf

    shapes = [shape for _, shape in tf.train.list_variables(str(project / "run" / "checkpoints"))]
    assert [28 * 28, 24] in shapes and [24, 10] in shapes, shapes


BAD_MODELS = [
    (
        "broken:build",
        "--model=broken:build: cannot import 'broken': ModuleNotFoundError: "
        "No module named 'not_installed_anywhere'",
    ),
    ("nets.missing:build", "cannot import 'nets.missing'"),
    ("nets.small:nothing", "has no function 'nothing'"),
    ("nets.small:not_a_model", "--model=nets.small:not_a_model returned builtins.str, not a keras.Model"),
    ("nets.small:with_softmax", "ends with a softmax; the engine's loss takes logits"),
    ("nets.small:wrong_classes", "outputs shape (None, 3); the data's labels need 10 outputs"),
    ("nets.small:compiled", "--model=nets.small:compiled returned a compiled model; return it uncompiled"),
]


@pytest.mark.cli
@pytest.mark.parametrize("model,message", BAD_MODELS, ids=[model for model, _ in BAD_MODELS])
def test_a_bad_user_model_is_one_line_exit_2_and_writes_nothing(tmp_path, model, message):
    project = user_project(tmp_path)
    model_dir = project / "run"
    model_dir.mkdir()
    (model_dir / "notes.txt").write_text("an earlier run's files")
    before = snapshot(model_dir)
    result = main_in_process(f"--model={model}", "--train_steps=3", "--model_dir=run", cwd=project)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("engine.main: error:")]
    assert len(error_lines) == 1 and message in error_lines[0], result.stderr[-2000:]
    assert snapshot(model_dir) == before
