"""The cluster examples a user starts from: examples/slurm/train.sbatch runs under a
fake Slurm (SLURM_* variables and an `srun` that starts local processes), and
examples/kubernetes/train.yaml gives every pod the cluster it should join."""

from __future__ import annotations

import copy
import os
import re
import socket
import subprocess

import pytest
from helpers import REPO, kill_group

# `srun` as Slurm runs a one-node step: SLURM_NTASKS copies of the command, each with its
# SLURM_PROCID; --kill-on-bad-exit: the first failure ends the others. The exit status is the worst.
SRUN_SHIM = r"""#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
export SLURM_STEP_NODELIST=localhost SLURM_STEP_TASKS_PER_NODE=$SLURM_NTASKS
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do SLURM_PROCID=$i "$@" & pids+=($!); done
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
status=0
for pid in "${pids[@]}"; do wait "$pid" || { status=$?; kill "${pids[@]}" 2>/dev/null; }; done
exit $status
"""


def consecutive_free_ports(count: int) -> int:
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("localhost", 0))
            base = probe.getsockname()[1]
        if base + count < 65536 and all(_free(base + offset) for offset in range(count)):
            return base
    raise RuntimeError("no consecutive free ports")


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("localhost", port))
        except OSError:
            return False
    return True


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(500)
def test_slurm_batch_script_trains_two_workers_under_srun(tmp_path):
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "srun").write_text(SRUN_SHIM)
    (shims / "srun").chmod(0o755)
    env = dict(
        os.environ,
        PATH=f"{shims}:{os.environ['PATH']}",
        PYTHONPATH=str(REPO),
        TF_CPP_MIN_LOG_LEVEL="2",
        SLURM_JOB_NAME="engine-train",
        SLURM_JOB_ID="1",
        SLURM_NTASKS="2",
        SLURM_JOB_NODELIST="localhost",
        SLURM_SUBMIT_DIR=str(REPO),
        MODEL_DIR=str(tmp_path / "run"),
        PORT_BASE=str(consecutive_free_ports(2)),
    )
    env.pop("TF_CONFIG", None)
    process = subprocess.Popen(
        [
            "bash",
            str(REPO / "examples" / "slurm" / "train.sbatch"),
            "--model=mlp",
            "--dataset=synthetic",
            "--optimizer=sgd",
            "--global_batch_size=32",
            "--train_steps=12",
            "--steps_per_loop=4",
            "--eval_every=0",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=420)
    finally:
        kill_group(process)  # the script, srun and both workers, if a timeout left them running
    output = stdout + stderr
    assert process.returncode == 0, output[-4000:]
    digests = re.findall(r"done: step 12.*weights_digest=(\w+)", output)
    assert len(digests) == 2 and digests[0] == digests[1], output[-3000:]  # two workers, in step
    assert (tmp_path / "run" / "checkpoints" / "ckpt-12.index").exists()
    assert not (tmp_path / "run" / ".workertemp").exists()


def test_kubernetes_manifest_gives_each_pod_its_task_in_one_cluster():
    yaml = pytest.importorskip("yaml")
    from engine.cli import flags as engine_flags
    from engine.cli.settings import RunConfig

    documents = list(yaml.safe_load_all((REPO / "examples" / "kubernetes" / "train.yaml").read_text()))
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in documents}
    service, train = by_kind[("Service", "engine")], by_kind[("Job", "engine-train")]
    pod = train["spec"]["template"]
    assert service["spec"]["clusterIP"] == "None"  # headless: per-pod DNS names
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["subdomain"] == service["metadata"]["name"]
    assert train["spec"]["completionMode"] == "Indexed"
    workers = train["spec"]["completions"]
    assert train["spec"]["parallelism"] == workers  # all at once: they wait for each other
    (container,) = pod["spec"]["containers"]
    port = container["ports"][0]["containerPort"]
    assert port == service["spec"]["ports"][0]["port"]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}

    clusters = []
    for index in range(workers):
        # What Kubernetes does: the annotation's value into the env, $(VAR) expanded in args.
        values = {
            name: str(index)
            for name, path in env.items()
            if path == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        }
        args = [
            re.sub(r"\$\((\w+)\)", lambda m, values=values: values[m.group(1)], arg) for arg in container["args"]
        ]
        assert container["command"] == ["python", "-m", "engine.main"]
        config = parse_engine_flags(engine_flags.FLAGS, RunConfig, args)
        cluster = config.multi_host_options().cluster
        # Pod <job>-<index> of subdomain <service> resolves as <job>-<index>.<service>.
        assert cluster.address == f"{train['metadata']['name']}-{index}.{service['metadata']['name']}:{port}"
        assert (cluster.task_type, cluster.task_index, cluster.num_workers) == ("worker", index, workers)
        clusters.append(cluster.spec)
    assert all(spec == clusters[0] for spec in clusters)  # every pod joins the same cluster

    (evaluator,) = by_kind[("Job", "engine-eval")]["spec"]["template"]["spec"]["containers"]
    config = parse_engine_flags(engine_flags.FLAGS, RunConfig, evaluator["args"])
    assert config.multi_host_options().cluster.is_evaluator
    assert config.model_dir == parse_engine_flags(engine_flags.FLAGS, RunConfig, args).model_dir
    assert config.train_steps == parse_engine_flags(engine_flags.FLAGS, RunConfig, args).train_steps


def parse_engine_flags(flag_values, run_config, args: list[str]):
    """engine.main's flags parsed (on a copy: the global FLAGS stay untouched) into a RunConfig."""
    values = copy.deepcopy(flag_values)
    values(["engine.main", *args])
    names = [name for name in run_config.__dataclass_fields__ if name in values]  # task_params: no flag
    return run_config(**{name: values[name].value for name in names})
