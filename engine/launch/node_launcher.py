"""`python -m engine.launch --nnodes=N --node_rank=I --rendezvous=HOST:PORT`: one node of a
cluster of several machines (run the same command on each, with its own --node_rank).

Each node's launcher picks free ports there, learns every task's address
through the rendezvous that node 0 serves (`engine.launch.rendezvous`),
and runs its `--workers_per_node` training tasks (`engine.main` under
multi_worker_mirrored, TF_CONFIG set) exactly as the local launcher does:
output prefixed by task, no child left behind. A task that dies makes
every node stop its tasks and join again, up to `--max_restarts` times in
all; with `--min_nodes` below `--nnodes` a node that does not come back
within `--rejoin_timeout` is left out and the run resumes from the latest
checkpoint on the nodes that remain, with the same global batch. The
start-up (every node joining) is bounded by the `--startup_timeout` given to
engine.main, with one line naming the nodes that never came; a node that
reaches no rendezvous proving the run's secret gives up after that long in
all, however many connections it tried; one whose own secret node 0 rejects
ends at once (exit 2). Nodes given different settings (the
flags after `--` that must be equal everywhere) end before any task starts,
with one line naming them (exit 2). SIGINT, SIGTERM or SIGHUP to any node's
launcher stops every node's tasks, each saving at the step they agree on.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from engine.cluster import security_warning
from engine.errors import PEER_LOST_EXIT, USER_ERROR_EXIT
from engine.launch.rendezvous import (
    SECRET_ENV,
    SECRET_FLAG,
    RendezvousClient,
    RendezvousServer,
    settings_digest,
    valid_host,
)
from engine.launch.task_processes import (
    SAVE_GRACE_SECONDS,
    STOP_GRACE_SECONDS,
    STOP_SIGNALS,
    Interrupted,
    Launcher,
    StopSignals,
    Task,
    cause_of,
    describe_exit,
    diagnostics_written,
    forward_report_requests,
    free_ports,
    make_tasks,
    shell_status,
    stopping_line,
    write_line,
)

POLL_SECONDS = 0.2
RESTART_GRACE_SECONDS = 2.0
MAX_TIMEOUT_SECONDS = 1e9  # as engine.main's timeouts: past it, a float of seconds stops counting


@dataclasses.dataclass(frozen=True)
class NodeOptions:
    """One node's part in a multi-host launch."""

    nnodes: int
    node_rank: int
    rendezvous: tuple[str, int]
    workers_per_node: int = 1
    min_nodes: int = 0  # 0: every node (the cluster never shrinks).
    max_restarts: int = 0
    startup_timeout: float = 300.0
    rejoin_timeout: float = 60.0
    heartbeat_timeout: float = 10.0
    host: str | None = None  # The address the others reach this node at; None: as node 0 sees it.
    model_dir: str | None = None  # engine.main's --model_dir: the last line names the reports there.

    @property
    def rendezvous_text(self) -> str:
        return f"{self.rendezvous[0]}:{self.rendezvous[1]}"


class NodeLauncher:
    """Joins rounds of the rendezvous and runs this node's tasks in each."""

    def __init__(
        self,
        options: NodeOptions,
        main_flags: Sequence[str],
        *,
        secret: bytes | None = None,
        settings: dict[str, str | None] | None = None,
    ):
        self.options = options
        self.main_flags = list(main_flags)
        self.secret = secret
        self.settings = dict(settings or {})
        self._client: RendezvousClient | None = None
        self._launcher: Launcher | None = None
        self._started = time.time()  # Reports written since then are this run's.

    def say(self, line: str) -> None:
        write_line(f"[launch node {self.options.node_rank}] {line}", sys.stderr)

    def _kill_tasks(self) -> None:
        if self._launcher is not None:
            self._launcher.kill_now()

    def run(self) -> int:
        options = self.options
        server = None
        if options.node_rank == 0:
            try:
                server = RendezvousServer(
                    options.rendezvous,
                    nnodes=options.nnodes,
                    min_nodes=options.min_nodes or options.nnodes,
                    max_restarts=options.max_restarts,
                    startup_timeout=options.startup_timeout,
                    rejoin_timeout=options.rejoin_timeout,
                    heartbeat_timeout=options.heartbeat_timeout,
                    workers_per_node=options.workers_per_node,
                    secret=self.secret,
                    settings=self.settings,
                    warn=self.say,
                ).start()
            except OSError as error:
                self.say(
                    f"error: cannot serve the rendezvous at {options.rendezvous_text} "
                    f"({error.strerror or error}): node 0 serves it, so give --rendezvous an address "
                    "of this host and a free port"
                )
                return 1
            secured = f"; nodes prove the secret ({SECRET_ENV} / {SECRET_FLAG})" if self.secret else ""
            self.say(
                f"serving the rendezvous at {options.rendezvous_text} for {options.nnodes} node(s){secured}"
            )
        signals = StopSignals(self._kill_tasks, say=self.say)
        signals.install()
        forward_report_requests(lambda: self._launcher)  # This node's tasks, of the round under way.
        try:
            status = self._rounds()
            signals.stop_under_way()  # A signal from here on: one line, never a traceback from the finally.
            return status
        except Interrupted as stop:
            name = signal.Signals(stop.signum).name
            self.say(stopping_line(stop.signum, "this node's tasks and the run on every node"))
            if self._client is not None:
                cause = f"node {options.node_rank} received {name}"
                self._client.send("stop", status=128 + stop.signum, cause=cause)
            if self._launcher is not None:
                self._launcher.stop(grace=SAVE_GRACE_SECONDS, signum=stop.signum)
            return 128 + stop.signum
        finally:
            signals.stop_under_way()
            if self._launcher is not None:
                self._launcher.stop()
            if self._client is not None:
                self._client.close()
            if server is not None:
                server.join(timeout=10)

    def _rounds(self) -> int:
        options = self.options
        # How long this node tries to reach a rendezvous that proves the run's secret: in all,
        # however many connections it takes; only a proven node 0 lost again starts it anew.
        deadline = self._reconnect_deadline()
        while True:
            client = RendezvousClient(
                options.rendezvous,
                # Waiting for a round, a node 0 that is silent (frozen) past either bound is lost.
                heartbeat_timeout=options.heartbeat_timeout or options.startup_timeout,
                secret=self.secret,
                workers_per_node=options.workers_per_node,
            )
            self._client = client
            if not client.connect(deadline):
                return self._unreached(client)
            ports = free_ports(options.workers_per_node, host="0.0.0.0")  # TF's servers listen on all.
            digest = settings_digest(self.settings)
            client.send(
                "join",
                rank=options.node_rank,
                ports=ports,
                host=options.host,
                settings=self.settings,
                digest=digest,
            )
            message = self._wait(client)
            client_lost = message is None or message["kind"] == "restart"
            if client_lost:
                # Node 0 went silent or away before our round: reach it again, for as long as a
                # start-up may take (a partitioned host comes back when its link does).
                client.close()
                deadline = self._reconnect_deadline()
                time.sleep(POLL_SECONDS)
                continue
            assert message is not None, "a round or an end"
            if message["kind"] == "end":
                return self._ended(message)
            outcome = self._run_round(client, message)
            assert self._launcher is not None, "started by _run_round"
            # A round that failed has nothing left to save (its collectives need the lost peer):
            # what still runs is ended after a short grace, and the next round resumes. A run
            # stopped by a signal on some node: every task saves at the step they agree on.
            signum = (outcome or 0) - 128
            if signum in STOP_SIGNALS:
                self._launcher.stop(grace=SAVE_GRACE_SECONDS, signum=signum)
            else:
                self._launcher.stop(grace=STOP_GRACE_SECONDS if outcome is not None else RESTART_GRACE_SECONDS)
            self._launcher = None
            client.close()
            if outcome is not None:
                return outcome
            deadline = self._reconnect_deadline()

    def _unreached(self, client: RendezvousClient) -> int:
        """The one line (and status) of a node that reached no rendezvous proving the secret."""
        options = self.options
        within = f"within {options.startup_timeout:g} s (--startup_timeout)"
        if client.rejected:  # Told at once: this node's secret is not node 0's, a rerun fails alike.
            self.say(f"error: the rendezvous at {options.rendezvous_text}: {client.unproven}")
            return USER_ERROR_EXIT
        if client.unproven:
            where = f"no rendezvous at {options.rendezvous_text} {within}"
            self.say(f"error: {where} that shares the secret: {client.unproven}")
            return USER_ERROR_EXIT
        why = f" (last: {client.failure})" if client.failure else ""
        self.say(
            f"error: no rendezvous at {options.rendezvous_text} {within}{why}: node 0's engine.launch "
            "serves it; start it, or check --rendezvous"
        )
        return PEER_LOST_EXIT  # Node 0 unavailable: a rerun may find it.

    def _reconnect_deadline(self) -> float:
        return time.monotonic() + (self.options.startup_timeout or float("inf"))

    def _wait(self, client: RendezvousClient) -> dict[str, Any] | None:
        """The next round, restart or end message; None where the line closes (node 0 silent
        past the heartbeat bound, or gone). No deadline of its own: node 0 bounds every
        gathering and says `end` when it gives up, also to a node left out of a smaller cluster."""
        while client.connected:
            for message in client.poll(POLL_SECONDS):
                if message.get("kind") in ("round", "end", "restart"):
                    return message
        return None

    def _run_round(self, client: RendezvousClient, message: dict[str, Any]) -> int | None:
        """Runs this node's tasks until the round ends: an exit status, or None to join again."""
        spec = {job: tuple(addresses) for job, addresses in message["spec"].items()}
        first = int(message["first_index"])
        tasks = [
            task
            for task in make_tasks(spec, self.main_flags)
            if first <= task.cluster.task_index < first + self.options.workers_per_node
        ]
        launcher = self._launcher = Launcher(tasks, say=self.say)
        launcher.restarts, launcher.restarts_lost_s = int(message["restarts"]), float(message["lost_s"])
        nodes = message.get("nodes", [])
        self.say(f"round with node(s) {', '.join(map(str, nodes))}: {len(spec['worker'])} worker(s)")
        ports = [int(task.cluster.address.rpartition(":")[2]) for task in tasks]
        print(security_warning("engine.launch", ports), file=sys.stderr, flush=True)
        for task in tasks:
            launcher.start(task)
        reported = False
        while True:
            for update in client.poll(POLL_SECONDS):
                if update["kind"] == "restart":
                    count = f"{update['restarts']}/{update['max_restarts']}"
                    self.say(f"restarting the cluster ({count}): {update['cause']}")
                    return None
                if update["kind"] == "end":
                    return self._ended(update)
            if not client.connected:
                self.say(f"lost the rendezvous at {self.options.rendezvous_text}; stopping this node's tasks")
                return None
            if reported:
                continue
            codes = [task.started.poll() for task in tasks]
            failed = [(task, code) for task, code in zip(tasks, codes, strict=True) if code not in (None, 0)]
            if failed:
                task, code = min(failed, key=lambda failure: failure[1] >= 0)
                cause = _cause_with_peer(task, code, tasks)
                self.say(f"{cause}; stopping this node's tasks")
                launcher.stop(grace=RESTART_GRACE_SECONDS)
                client.send("failed", cause=cause, status=shell_status(code))
                reported = True
            elif all(code == 0 for code in codes):
                client.send("done")
                reported = True

    def _ended(self, message: dict[str, Any]) -> int:
        status, reason = message["status"], message["reason"]
        reports = diagnostics_written(self.options.model_dir, self._started)
        if status:
            self.say(f"the run ended with exit status {status}: {reason}{reports}")
        else:
            self.say(f"done with exit status 0{reports}")
        return status


def _cause_with_peer(task: Task, code: int, tasks: list[Task]) -> str:
    """The local cause; for a task that lost a peer on another node (PEER_LOST_EXIT), the
    peer its last line names, as the local launcher says it: "worker:1 (HOST:PORT) stopped
    answering (no heartbeat for 10 s) (worker:0 exited with status 69)"."""
    if code == PEER_LOST_EXIT:
        lost = next((part for part in task.last_line.split(": ") if "stopped answering" in part), None)
        if lost:
            return f"{lost} ({task.name} {describe_exit(code)})"
    return cause_of(task, code, tasks)


def check_node_options(options: NodeOptions) -> str | None:
    """The one line that refuses inconsistent multi-host flags, or None."""
    if not 0 <= options.node_rank < options.nnodes:
        return f"--node_rank={options.node_rank} must be from 0 to --nnodes-1={options.nnodes - 1}"
    if options.min_nodes and not 1 <= options.min_nodes <= options.nnodes:
        return f"--min_nodes={options.min_nodes} must be from 1 to --nnodes={options.nnodes}"
    if options.workers_per_node < 1:
        return f"--workers_per_node={options.workers_per_node} must be at least 1"
    if not 0 <= options.rejoin_timeout <= MAX_TIMEOUT_SECONDS:  # nan fails both
        return f"--rejoin_timeout={options.rejoin_timeout:g} must be 0 to {MAX_TIMEOUT_SECONDS:g} seconds"
    if options.host is not None and not valid_host(options.host):
        return f"--advertise_host={options.host!r} must be a host name or an IP address"
    return None
