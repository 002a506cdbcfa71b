"""The cluster examples a user starts from: examples/slurm/train.sbatch runs under a
fake Slurm (SLURM_* variables, an `srun` that starts local processes or only exits, an
`scontrol` that records its requeue), takes ports from the job id and requeues only a run
stopped by a signal; examples/kubernetes/train.yaml gives every pod the cluster it should
join and can run again, and its Dockerfile installs this package and runs engine.main."""

from __future__ import annotations

import copy
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from helpers import REPO, kill_group

SBATCH = REPO / "examples" / "slurm" / "train.sbatch"

# `srun` as Slurm runs a one-node step: SLURM_NTASKS copies of the command, each with its
# SLURM_PROCID, their pids in $SRUN_TASK_PIDS (where Slurm's --signal sends TERM); it waits for
# every task (no --kill-on-bad-exit) and exits with the last failing task's status.
SRUN_SHIM = r"""#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
export SLURM_STEP_NODELIST=localhost SLURM_STEP_TASKS_PER_NODE=$SLURM_NTASKS
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do SLURM_PROCID=$i "$@" & pids+=($!); done
echo "${pids[@]}" > "$SRUN_TASK_PIDS"
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""

# `srun` standing in for the whole training step, no TensorFlow: it records its arguments, then
# FAKE_SRUN=exit:N exits N at once; wait:N exits N once the test creates $CALLS.release.
FAKE_SRUN = r"""#!/bin/bash
echo "srun $*" >> "$CALLS"
if [[ $FAKE_SRUN == wait:* ]]; then
    touch "$CALLS.started"
    for ((i = 0; i < 600; i++)); do [[ -e $CALLS.release ]] && break; sleep 0.05; done
    echo "srun exit" >> "$CALLS"
fi
exit "${FAKE_SRUN#*:}"
"""
# `scontrol` that only records how it was called.
FAKE_SCONTROL = r"""#!/bin/bash
echo "scontrol $*" >> "$CALLS"
"""


def slurm_job(tmp_path: Path, srun: str, **variables: str) -> dict[str, str]:
    """The environment of a batch job (fake SLURM_* variables) with `srun` and `scontrol` shims
    first on PATH; both append to the file $CALLS."""
    shims = tmp_path / "bin"
    shims.mkdir(exist_ok=True)
    for name, text in (("srun", srun), ("scontrol", FAKE_SCONTROL)):
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    env = dict(
        os.environ,
        PATH=f"{shims}:{os.environ['PATH']}",
        PYTHONPATH=str(REPO),
        TF_CPP_MIN_LOG_LEVEL="2",
        SLURM_JOB_NAME="engine-train",
        SLURM_JOB_ID="4242",
        SLURM_NTASKS="2",
        SLURM_TASKS_PER_NODE="2",
        SLURM_JOB_NODELIST="localhost",
        SLURM_SUBMIT_DIR=str(REPO),
        MODEL_DIR=str(tmp_path / "run"),
        CALLS=str(tmp_path / "calls"),
        SRUN_TASK_PIDS=str(tmp_path / "task-pids"),
    )
    env.pop("TF_CONFIG", None)
    env.pop("PORT_BASE", None)
    env.update(variables)
    return env


def calls(tmp_path: Path) -> list[str]:
    path = tmp_path / "calls"
    return path.read_text().splitlines() if path.exists() else []


def run_batch_script(env: dict[str, str], *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SBATCH), *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def wait_for_file(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout}s"
        time.sleep(0.05)


@pytest.mark.process
@pytest.mark.parametrize(
    "status, requeued",
    [
        (0, False),  # trained to the end
        (143, True),  # stopped by Slurm's TERM after saving
        (75, True),  # a worker that stopped with its signalled peer
        (1, False),  # a crash: a requeue would only crash again
        (2, False),  # bad flags
    ],
)
def test_slurm_script_requeues_only_a_run_stopped_by_a_signal(tmp_path, status, requeued):
    result = run_batch_script(slurm_job(tmp_path, FAKE_SRUN, FAKE_SRUN=f"exit:{status}"), "--model=mlp")
    assert result.returncode == status, result.stderr
    (srun, *rest) = calls(tmp_path)
    assert "--cluster_resolver=slurm" in srun and srun.endswith("--model=mlp")
    assert rest == (["scontrol requeue 4242"] if requeued else []), result.stderr
    assert ("requeueing job 4242" in result.stderr) == requeued


@pytest.mark.process
@pytest.mark.parametrize(
    "restarts, srun_status, script_status",
    [
        ("0", 69, 69),  # A lost peer (a node died): requeued while MAX_REQUEUES allows,
        ("2", 69, 69),
        ("3", 69, 3),  # then the restarts are spent: exit 3, not requeued.
        ("5", 143, 143),  # Preemption is never capped.
    ],
)
def test_slurm_script_requeues_a_lost_peer_at_most_max_requeues_times_then_exits_3(
    tmp_path, restarts, srun_status, script_status
):
    job = slurm_job(tmp_path, FAKE_SRUN, FAKE_SRUN=f"exit:{srun_status}", SLURM_RESTART_COUNT=restarts)
    result = run_batch_script(job, "--model=mlp")
    assert result.returncode == script_status, result.stderr
    requeued = script_status == srun_status
    assert calls(tmp_path)[1:] == (["scontrol requeue 4242"] if requeued else []), result.stderr
    if not requeued:
        assert "requeued 3 time(s) already (MAX_REQUEUES); not again: exit 3" in result.stderr


@pytest.mark.process
@pytest.mark.parametrize("status, requeued", [(1, True), (0, False)])
def test_slurm_script_requeues_after_a_term_once_the_workers_have_stopped(tmp_path, status, requeued):
    """TERM to the batch script (preemption, scancel): it waits for srun (the workers save their
    checkpoint), then requeues; a run that still finished (exit 0) is not requeued."""
    env = slurm_job(tmp_path, FAKE_SRUN, FAKE_SRUN=f"wait:{status}")
    process = subprocess.Popen(
        ["bash", str(SBATCH)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        process_group=0,
    )
    try:
        wait_for_file(tmp_path / "calls.started", timeout=20)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert process.poll() is None  # still waiting for the workers
        (tmp_path / "calls.release").touch()
        _, stderr = process.communicate(timeout=20)
    finally:
        kill_group(process)
    assert process.returncode == status, stderr
    assert calls(tmp_path)[1:] == ["srun exit", *(["scontrol requeue 4242"] if requeued else [])], stderr


def slurm_ports(tmp_path: Path, job_id: int, tasks_per_node: str = "8(x2)") -> set[int]:
    """The ports the engine's Slurm resolver gives a job's tasks, from the port base the batch
    script passes to srun, on two nodes (the test's node is `node1`)."""
    from engine.cluster.resolve import resolve_cluster

    job = tmp_path / str(job_id)
    job.mkdir()
    result = run_batch_script(
        slurm_job(
            job, FAKE_SRUN, FAKE_SRUN="exit:0", SLURM_JOB_ID=str(job_id), SLURM_TASKS_PER_NODE=tasks_per_node
        )
    )
    assert result.returncode == 0, result.stderr
    (base,) = re.findall(r"--slurm_port_base=(\d+)", calls(job)[0])
    environ = dict(SLURM_PROCID="0", SLURM_STEP_NODELIST="node[1-2]", SLURM_STEP_TASKS_PER_NODE=tasks_per_node)
    cluster = resolve_cluster(cluster_resolver="slurm", slurm_port_base=int(base), environ=environ)
    assert cluster is not None
    return {
        int(address.rpartition(":")[2]) for address in cluster.spec["worker"] if address.startswith("node1:")
    }


@pytest.mark.process
@pytest.mark.parametrize("job_ids", [(1234, 1235), (1, 1596 * 7 + 2), (99999, 100000)])
def test_two_slurm_jobs_on_one_node_listen_on_disjoint_ports(tmp_path, job_ids):
    first, second = (slurm_ports(tmp_path, job_id) for job_id in job_ids)
    assert len(first) == len(second) == 8
    assert not first & second
    assert all(20000 <= port < 32768 for port in first | second)  # below the ephemeral range


@pytest.mark.process
def test_slurm_script_refuses_more_tasks_per_node_than_its_port_block(tmp_path):
    result = run_batch_script(slurm_job(tmp_path, FAKE_SRUN, FAKE_SRUN="exit:0", SLURM_TASKS_PER_NODE="4,9(x2)"))
    assert result.returncode == 2
    assert "a node runs 9 tasks but PORT_STRIDE=8; set PORT_STRIDE" in result.stderr
    assert calls(tmp_path) == []  # nothing started
    result = run_batch_script(
        slurm_job(tmp_path, FAKE_SRUN, FAKE_SRUN="exit:0", SLURM_TASKS_PER_NODE="9", PORT_STRIDE="16")
    )
    assert result.returncode == 0, result.stderr
    result = run_batch_script(slurm_job(tmp_path, FAKE_SRUN, FAKE_SRUN="exit:0", PORT_BASE="31000"))
    assert "--slurm_port_base=31000 " in calls(tmp_path)[-1]  # chosen by hand


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_slurm_batch_script_trains_stops_on_term_requeues_and_resumes(tmp_path):
    """Slurm's TERM before the time limit: both workers save and stop, the script requeues the
    job; the requeued job (the same script again) resumes from the checkpoint and ends."""
    env = slurm_job(tmp_path, SRUN_SHIM, PORT_BASE=str(consecutive_free_ports(2)))
    flags = [
        "--model=mlp",
        "--dataset=synthetic",
        "--optimizer=sgd",
        "--global_batch_size=32",
        "--steps_per_loop=4",
        "--eval_every=0",
        "--checkpoint_every=1000000",
    ]
    output = start_batch_script(tmp_path / "first.log", env, *flags, "--train_steps=1000000")
    process = output.process
    try:
        deadline = time.monotonic() + 300
        while not re.search(r"step \d+/1000000", output.text()):
            assert process.poll() is None and time.monotonic() < deadline, output.text()[-4000:]
            time.sleep(0.2)
        for pid in (tmp_path / "task-pids").read_text().split():
            os.kill(int(pid), signal.SIGTERM)  # what --signal=TERM@120 does: every task
        process.wait(timeout=150)
    finally:
        kill_group(process)  # the script, srun and both workers, if a timeout left them running
    assert process.returncode == 143, output.text()[-4000:]
    assert calls(tmp_path) == ["scontrol requeue 4242"]
    steps = [int(path.name[5:-6]) for path in (tmp_path / "run" / "checkpoints").glob("ckpt-*.index")]
    step = max(steps)
    assert 0 < step < 1000000 and step % 4 == 0

    output = start_batch_script(tmp_path / "second.log", env, *flags, f"--train_steps={step + 8}")
    try:
        output.process.wait(timeout=300)
    finally:
        kill_group(output.process)
    text = output.text()
    assert output.process.returncode == 0, text[-4000:]
    assert f"at step {step}" in text  # restored, not started again
    digests = re.findall(rf"done: step {step + 8}.*weights_digest=(\w+)", text)
    assert len(digests) == 2 and digests[0] == digests[1], text[-3000:]  # two workers, in step
    assert calls(tmp_path) == ["scontrol requeue 4242"]  # the finished run was not requeued
    assert (tmp_path / "run" / "checkpoints" / f"ckpt-{step + 8}.index").exists()
    assert not (tmp_path / "run" / ".workertemp").exists()


class ScriptOutput:
    """A batch script started with its stdout and stderr in one log file."""

    def __init__(self, log: Path, process: subprocess.Popen):
        self.log, self.process = log, process

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def start_batch_script(log: Path, env: dict[str, str], *args: str) -> ScriptOutput:
    with log.open("w") as sink:
        process = subprocess.Popen(
            ["bash", str(SBATCH), *args], env=env, stdout=sink, stderr=subprocess.STDOUT, process_group=0
        )
    return ScriptOutput(log, process)


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


KUBERNETES = REPO / "examples" / "kubernetes"


def test_kubernetes_manifest_gives_each_pod_its_task_in_one_cluster():
    yaml = pytest.importorskip("yaml")
    from engine.cli.config import flags as engine_flags
    from engine.cli.config.settings import RunConfig
    from engine.cli.config.settings.cluster import resolve_multi_host

    documents = list(yaml.safe_load_all((KUBERNETES / "train.yaml").read_text()))
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in documents}
    service, train = by_kind[("Service", "engine")], by_kind[("Job", "engine-train")]
    pod = train["spec"]["template"]
    assert service["spec"]["clusterIP"] == "None"  # headless: per-pod DNS names
    assert service["spec"]["publishNotReadyAddresses"] is True  # names before the peers are ready
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["subdomain"] == service["metadata"]["name"]
    assert train["spec"]["completionMode"] == "Indexed"
    workers = train["spec"]["completions"]
    assert train["spec"]["parallelism"] == workers  # all at once: they wait for each other
    (container,) = pod["spec"]["containers"]
    port = container["ports"][0]["containerPort"]
    assert port == service["spec"]["ports"][0]["port"]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env["JOB_COMPLETION_INDEX"] == "metadata.annotations['batch.kubernetes.io/job-completion-index']"

    clusters = []
    for index in range(workers):
        # What Kubernetes does: the annotation's value into the env, $(VAR) expanded in args.
        values = {name: str(index) for name in env}
        args = [
            re.sub(r"\$\((\w+)\)", lambda m, values=values: values[m.group(1)], arg) for arg in container["args"]
        ]
        assert container["command"] == ["python", "-m", "engine.main"]
        config = parse_engine_flags(engine_flags.FLAGS, RunConfig, args)
        cluster = resolve_multi_host(config).cluster
        # Pod <job>-<index> of subdomain <service> resolves as <job>-<index>.<service>.
        assert cluster.address == f"{train['metadata']['name']}-{index}.{service['metadata']['name']}:{port}"
        assert (cluster.task_type, cluster.task_index, cluster.num_workers) == ("worker", index, workers)
        clusters.append(cluster.spec)
    assert all(spec == clusters[0] for spec in clusters)  # every pod joins the same cluster

    (evaluator,) = by_kind[("Job", "engine-eval")]["spec"]["template"]["spec"]["containers"]
    config = parse_engine_flags(engine_flags.FLAGS, RunConfig, evaluator["args"])
    assert resolve_multi_host(config).cluster.is_evaluator
    assert config.model_dir == parse_engine_flags(engine_flags.FLAGS, RunConfig, args).model_dir
    assert config.train_steps == parse_engine_flags(engine_flags.FLAGS, RunConfig, args).train_steps


def test_kubernetes_manifest_can_run_again_and_keeps_the_model_dir():
    """`kubectl replace --force -f train.yaml` deletes and recreates what the file holds: not the
    volume (volume.yaml) that the rerun resumes from; finished Jobs also delete themselves."""
    yaml = pytest.importorskip("yaml")
    documents = list(yaml.safe_load_all((KUBERNETES / "train.yaml").read_text()))
    assert {d["kind"] for d in documents} == {"Service", "Job"}
    (volume,) = yaml.safe_load_all((KUBERNETES / "volume.yaml").read_text())
    assert volume["kind"] == "PersistentVolumeClaim" and volume["spec"]["accessModes"] == ["ReadWriteMany"]
    for job in (d for d in documents if d["kind"] == "Job"):
        pod = job["spec"]["template"]["spec"]
        assert job["spec"]["ttlSecondsAfterFinished"] > 0
        assert {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]} == {volume["metadata"]["name"]}
        (container,) = pod["containers"]
        assert any(arg.startswith("--model_dir=/runs/") for arg in container["args"])
        assert [m["mountPath"] for m in container["volumeMounts"]] == ["/runs"]

    train = next(d for d in documents if d["metadata"]["name"] == "engine-train")
    pod = train["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # what a podFailurePolicy needs
    assert pod["terminationGracePeriodSeconds"] >= 60  # SIGTERM to SIGKILL: time to save a checkpoint
    (container,) = pod["containers"]
    policy = train["spec"]["podFailurePolicy"]
    # Kubernetes's rule: the first rule that matches a failed pod decides; none: it counts.
    assert pod_failure_action(policy, container["name"], exit_code=2) == "FailJob"  # bad flags
    assert pod_failure_action(policy, container["name"], exit_code=143) == "Ignore"  # saved on SIGTERM
    assert pod_failure_action(policy, container["name"], exit_code=75) == "Ignore"  # stopped with its peer
    assert (
        pod_failure_action(policy, container["name"], exit_code=137, conditions={"DisruptionTarget"}) == "Ignore"
    )
    assert pod_failure_action(policy, container["name"], exit_code=1) == "Count"  # a crash: backoffLimit
    assert train["spec"]["backoffLimit"] >= 2 * train["spec"]["completions"]  # a whole cluster, more than once


def pod_failure_action(
    policy: dict, container: str, *, exit_code: int, conditions: set[str] = frozenset()
) -> str:
    for rule in policy["rules"]:
        codes = rule.get("onExitCodes")
        if codes and codes.get("containerName", container) == container:
            assert codes["operator"] in ("In", "NotIn")
            if (exit_code in codes["values"]) == (codes["operator"] == "In"):
                return rule["action"]
        if any(c["type"] in conditions for c in rule.get("onPodConditions", ())):
            return rule["action"]
    return "Count"


def dockerfile_stages(text: str) -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """A Dockerfile's stages in order: name -> (FROM image, [(INSTRUCTION, arguments), ...])."""
    text = re.sub(r"\\\n", " ", re.sub(r"^\s*#.*\n", "", text, flags=re.M))
    stages: dict[str, tuple[str, list[tuple[str, str]]]] = {}
    for line in filter(str.strip, text.splitlines()):
        instruction, _, arguments = line.strip().partition(" ")
        if instruction.upper() == "FROM":
            image, _, name = arguments.partition(" AS ")
            stages[name.strip() or str(len(stages))] = (image.strip(), [])
        else:
            list(stages.values())[-1][1].append((instruction.upper(), arguments.strip()))
    return stages


def test_dockerfile_installs_this_package_on_a_cpu_and_a_gpu_base_and_runs_the_engine():
    import configparser
    import json
    import shlex

    yaml = pytest.importorskip("yaml")
    stages = dockerfile_stages((KUBERNETES / "Dockerfile").read_text())
    assert list(stages)[-1] == "cpu"  # the default target: `docker build` without --target

    def instructions(stage: str) -> list[tuple[str, str]]:
        """A stage's instructions, its parent stages' first: what its image runs."""
        image, own = stages[stage]
        return (instructions(image) if image in stages else []) + own

    def base_image(stage: str) -> str:
        image = stages[stage][0]
        return base_image(image) if image in stages else image

    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    packages = {p for p in setup["options.packages.find"]["include"].split() if "." not in p}
    (tensorflow,) = [r for r in setup["options"]["install_requires"].split("\n") if r.startswith("tensorflow")]
    read_by_setup = re.findall(r"file:\s*(\S+)", setup["metadata"]["long_description"])

    for stage in ("cpu", "gpu"):
        assert base_image(stage) == "python:3.11-slim"
        steps = instructions(stage)
        copied = {}  # each COPY source -> where it lands in the image
        for instruction, arguments in steps:
            if instruction == "COPY":
                *sources, target = arguments.split()
                for source in sources:
                    assert (REPO / source).exists(), source
                    copied[source] = target + source if target.endswith("/") else target
        # Everything `pip install /src` needs: the metadata, the files it reads, each package.
        needed = {"pyproject.toml", "setup.cfg", *read_by_setup, *packages}
        assert {source: copied.get(source) for source in needed} == {
            source: f"/src/{source}" for source in needed
        }
        (install,) = [shlex.split(a) for i, a in steps if i == "RUN" and "pip install" in a]
        assert install[:2] == ["pip", "install"] and "/src" in install  # this package, from its source
        tensorflow_pins = [a for a in install[2:] if a.startswith("tensorflow")]
        expected = [tensorflow.replace("tensorflow", "tensorflow[and-cuda]", 1)] if stage == "gpu" else []
        assert tensorflow_pins == expected  # gpu: setup.cfg's own TensorFlow range, with CUDA
        (workdir,) = [a for i, a in steps if i == "WORKDIR"]
        assert not workdir.startswith("/src")  # the installed packages are imported, not the sources
        (entrypoint,) = [json.loads(a) for i, a in steps if i == "ENTRYPOINT"]
        assert entrypoint == ["python", "-m", "engine.main"]

    train = next(
        d
        for d in yaml.safe_load_all((KUBERNETES / "train.yaml").read_text())
        if d["metadata"]["name"] == "engine-train"
    )
    (container,) = train["spec"]["template"]["spec"]["containers"]
    assert container["command"] == entrypoint  # the manifest runs what the image runs


def parse_engine_flags(flag_values, run_config, args: list[str]):
    """engine.main's flags parsed (on a copy: the global FLAGS stay untouched) into a RunConfig."""
    values = copy.deepcopy(flag_values)
    values(["engine.main", *args])
    from engine.cli.config.settings import flag_settings  # task_params: no flag

    names = [name for name in flag_settings() if name in values]
    return run_config(**{name: values[name].value for name in names})
