"""Helpers shared by the test files: the repository's path, the command line
in subprocesses (each with a timeout, its process group reaped), and the small
Keras model and data the Trainer tests train.

Test files import from here, never from one another, so that running one
file does not collect another's tests or depend on its fixtures."""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import io
import os
import re
import select
import socket
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from started_processes import group_exists, signal_group  # noqa: F401 (the tests' names for them)

REPO = Path(__file__).resolve().parents[1]

# The first line of a test's own TensorFlow program (`python -c COMMAND_START + program`): it starts
# as the engine's commands do, ~2.7 CPU-s cheaper than through `import engine` (tests/program_start.py).
COMMAND_START = f"import runpy; runpy.run_path({str(REPO / 'tests' / 'program_start.py')!r})\n"


def python_env(**extra: str) -> dict[str, str]:
    """The environment of a subprocess that imports this checkout's packages."""
    # PYTHONFAULTHANDLER: a process that crashes in native code prints its Python stack.
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "PYTHONFAULTHANDLER": "1",
        **extra,
    }


@contextlib.contextmanager
def environment(changes: dict[str, str | None] | None = None) -> Iterator[None]:
    """`os.environ` with `changes` (None: the variable unset), each put back on the way out,
    one variable at a time (pytest's MonkeyPatch). Not mock's `patch.dict` of `os.environ`: its
    way back clears the whole environment and sets it again (an unsetenv and a setenv per
    variable), while TensorFlow's threads of this process (tf.data's, an iterator being freed)
    may read it: glibc's getenv is not safe against that, and a worker crashed in it (SIGSEGV,
    main thread in mock's `_unpatch_dict`). With no changes, the environment is not touched."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in (changes or {}).items():
            if value is None:
                patch.delenv(name, raising=False)
            else:
                patch.setenv(name, value)
        yield


# ------------------------------------------------------------------ the command line


def run_main(
    *flags: str, cwd: Path | None = None, timeout: int = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine.main", *flags],
        cwd=cwd or REPO,
        env=python_env(**(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def main_in_process(
    *flags: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """`python -m engine.main FLAGS` inside this process: absl's flag parsing, `RunConfig`
    and the job, with `env` added to the environment. Returns what `run_main` would
    (exit status, stdout, stderr with the engine's log lines) at a fraction of its cost;
    for runs that are refused or tiny, since the job shares this process's TensorFlow
    state (devices, seeds). The process-wide settings a job changes on its way to a
    refusal (the Keras dtype policy, log levels) are put back afterwards. With `cwd`, as
    `python -m` run there: that directory first on sys.path, its modules (a user's
    `models.py`) in place of this process's of the same name (see `_imports_from`)."""
    import logging as py_logging

    from absl import flags as absl_flags
    from absl import logging as absl_logging

    from engine.cli import main_command as cli

    # TensorFlow has no way back from op determinism: on, it would fail later tests' timestamps.
    assert not any(flag.startswith("--deterministic") for flag in flags), "use run_main for --deterministic"

    stdout, stderr = io.StringIO(), io.StringIO()
    # What engine.main's process prints: the log lines (absl's at INFO, as run_cli sets; the
    # library's), which reach the root logger's handlers there as here, on stderr.
    log_lines = py_logging.StreamHandler(stderr)
    log_lines.setFormatter(absl_logging.PythonFormatter())
    root_logger = py_logging.getLogger()
    verbosity, tf_level = absl_logging.get_verbosity(), tf.get_logger().level
    policy = keras.config.dtype_policy()
    root_logger.addHandler(log_lines)
    absl_logging.set_verbosity(absl_logging.INFO)
    try:
        with (
            environment(env),
            _imports_from(cwd) if cwd is not None else contextlib.nullcontext(),
            contextlib.redirect_stdout(stdout),
            contextlib.redirect_stderr(stderr),
        ):
            try:
                argv = cli.parse_flags(["engine.main", *flags])
                code = cli.main_with_clean_errors(argv)
            except SystemExit as exited:
                code = exited.code if isinstance(exited.code, int) else 1
            finally:
                absl_flags.FLAGS.unparse_flags()
    finally:
        root_logger.removeHandler(log_lines)
        absl_logging.set_verbosity(verbosity)
        tf.get_logger().setLevel(tf_level)
        keras.config.set_dtype_policy(policy)
    return subprocess.CompletedProcess(["engine.main", *flags], code, stdout.getvalue(), stderr.getvalue())


@contextlib.contextmanager
def _imports_from(directory: Path):
    """Imports as in a process started in `directory`: it is the working directory and first
    on sys.path, the top-level modules it holds hide this process's of the same name, and
    whatever was imported from it is forgotten afterwards (the next test's files differ)."""
    from engine.cli.process import own_packages

    directory = Path(directory).resolve()
    names = {p.stem for p in directory.glob("*.py")} | {p.parent.name for p in directory.glob("*/__init__.py")}
    hidden = {key: module for key, module in sys.modules.items() if key.split(".")[0] in names}
    private = dict(own_packages._private)  # the engine's packages it loaded beside a user's
    for key in hidden:
        del sys.modules[key]
    sys.path.insert(0, str(directory))
    try:
        with contextlib.chdir(directory):
            yield
    finally:
        sys.path.remove(str(directory))
        for key in [key for key in sys.modules if key.split(".")[0] in names]:
            del sys.modules[key]
        sys.modules.update(hidden)
        own_packages._private.clear()
        own_packages._private.update(private)


def run_config(*flags: str, env: dict[str, str] | None = None):
    """The `RunConfig` engine.main builds from FLAGS (absl's parsing, then validation) in
    this process; raises its UserError, spelled in flags as engine.main prints it. Nothing
    runs, so a check that fails cannot hang."""
    from absl import flags as absl_flags

    from engine.cli import main_command as cli  # noqa: F401  (defines the flags)
    from engine.cli.config.config_files import config_from_flags  # over --config_file, <model_dir>/config.yaml
    from engine.cli.config.flag_names import errors_in_flag_terms

    with environment(env), errors_in_flag_terms():
        try:
            absl_flags.FLAGS(["engine.main", *flags])
            return config_from_flags(absl_flags.FLAGS)
        finally:
            absl_flags.FLAGS.unparse_flags()


def in_background(function, *args, **kwargs) -> concurrent.futures.Future:
    """`function(*args, **kwargs)` (a `run_main`, a `subprocess.run`) in a thread of its own, so that
    a test runs independent processes at once instead of one after another; `.result()` waits
    for it and returns its value or raises its exception. Each call has its own thread: a
    process that hangs ends at its own timeout, never blocking another test's."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(function(*args, **kwargs))
        except BaseException as error:  # handed to the caller of .result()
            future.set_exception(error)

    threading.Thread(target=run, daemon=True).start()
    return future


# A run that trains until it is stopped (a signal, a kill): loops of 20 steps, no evaluation,
# no checkpoint of its own before the stop.
UNTIL_STOPPED = [
    "--model=mlp",
    "--train_steps=1000000",
    "--steps_per_loop=20",
    "--eval_every=0",
    "--checkpoint_every=1000000",
]


def popen_main(*flags: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`engine.main` in its own process group (so `stop` ends whatever it started)."""
    return subprocess.Popen(
        [sys.executable, "-m", "engine.main", *flags],
        cwd=REPO,
        env=python_env(**(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        process_group=0,
    )


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL to the process group `process` leads, then reaps the process."""
    signal_group(process)
    process.wait(timeout=30)


def stop(process: subprocess.Popen) -> None:
    """kill -9 to a `popen_main` process and its group if still running; reaps it."""
    signal_group(process)
    process.communicate(timeout=30)


def wait_for_text(log: Path, pattern: str, process: subprocess.Popen, timeout: float) -> re.Match:
    """The first match of `pattern` in the file `log` a running `process` writes; fails when the
    process exits first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while not (match := re.search(pattern, log.read_text())):
        assert process.poll() is None, (
            f"exited {process.returncode} before {pattern!r}:\n{log.read_text()[-3000:]}"
        )
        assert time.monotonic() < deadline, f"no {pattern!r} in {timeout} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)
    return match


def read_until(pipe, text: str, timeout: float, process: subprocess.Popen | None = None) -> str:
    """Reads a process's stdout or stderr pipe until `text` appears and returns
    what was read; a silent or hung process fails the test after `timeout`
    seconds instead of blocking it. Reads the pipe itself (not the buffered
    file), so `communicate()` afterwards gets the rest."""
    fd = pipe.fileno()
    seen = b""
    deadline = time.monotonic() + timeout
    while text.encode() not in seen:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"no {text!r} in {timeout} s:\n{seen.decode(errors='replace')[-3000:]}"
        if select.select([fd], [], [], min(remaining, 1.0))[0]:
            chunk = os.read(fd, 65536)
            ended = _how_it_ended(process) if not chunk else ""
            assert chunk, f"the pipe closed before {text!r} ({ended}):\n{seen.decode(errors='replace')[-3000:]}"
            seen += chunk
    return seen.decode(errors="replace")


def _how_it_ended(process: subprocess.Popen | None) -> str:
    """The exit status of the process whose pipe closed, for the failing test's message."""
    if process is None:
        return "its process not given"
    try:
        return f"exit status {process.wait(timeout=10)}"
    except subprocess.TimeoutExpired:
        return "its process still runs"


def read_stderr_until(process: subprocess.Popen, text: str, timeout: float) -> str:
    return read_until(process.stderr, text, timeout, process)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The run's single `engine.main: error:` line; fails unless it exited 2 without a traceback."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("engine.main: error:")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("localhost", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


# ---------------------------------------------------------------- clusters on localhost


@contextlib.contextmanager
def ps_servers(num_workers: int, num_ps: int) -> Iterator[dict[str, list[str]]]:
    """A parameter-server cluster's worker and ps tasks as `engine.server` processes on
    localhost, one process a task as users run them; yields the cluster's hosts, with a chief
    address for the coordinator the test runs. Every task is killed at the end."""
    ports = iter(free_ports(1 + num_workers + num_ps))
    hosts = {
        "chief": [f"localhost:{next(ports)}"],
        "worker": [f"localhost:{next(ports)}" for _ in range(num_workers)],
        "ps": [f"localhost:{next(ports)}" for _ in range(num_ps)],
    }
    flags = [f"--{job}_hosts={','.join(hosts[job])}" for job in ("worker", "ps")]
    flags.append(f"--chief_host={hosts['chief'][0]}")
    servers = [
        subprocess.Popen(
            [sys.executable, "-m", "engine.server", f"--task_type={job}", f"--task_index={index}", *flags],
            cwd=REPO,
            env=python_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            process_group=0,
        )
        for job in ("worker", "ps")
        for index in range(len(hosts[job]))
    ]
    try:
        yield hosts
    finally:
        for server in servers:
            kill_group(server)


# TensorFlow's C++ lines at import and first device listing, which engine.native_logs holds back.
NATIVE_START_UP_LINES = (
    "cuInit",
    "cpu_feature_guard",
    "cudart_stub",
    "InitializeLog",
    "oneDNN custom operations",
)

SMALL = [
    "--model=mlp",
    "--dataset=synthetic",
    "--optimizer=sgd",
    "--learning_rate=0.1",
    "--global_batch_size=32",
    "--eval_every=0",
]


class Launched:
    """`python -m engine.launch ...` in its own process group, output collected live."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, inside: Sequence[str] = ()):
        """`inside`: the command that runs the launcher elsewhere (`ip netns exec HOST`)."""
        self.process = subprocess.Popen(
            [*inside, sys.executable, "-m", "engine.launch", *args],
            cwd=REPO,
            env=python_env(**(env or {})),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            process_group=0,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    @property
    def output_without_grpc_noise(self) -> str:
        """The output less TF's per-call gRPC complaints about a dead peer,
        which otherwise bury the line that says what went wrong."""
        noise = (
            "Failed to remove function remotely",
            "Additional GRPC error information",
            "Error received from peer",
            "This could happen if the remote target",
        )
        return "\n".join(line for line in self.lines if not any(n in line for n in noise))

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                match = re.search(pattern, line)
                if match:
                    return match
            if self.process.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.1)
        raise AssertionError(f"no line matches {pattern!r}:\n{self.output[-4000:]}")

    def wait(self, timeout: float) -> int:
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout} s:\n{self.output[-4000:]}") from None
        self._reader.join(timeout=10)
        return code

    def ports(self) -> list[int]:
        match = self.wait_for(r"gRPC port\(s\) ([\d, ]+) accept", timeout=1)
        return [int(port) for port in match.group(1).split(",")]

    def kill_all(self) -> None:
        """Cleanup: the whole process group, whatever state the test left it in."""
        signal_group(self.process)
        self.process.wait(timeout=30)

    def assert_nothing_left(self) -> None:
        """No process of the run survives, and no port accepts connections."""
        deadline = time.monotonic() + 15
        while group_exists(self.process):
            assert time.monotonic() < deadline, f"processes of the run survive:\n{self.output[-3000:]}"
            time.sleep(0.2)
        for port in self.ports():
            with socket.socket() as sock, pytest.raises(ConnectionRefusedError):
                sock.connect(("localhost", port))


# ------------------------------------------------------------------------ model_dir


def snapshot(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def checkpoint_files(model_dir: Path) -> dict[str, tuple[bytes, int]]:
    """Bytes and mtime of every ckpt-* file: what must never be overwritten."""
    return {
        p.name: (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted((model_dir / "checkpoints").glob("ckpt-*"))
        if p.is_file()
    }


def file_tree(directory: Path) -> dict[str, object]:
    """Every entry under `directory` by kind: a file's bytes, a link's target, a directory or FIFO."""
    entries: dict[str, object] = {}
    for path in sorted(directory.rglob("*")):
        name = str(path.relative_to(directory))
        if path.is_symlink():
            entries[name] = ("link", os.readlink(path))
        elif path.is_fifo():
            entries[name] = "fifo"
        elif path.is_dir():
            entries[name] = "dir"
        else:
            entries[name] = (path.read_bytes(), oct(path.stat().st_mode), path.stat().st_nlink)
    return entries


def copy_of(source: Path, destination: Path) -> Path:
    subprocess.run(["cp", "-r", str(source), str(destination)], check=True)
    return destination


def latest_step(model_dir: Path) -> int | None:
    """The step of the checkpoint the state file names as the latest, or None."""
    try:
        state = (model_dir / "checkpoints" / "checkpoint").read_text()
    except FileNotFoundError:
        return None
    match = re.search(r'^model_checkpoint_path: ".*ckpt-(\d+)"', state, re.M)
    return int(match.group(1)) if match else None


def wait_for_checkpoint(
    model_dir: Path, process: subprocess.Popen, timeout: float = 240, beyond: int = -1
) -> int:
    """Waits until the latest checkpoint's step is past `beyond` (any step by
    default) while the process still runs; returns that step."""
    deadline = time.monotonic() + timeout
    while (step := latest_step(model_dir)) is None or step <= beyond:
        assert process.poll() is None, process.communicate(timeout=30)[1][-3000:]
        assert time.monotonic() < deadline, f"no checkpoint past step {beyond} appeared in {timeout} s"
        time.sleep(0.05)
    return step


def model_weights(model_dir: Path, step: int) -> dict[str, np.ndarray]:
    reader = tf.train.load_checkpoint(str(model_dir / "checkpoints" / f"ckpt-{step}"))
    # The model's weights are saved once, under the optimizer that tracks them too.
    return {
        name: reader.get_tensor(name)
        for name in reader.get_variable_to_shape_map()
        if name.startswith(("optimizer/_trainable_variables/", "global_step/"))
    }


def read_scalars(log_dir) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of every scalar in a run's event files."""
    found: dict[str, dict[int, float]] = {}
    for path in sorted(log_dir.glob("events.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name != "scalars":  # The graph, histograms.
                    continue
                found.setdefault(value.tag, {})[event.step] = float(tf.make_ndarray(value.tensor))
    return found


def eval_steps(model_dir: Path) -> list[int]:
    """The steps of every eval `loss` summary in <model_dir>/eval, in the order written."""
    steps = []
    for events in sorted((model_dir / "eval").glob("events.*")):
        for event in tf.compat.v1.train.summary_iterator(str(events)):
            steps += [event.step for value in event.summary.value if value.tag == "loss"]
    return steps


# ------------------------------------------------------- a small model for the Trainer

NUM_FEATURES = 6
NUM_CLASSES = 3


def make_arrays(n: int, seed: int = 0):
    rng = np.random.RandomState(seed)
    x = rng.rand(n, NUM_FEATURES).astype("float32")
    y = (x[:, 0] * NUM_CLASSES).astype("int32") % NUM_CLASSES
    return x, y


def id_sequences(count: int, *, vocab: int, length: int, classes: int, seed: int = 0):
    """Sequences of ids in [1, vocab) with trailing padding (id 0), and a class learnable from
    their first id: the data of the embedding-table tests."""
    rng = np.random.RandomState(seed)
    ids = rng.randint(1, vocab, size=(count, length)).astype("int32")
    for row, used in enumerate(rng.randint(1, length + 1, size=count)):
        ids[row, used:] = 0
    return ids, (ids[:, 0] % classes).astype("int32")


def make_model(strategy, seed: int = 3, l2: float = 0.0):
    with strategy.scope():
        regularizer = keras.regularizers.L2(l2) if l2 else None
        model = keras.Sequential(
            [
                keras.Input((NUM_FEATURES,)),
                keras.layers.Dense(16, activation="relu", kernel_regularizer=regularizer),
                keras.layers.Dense(NUM_CLASSES),
            ]
        )
        optimizer = keras.optimizers.SGD(0.5)
    rng = np.random.RandomState(seed)  # Same start for every strategy.
    model.set_weights([rng.normal(0, 0.5, w.shape).astype("float32") for w in model.get_weights()])
    return model, optimizer


def loss_fn():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def make_trainer(
    strategy=None,
    *,
    arrays=None,
    batch: int = 16,
    seed: int = 3,
    l2: float = 0.0,
    trainer_class: type | None = None,
    **overrides,
):
    """The tests' Trainer: the small model (`make_model(strategy, seed, l2)`) on repeated global
    batches of `batch` from `arrays` (64 examples of `make_arrays` by default), in `strategy`
    (the current one by default). Any Trainer keyword in `overrides` replaces its default,
    `model`, `optimizer` and `train_data` included (`loss_fn=None`: no loss of the tests', as
    for a compiled Keras model or a `step_fn`). The options go in their groups
    (`cadence=engine.Cadence(...)`): a flat alias is refused here, as only the tests of the
    flat shim (tests/unit/test_options.py) pass them, to `engine.Trainer` itself. `trainer_class`:
    another Trainer class than `engine.Trainer` (`CoordinatedTrainer` under parameter servers)."""
    import engine
    from engine.options import FLAT_ALIASES

    flat = sorted(FLAT_ALIASES & overrides.keys())
    assert not flat, f"make_trainer takes the option groups, not the flat aliases {flat}"
    strategy = strategy or tf.distribute.get_strategy()
    if "model" not in overrides:
        overrides["model"], default_optimizer = make_model(strategy, seed=seed, l2=l2)
        overrides.setdefault("optimizer", default_optimizer)
    if "train_data" not in overrides:
        x, y = arrays if arrays is not None else make_arrays(64)
        overrides["train_data"] = global_batches(x, y, batch)
    if "loss_fn" not in overrides:
        overrides["loss_fn"] = loss_fn()
    arguments = {"strategy": strategy, "global_batch_size": batch}
    trainer_class = trainer_class or engine.Trainer
    return trainer_class(**{**arguments, **overrides})


def small_trainer(model_dir, **overrides):
    """`make_trainer` checkpointing every 2 steps into `model_dir`, in loops of 2: for tests of
    what lands on disk."""
    import engine

    cadence = engine.Cadence(steps_per_loop=2, checkpoint_every=2)
    return make_trainer(**{"cadence": cadence, "model_dir": str(model_dir), **overrides})


def global_batches(x, y, batch):
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch, drop_remainder=True)


# ------------------------------------------------------- the docs' examples


def readme_example(name: str) -> str:
    """The example block `name`, from README.md or a page of docs/ (exactly one of them holds it)."""
    pattern = rf"<!-- example: {name} -->\s*```python\n(.*?)```"
    found = [
        match.group(1)
        for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
        for match in re.finditer(pattern, page.read_text(), re.S)
    ]
    assert len(found) == 1, f"README.md and docs/*.md have {len(found)} example blocks {name!r}, not one"
    return found[0]


def _npy_declaring(shape: tuple[int, ...]) -> bytes:
    """An .npy member whose header declares `shape` of float64 but which holds no data."""
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": "<f8", "fortran_order": False, "shape": shape})
    return out.getvalue()


def npz_bomb(path: Path, member: str = "x_train", shape: tuple[int, ...] = (2**29, 8)) -> Path:
    """A few hundred bytes of zip whose `member` declares 32 GiB (2**29 x 8 float64) by its header."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(f"{member}.npy", _npy_declaring(shape))
        for name, array in (("y_train", np.zeros(4)), ("x", np.zeros((4, 8)))):
            if name != member:
                with archive.open(f"{name}.npy", "w") as handle:
                    np.lib.format.write_array(handle, array)
    return path
