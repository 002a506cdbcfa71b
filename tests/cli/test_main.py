"""The command line as a user runs it: real subprocesses and real exit codes for the
runs; refusals (exit 2, one line, model_dir untouched) through the same parsing and
job in-process (`helpers.main_in_process`), with one refusal kept as a real process.

Covers: engine/cli/main_command.py, engine/cli/run/job.py.
"""

import json
from pathlib import Path

import pytest
import yaml
from helpers import main_in_process, run_main, snapshot

from engine.cli.config.settings import DEFAULT_MIN_STEPS


def scalar_tags(log_dir: Path) -> set[str]:
    """The scalar names TensorBoard finds in a run directory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    accumulator.Reload()
    return set(accumulator.Tags()["tensors"])


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_default_job_reaches_the_accuracy_bar_offline(tmp_path):
    """README's quick start as printed: two replicas, the real digits set, >= 0.95 eval accuracy."""
    result = run_main("--strategy=mirrored", "--cpu_devices=2", f"--model_dir={tmp_path}", timeout=500)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["global_step"] == max(20 * 1500 // 64, DEFAULT_MIN_STEPS)  # 20 epochs, at least 500 steps.
    assert metrics["eval"]["num_examples"] == 297
    assert metrics["eval"]["accuracy"] >= 0.95
    assert metrics["examples_per_second"] > 0
    assert {"loss", "accuracy"} <= set(metrics["train"])
    assert (tmp_path / "checkpoints" / f"ckpt-{metrics['global_step']}.index").exists()
    train_tags = scalar_tags(tmp_path / "train")
    assert {"loss", "accuracy", "learning_rate", "examples_per_second", "steps_per_second"} <= train_tags
    assert {"loss", "accuracy", "num_examples"} <= scalar_tags(tmp_path / "eval")
    assert "replicas=2" in result.stderr and " examples/s" in result.stderr


@pytest.mark.process
@pytest.mark.slow
def test_two_replicas_global_pipeline_and_restart_continues(tmp_path):
    common = [
        "--strategy=mirrored",
        "--cpu_devices=2",
        "--input_pipeline=global",
        "--model=mlp",
        f"--model_dir={tmp_path}",
        "--steps_per_loop=7",
    ]
    first = run_main(*common, "--train_steps=20")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "replicas=2" in first.stderr
    # The restart (10 steps) in this process: the same two-replica strategy the tests share.
    second = main_in_process(*common, "--train_steps=30", "--learning_rate=0.01")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Restored" in second.stderr and "steps=20->30" in second.stderr
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["global_step"] == 30
    assert metrics["train"]["learning_rate"] == pytest.approx(0.01)  # the flag wins over the checkpoint


@pytest.mark.cli
def test_flagfile_is_read(tmp_path):
    flagfile = tmp_path / "flags.txt"
    flagfile.write_text(f"--model=mlp\n--train_steps=5\n--mode=train\n--model_dir={tmp_path / 'run'}\n")
    result = main_in_process(f"--flagfile={flagfile}")  # absl reads it as in a process; 5 steps, no eval
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["global_step"] == 5


BAD_FLAGS = [
    (["--strategy=mirrorred"], "unknown --strategy='mirrorred'; choose one of: default"),
    (["--strategy=parameter_server"], "--strategy=parameter_server needs a cluster with chief, worker and ps"),
    (
        ["--strategy=multi_worker_mirrored", "--worker_hosts=localhost,localhost:2223", "--task_type=worker"],
        "worker address 'localhost' has no port; write host:port",
    ),
    (
        [
            "--strategy=multi_worker_mirrored",
            "--worker_hosts=localhost:2222,localhost:2223",
            "--task_type=worker",
            "--task_index=2",
        ],
        "task index 2 from the cluster flags is out of range: job 'worker' has 2 task(s)",
    ),
    (
        ["--strategy=multi_worker_mirrored", "--worker_hosts=localhost:2222", "--task_type=boss"],
        "unknown task type 'boss' in the cluster flags",
    ),
    (
        [
            "--strategy=parameter_server",
            "--worker_hosts=localhost:2222",
            "--ps_hosts=localhost:2223",
            "--task_type=worker",
        ],
        "needs chief task(s) in the cluster",
    ),
    (["--strategy=tpu", "--tpu=local"], "--tpu=local but this machine has no TPU devices"),
    (["--strategy=tpu", "--tpu=grpc://localhost:1"], "--tpu=grpc://localhost:1: nothing answers at localhost:1"),
    (["--strategy=tpu"], "--strategy=tpu needs --tpu=local"),
    (["--model=vgg"], "unknown --model='vgg'; choose one of: cnn"),
    (["--dataset=imagenet"], "unknown --dataset='imagenet'; choose one of:"),
    (["--optimizer=lamb"], "unknown --optimizer='lamb'"),
    (["--train_steps=-5"], "--train_steps=-5 must be at least 1"),
    (["--global_batch_size=0"], "--global_batch_size=0 must be at least 1"),
    (["--device_data_mb=-1"], "--device_data_mb=-1 must be at least 0"),
    (["--train_steps=10", "--epochs=2"], "alternatives; pass only one"),
    (
        ["--strategy=mirrored", "--cpu_devices=2", "--global_batch_size=63"],
        "global batch size 63 is not divisible by 2 replica(s)",
    ),
    (["--dataset=mnist", "--data_dir=/nonexistent"], "--dataset=digits"),
    (["extra_argument"], "unexpected arguments"),
]


@pytest.mark.cli
@pytest.mark.parametrize("flags,message", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_flags_fail_with_one_line_and_leave_model_dir_alone(tmp_path, flags, message):
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    (model_dir / "notes.txt").write_text("an earlier run's files")
    before = snapshot(model_dir)
    result = main_in_process(
        *flags,
        f"--model_dir={model_dir}",
        "--train_steps=3"
        if "--epochs=2" not in flags and not any(f.startswith("--train_steps") for f in flags)
        else "--seed=1",
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("engine.main: error:")]
    assert len(error_lines) == 1 and message in error_lines[0], result.stderr[-2000:]
    assert snapshot(model_dir) == before


@pytest.mark.process
@pytest.mark.slow
def test_model_dir_that_is_a_file_is_refused(tmp_path):
    """The refusal kept as a real process: exit status 2 from `python -m engine.main`."""
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("keep me")
    result = run_main(f"--model_dir={not_a_dir}", "--train_steps=3")
    assert result.returncode == 2
    assert f"--model_dir={not_a_dir} is a file" in result.stderr
    assert not_a_dir.read_text() == "keep me"


@pytest.mark.cli
def test_bad_tf_config_is_one_line(tmp_path):
    result = main_in_process(
        "--strategy=multi_worker_mirrored",
        f"--model_dir={tmp_path}",
        "--train_steps=3",
        env={"TF_CONFIG": '{"cluster": {"worker": ["localhost:2222"]}, "task": '},
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "engine.main: error: TF_CONFIG is not valid JSON" in result.stderr


@pytest.mark.cli
def test_print_config_shows_the_resolved_settings_and_writes_nothing(tmp_path):
    flagfile = tmp_path / "run.flags"
    flagfile.write_text("--model=mlp\n--learning_rate=0.05\n--train_steps=7\n")
    model_dir = tmp_path / "run"
    # A flag after the flagfile wins, as absl reads them in order.
    result = main_in_process(
        f"--flagfile={flagfile}", "--learning_rate=0.2", f"--model_dir={model_dir}", "--print_config"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    settings = yaml.safe_load(result.stdout)  # What --config_file reads back (test_config_file.py).
    assert (settings["model"], settings["learning_rate"], settings["train_steps"]) == ("mlp", 0.2, 7)
    assert settings["global_batch_size"] == 64 and settings["model_dir"] == str(model_dir)  # Defaults too.
    assert "print_config" not in settings and "config_file" not in settings
    assert not model_dir.exists()  # Nothing written: no model_dir, no lock, no checkpoint.
    # Checked before it is printed: a bad setting is the usual one line.
    refused = main_in_process("--model=mlp", "--learning_rate=-1", "--print_config")
    assert refused.returncode == 2 and "--learning_rate=-1.0 must be positive" in refused.stderr
