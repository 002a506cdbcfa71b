r"""A large embedding table on parameter servers: whole on one ps task, split over them
(`engine.ShardedEmbedding`), and with dense updates, on the same local cluster.

    python -m benchmarks.sharded_tables --rows=200000 --width=32 --num_ps=2 --json=benchmarks/out/tables.json

For each way of holding the table a fresh cluster (one worker and `--num_ps` ps tasks,
`engine.server` processes on localhost) trains a model of one table (ids of `--length` per
example -> table -> mean -> Dense(1), Adagrad) with the library's parameter-server Trainer,
in a coordinator process of its own:

- `whole`: `keras.layers.Embedding`: the table and its Adagrad slot on one ps task (Keras 3
  looks ids up with `ops.take` on the table read whole, so the table travels every step);
- `one_shard`: `engine.ShardedEmbedding(num_shards=1)`: on one ps task, rows gathered there;
- `sharded`: `engine.ShardedEmbedding(num_shards=--num_ps)`: a shard on each ps task;
- `dense`: the sharded table read whole on the worker each step (`table * 1`): what a
  model whose gradient is not sparse (a one-hot matmul, a dense op on the table) costs,
  the whole table and a dense gradient travelling every step.

Reported per way: each ps task's resident memory grown since it started serving
(`ps_rss_mb`: the table, the slot and TensorFlow's own), the bytes the cluster's tasks sent
each other per step (`bytes_per_step`: the loopback interface's count over the timed steps,
so run it on a quiet machine: other traffic on localhost counts too), and `examples_per_second`
over the timed steps; and the ratios `sharded` over `one_shard` (memory of the largest ps
task, examples/s), `whole` over `sharded` and `dense` over `sharded` (bytes per step).

With `--ps_memory_limit_mb=M` each ps task may grow by M MiB of address space once it serves
(RLIMIT_AS, set on the running task with prlimit; glibc's per-thread malloc arenas held to two,
MALLOC_ARENA_MAX=2, so that reserved but unused address space does not count): a way whose
table does not fit one task is reported as `failed` with TensorFlow's out-of-memory line instead
of figures, which is what a table too large for one ps task meets, and what splitting it avoids.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from absl import app, flags

from engine.launch.task_processes import free_ports

FLAGS = flags.FLAGS
WAYS = ("whole", "one_shard", "sharded", "dense")
REPO = Path(__file__).resolve().parents[1]


def define_flags() -> None:
    flags.DEFINE_integer("rows", 200_000, "Rows of the table (ids).")
    flags.DEFINE_integer("width", 32, "Width of each row.")
    flags.DEFINE_integer("length", 8, "Ids per example.")
    flags.DEFINE_integer("num_ps", 2, "ps tasks (and shards).")
    flags.DEFINE_integer("global_batch_size", 256, "Global batch size.")
    flags.DEFINE_integer("warmup_steps", 4, "Untimed steps first (tracing).")
    flags.DEFINE_integer("steps", 20, "Timed steps.")
    flags.DEFINE_list("ways", list(WAYS), "Which ways to hold the table, of: " + ", ".join(WAYS))
    flags.DEFINE_integer(
        "ps_memory_limit_mb",
        None,
        "MiB of address space each ps task may grow by once serving (RLIMIT_AS); a way that runs out is "
        "reported as failed, with TensorFlow's out-of-memory line.",
        lower_bound=1,
    )
    flags.DEFINE_string("json", None, "Also write the JSON here.")


# The coordinator of one way: builds the model in the cluster's scope, trains, measures.
COORDINATOR = r"""
import json, sys, time
import numpy as np
import tensorflow as tf
import keras
import engine
from engine.trainer.coordinated import CoordinatedTrainer
from benchmarks.sharded_tables import rss_mb

setup = json.loads(sys.argv[1])
resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
    tf.train.ClusterSpec(setup["hosts"]), task_type="chief", task_id=0, rpc_layer="grpc"
)
strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)


class DenseRead(engine.ShardedEmbedding):
    # The table read whole on the worker: its gradient is dense.
    def call(self, inputs):
        tables = [shard.value * 1.0 for shard in self.shards]
        return tf.gather(tf.concat(tables, 0), tf.cast(inputs, "int32"))


rows, width, way = setup["rows"], setup["width"], setup["way"]
with strategy.scope():
    table = {
        "whole": lambda: keras.layers.Embedding(rows, width),
        "one_shard": lambda: engine.ShardedEmbedding(rows, width, 1),
        "sharded": lambda: engine.ShardedEmbedding(rows, width, setup["num_ps"]),
        "dense": lambda: DenseRead(rows, width, setup["num_ps"]),
    }[way]()
    model = keras.Sequential([keras.Input((setup["length"],), dtype="int32"), table,
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
    optimizer = keras.optimizers.Adagrad(0.05)
batch = setup["global_batch_size"]

def train_from(input_context, start_step):
    ids = tf.data.Dataset.random(seed=1).map(lambda x: tf.math.floormod(x, rows)).batch(setup["length"])
    labels = tf.data.Dataset.random(seed=2).map(lambda x: tf.cast(tf.math.floormod(x, 2), tf.float32))
    return tf.data.Dataset.zip((ids, labels)).batch(batch, drop_remainder=True).skip(start_step)

trainer = CoordinatedTrainer(
    strategy=strategy, model=model, optimizer=optimizer, train_data=train_from, global_batch_size=batch,
    loss_fn=keras.losses.BinaryCrossentropy(from_logits=True, reduction=None),
    cadence=engine.Cadence(steps_per_loop=setup["warmup_steps"]),
)

def loopback_bytes():  # Every byte the cluster's tasks send each other (all on localhost).
    line = [l for l in open("/proc/net/dev").read().splitlines() if l.strip().startswith("lo:")][0]
    return int(line.split(":", 1)[1].split()[0])

trainer.train(setup["warmup_steps"])
before, started = loopback_bytes(), time.perf_counter()
trainer.train(setup["warmup_steps"] + setup["steps"])
elapsed, after = time.perf_counter() - started, loopback_bytes()

print("RESULT " + json.dumps({
    "bytes_per_step": (after - before) / setup["steps"],
    "examples_per_second": setup["steps"] * batch / elapsed,
    "ps_rss_now_mb": [rss_mb(pid) for pid in setup["ps_pids"]],  # While this coordinator holds the table.
}))
"""


def rss_mb(pid: int) -> float:
    return _status_kb(pid, "VmRSS") / 1024


def address_space_mb(pid: int) -> int:
    return _status_kb(pid, "VmSize") // 1024


def _status_kb(pid: int, field: str) -> int:
    """A `kB` field of /proc/PID/status: VmRSS (resident), VmSize (address space)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for pid {pid}")


def limit_growth(pid: int, megabytes: int) -> None:
    """Lets the running process `pid` map at most `megabytes` MiB more than it has now."""
    limit = (address_space_mb(pid) + megabytes) * 2**20
    resource.prlimit(pid, resource.RLIMIT_AS, (limit, limit))


def out_of_memory_line(stderr: str) -> str | None:
    """TensorFlow's 'OOM when allocating tensor ...' line of a failed coordinator, if it ran out."""
    for line in stderr.splitlines():
        if "ResourceExhaustedError" in line and "OOM when allocating" in line:
            return line.split("ResourceExhaustedError: ", 1)[1].split(" by allocator")[0]
    return None


COORDINATOR_TIMEOUT_S = 900

# What a task that ended under the limit printed about why (before Python's fault report).
ENDING_CAUSES = ("bad_alloc", "Check failed", "OOM", "Resource exhausted", "Cannot allocate", "Fatal Python")


def ended_ps_task(ps: list[subprocess.Popen]) -> str | None:
    """How the first ps task that is no longer running ended (an allocation that failed under
    RLIMIT_AS can end the task, as the kernel's out-of-memory killer would), or None."""
    for index, process in enumerate(ps):
        if process.poll() is not None:
            assert process.stderr is not None
            lines = [line.strip() for line in process.stderr.read().splitlines() if line.strip()]
            telling = [line for line in lines if any(cause in line for cause in ENDING_CAUSES)]
            code = process.returncode
            status = f"signal {-code}" if code < 0 else f"status {code}"
            return f"ps:{index} ended ({status}): {(telling or lines or ['nothing printed'])[0]}"
    return None


def run_coordinator(
    coordinator: subprocess.Popen, ps: list[subprocess.Popen]
) -> tuple[int, str, str, str | None]:
    """Waits for `coordinator` (at most COORDINATOR_TIMEOUT_S) while watching the ps tasks: one
    that ends (under the memory limit) ends the coordinator too, which would otherwise wait for
    it forever (seen: ParameterServerStrategy hung on a ps task killed by its RLIMIT_AS).
    Returns its status, its output and how a ps task ended (None if none did)."""
    deadline = time.monotonic() + COORDINATOR_TIMEOUT_S
    while True:
        try:
            stdout, stderr = coordinator.communicate(timeout=0.5)
            return coordinator.returncode, stdout, stderr, None
        except subprocess.TimeoutExpired:
            ended = ended_ps_task(ps)
            if ended is None and time.monotonic() < deadline:
                continue
            coordinator.kill()
            stdout, stderr = coordinator.communicate()
            return coordinator.returncode, stdout, stderr, ended or f"ran past {COORDINATOR_TIMEOUT_S} s"


def measure(way: str) -> dict:
    """One fresh cluster, one coordinator: the figures of `way` (or why it failed under the limit)."""
    ports = free_ports(2 + FLAGS.num_ps)
    hosts = {
        "chief": [f"localhost:{ports[0]}"],
        "worker": [f"localhost:{ports[1]}"],
        "ps": [f"localhost:{port}" for port in ports[2:]],
    }
    cluster = [
        f"--chief_host={hosts['chief'][0]}",
        f"--worker_hosts={hosts['worker'][0]}",
        f"--ps_hosts={','.join(hosts['ps'])}",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2"}
    if FLAGS.ps_memory_limit_mb:
        env["MALLOC_ARENA_MAX"] = "2"
    tasks = [("worker", 0)] + [("ps", index) for index in range(FLAGS.num_ps)]
    servers = {
        (job, index): subprocess.Popen(
            [sys.executable, "-m", "engine.server", f"--task_type={job}", f"--task_index={index}", *cluster],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for job, index in tasks
    }
    try:
        ps = [servers[("ps", index)] for index in range(FLAGS.num_ps)]
        for process in servers.values():  # Serving: TensorFlow imported, the server up.
            assert process.stderr is not None
            while "serving at" not in (line := process.stderr.readline()):
                if not line and process.poll() is not None:
                    raise RuntimeError(f"an engine.server task exited with {process.returncode}")
        started_rss = [rss_mb(process.pid) for process in ps]
        if FLAGS.ps_memory_limit_mb:
            for process in ps:
                limit_growth(process.pid, FLAGS.ps_memory_limit_mb)
        setup = {
            "hosts": hosts,
            "way": way,
            "rows": FLAGS.rows,
            "width": FLAGS.width,
            "length": FLAGS.length,
            "num_ps": FLAGS.num_ps,
            "global_batch_size": FLAGS.global_batch_size,
            "warmup_steps": FLAGS.warmup_steps,
            "steps": FLAGS.steps,
            "ps_pids": [process.pid for process in ps],
        }
        coordinator = subprocess.Popen(
            [sys.executable, "-c", COORDINATOR, json.dumps(setup)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        returncode, stdout, stderr, ended = run_coordinator(coordinator, ps)
        if returncode != 0 and FLAGS.ps_memory_limit_mb:
            reason = out_of_memory_line(stderr) or ended
            if reason is not None:
                return {"failed": reason}
        if returncode != 0:
            raise RuntimeError(
                f"the {way} coordinator failed ({ended or f'status {returncode}'}): {stderr[-2000:]}"
            )
        figures = json.loads(stdout.split("RESULT ", 1)[1])
        now = figures.pop("ps_rss_now_mb")
        figures["ps_rss_mb"] = [round(after - before, 1) for after, before in zip(now, started_rss, strict=True)]
        figures["bytes_per_step"] = round(figures["bytes_per_step"])
        figures["examples_per_second"] = round(figures["examples_per_second"], 1)
        return figures
    finally:
        for process in servers.values():
            process.kill()  # Nothing if it ended already (under the memory limit).
            process.wait(timeout=30)


def main(argv: list[str]) -> None:
    del argv
    unknown = set(FLAGS.ways) - set(WAYS)
    if unknown:
        raise app.UsageError(f"--ways: {sorted(unknown)} not of {', '.join(WAYS)}")
    table_mb = FLAGS.rows * FLAGS.width * 4 / 2**20
    report: dict = {
        "rows": FLAGS.rows,
        "width": FLAGS.width,
        "table_mb": round(table_mb, 1),
        "num_ps": FLAGS.num_ps,
        "global_batch_size": FLAGS.global_batch_size,
        "steps": FLAGS.steps,
        "ps_memory_limit_mb": FLAGS.ps_memory_limit_mb,
        "ways": {},
    }
    for way in FLAGS.ways:
        started = time.perf_counter()
        report["ways"][way] = measure(way)
        report["ways"][way]["wall_s"] = round(time.perf_counter() - started, 1)
    # Ratios of the ways that trained.
    ways = {way: figures for way, figures in report["ways"].items() if "failed" not in figures}
    if {"one_shard", "sharded"} <= set(ways):
        report["largest_ps_memory_sharded_over_one_shard"] = round(
            max(ways["sharded"]["ps_rss_mb"]) / max(ways["one_shard"]["ps_rss_mb"]), 3
        )
        report["examples_per_second_sharded_over_one_shard"] = round(
            ways["sharded"]["examples_per_second"] / ways["one_shard"]["examples_per_second"], 3
        )
    for other in ("whole", "dense"):
        if {other, "sharded"} <= set(ways):
            report[f"bytes_per_step_{other}_over_sharded"] = round(
                ways[other]["bytes_per_step"] / ways["sharded"]["bytes_per_step"], 1
            )
    text = json.dumps(report, indent=2)
    print(text)
    if FLAGS.json:
        Path(FLAGS.json).parent.mkdir(parents=True, exist_ok=True)
        Path(FLAGS.json).write_text(text + "\n")


if __name__ == "__main__":
    define_flags()
    app.run(main)
