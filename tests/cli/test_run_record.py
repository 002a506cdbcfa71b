"""metrics.json, the run's record: no mode's write drops what an earlier one wrote.

As a user would run it: train, `--mode=eval`, train further; each command in this process
through the command line's own flag parsing (`main_in_process`)."""

import json
import re

import pytest
from helpers import main_in_process, one_error_line, snapshot

FLAGS = ["--model=mlp", "--global_batch_size=32", "--steps_per_loop=5", "--eval_every=0"]


def record(model_dir):
    return json.loads((model_dir / "metrics.json").read_text())


@pytest.mark.cli
@pytest.mark.slow  # Trains for seconds (2-3.5 CPU-s in the last profile): the full suite runs it.
def test_eval_mode_keeps_the_training_figures_and_training_keeps_the_evaluations(tmp_path):
    model_dir = tmp_path / "run"
    trained = main_in_process(*FLAGS, "--train_steps=10", f"--model_dir={model_dir}")
    assert trained.returncode == 0, trained.stderr[-3000:]
    after_training = record(model_dir)
    assert after_training["global_step"] == 10
    # The run's last line reads as the progress lines do, not as a dict of 16-digit floats.
    done = r"done: step 10, eval loss=[\d.]+  accuracy=[\d.]+  num_examples=297, [\d,.]+ examples/s;"
    assert re.search(done, trained.stderr)
    assert [(e["step"], e["mode"]) for e in after_training["evaluations"]] == [(10, "train_and_eval")]

    evaluated = main_in_process(*FLAGS, "--train_steps=10", "--mode=eval", f"--model_dir={model_dir}")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    after_eval = record(model_dir)
    # The training figures stay as training wrote them; the evaluation is added to them.
    for key in ("global_step", "train", "examples_per_second"):
        assert after_eval[key] == after_training[key]
    assert [(e["step"], e["mode"]) for e in after_eval["evaluations"]] == [(10, "train_and_eval"), (10, "eval")]
    eval_mode = after_eval["evaluations"][1]["eval"]
    assert (
        after_eval["eval"] == eval_mode and eval_mode["num_examples"] == after_training["eval"]["num_examples"]
    )
    # The same checkpoint evaluated twice: the same numbers.
    assert eval_mode["loss"] == pytest.approx(after_training["eval"]["loss"], rel=1e-6)

    continued = main_in_process(*FLAGS, "--train_steps=15", f"--model_dir={model_dir}")
    assert continued.returncode == 0, continued.stderr[-3000:]
    after_more = record(model_dir)
    assert after_more["global_step"] == 15
    assert [(e["step"], e["mode"]) for e in after_more["evaluations"]] == [
        (10, "train_and_eval"),
        (10, "eval"),
        (15, "train_and_eval"),
    ]
    assert after_more["eval"] == after_more["evaluations"][-1]["eval"]


@pytest.mark.cli
def test_eval_mode_on_a_run_with_no_record_starts_one(tmp_path):
    model_dir = tmp_path / "run"
    trained = main_in_process(*FLAGS, "--train_steps=5", "--mode=train", f"--model_dir={model_dir}")
    assert trained.returncode == 0, trained.stderr[-3000:]
    (model_dir / "metrics.json").unlink()  # A run killed before its end writes none.
    evaluated = main_in_process(*FLAGS, "--train_steps=5", "--mode=eval", f"--model_dir={model_dir}")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    written = record(model_dir)
    assert written["global_step"] == 5 and written["eval"]["num_examples"] > 0
    assert [(e["step"], e["mode"]) for e in written["evaluations"]] == [(5, "eval")]


@pytest.mark.cli
@pytest.mark.parametrize("mode", ["train_and_eval", "eval"])
def test_a_damaged_record_is_one_line_before_anything_is_written(tmp_path, mode):
    model_dir = tmp_path / "run"
    trained = main_in_process(*FLAGS, "--train_steps=5", f"--model_dir={model_dir}")
    assert trained.returncode == 0, trained.stderr[-3000:]
    (model_dir / "metrics.json").write_text('{"global_step": 5, "train": {')  # Cut short by a bad copy.
    before = snapshot(model_dir)
    result = main_in_process(*FLAGS, "--train_steps=10", f"--mode={mode}", f"--model_dir={model_dir}")
    line = one_error_line(result)
    assert f"{model_dir / 'metrics.json'} (the results of the run) is damaged" in line, line
    assert snapshot(model_dir) == before
