"""Local cluster launcher: one controlplane and T*P workerd child processes.

Used by `kvloom up`, `kvloom run` and the serving benchmark's --launch mode.
`Cluster.start()` picks free ports (the API, the worker port, the
controlplane's /metrics and one /metrics per rank), checks before it spawns
anything that no other process holds a port and that the controlplane accepts
its arguments, the model and the layout (`python -m controlplane --check`:
`--pp 99` fails in a second, not after 99 processes), then spawns
`python -m controlplane` and one `python -m workerd --rank R` per rank
(the cluster's auth token, if any, in their environment), and relays their
output with a "[controlplane] " / "[rank R] " prefix; `wait_ready()` polls the grpc health
service "kvloom.v1.Generation" until SERVING, failing fast (with the dead
process's last log lines) if a child exits first; `stop()` sends SIGTERM and
SIGKILLs whatever outlives the grace period.

Supervision (foreground only): `monitor(restart_workers=True)` restarts a
worker that dies once the cluster has served (same argv: same rank, same
metrics port) with the back-off and crash-loop limit of
kvloom_cli.supervisor.RestartPolicy; the controlplane's death stays fatal, and
so does a worker's before `wait_ready()` returned (a configuration error).
Restarts are spawned by the thread that runs `monitor()` / `supervise_once()`,
so run it on a thread that lives as long as the cluster (`kvloom up`: the main
thread): PR_SET_PDEATHSIG fires when the *thread* that forked a child exits.
`stop()` and supervision share a lock, so a worker that stop() SIGTERMs is
never restarted. Detached clusters have no supervisor.

With a ClusterTls (`kvloom up --tls`: issue_cluster_tls writes a throw-away
CA and certificates) the controlplane serves its API and its worker port over
TLS and requires a client certificate from that CA on both (mTLS); every rank
dials with the worker certificate; wait_ready() and `kvloom run` use the
client certificate, whose paths `up` prints for other clients.

Processes in front of the cluster (`spawn_front`: the SMG gateway of
`kvloom up --openai-port`, kvloom_cli.gateway) are started once the cluster is
ready, supervised like a worker and stopped before everything else.

Foreground children share a process group of their own (so a terminal
Ctrl-C reaches only the launcher, which then stops them in order) and, on
Linux, get PR_SET_PDEATHSIG so a SIGKILLed launcher leaves no orphans.
Detached children (`kvloom up --detach`) get their own session and log files
instead; their pids go into a state file that `kvloom down` reads.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO

from kvloom.client import READY_SERVICE, KvloomClient, KvloomError
from kvloom.common.cpu_cores import CpuPlan  # noqa: F401 (API)
from kvloom.common.ports import connect_host, pick_free_ports  # noqa: F401 (API)
from kvloom.common.procs import (  # noqa: F401 (Terminated, alive, exit_how, termination_as_exception: API)
    Terminated,
    alive,
    exit_how,
    process_start_time,
    reap,
    stop_pids,
    termination_as_exception,
    with_parent_death_signal,
)
from kvloom_cli.children import (  # noqa: F401 (relay_lines, TAIL_LINES: API)
    TAIL_LINES,
    ManagedProcess,
    Restart,
    describe_exit,
    relay_lines,
)
from kvloom_cli.cluster_spec import (  # noqa: F401 (what a cluster launches: API)
    ClusterError,
    ClusterSpec,
    Ports,
    child_env,
    controlplane_command,
    cpu_plan,
    preflight,
    resolve_ports,
    workerd_command,
)
from kvloom_cli.cluster_state import (  # noqa: F401 (the detached-cluster API)
    ClusterState,
    default_state_file,
    running_processes,
    stop_detached,
)
from kvloom_cli.cluster_tls import (  # noqa: F401 (ClusterTls, issue_cluster_tls: API)
    ClusterTls,
    issue_cluster_tls,
    tls_controlplane_args,
    tls_worker_args,
)
from kvloom_cli.supervisor import CrashLoop, RestartPolicy, Supervisor

# wait_ready's channel: its first polls find no listener, and gRPC's default
# reconnect back-off (1 s, growing 1.6x) then hid a ready cluster for seconds
# (docs/benchmarks.md, "Start-up"). Loopback or a local network: retry at
# 0.1-0.5 s.
READINESS_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
)


class Cluster:
    """A controlplane and its workers as children of this process."""

    def __init__(
        self, spec: ClusterSpec, *, log_sink: IO[str] | None = None, log_dir: Path | None = None,
        restart_policy: RestartPolicy | None = None,
    ):
        self.spec = spec
        self.log_sink = log_sink if log_sink is not None else sys.stderr
        # With a log_dir the children write files and outlive us (detached mode).
        self.log_dir = log_dir
        self.processes: list[ManagedProcess] = []
        self.model = ""
        self.ports = Ports(0, 0, 0)
        self._checked = False
        self._lock = threading.Lock()
        # Worker restarts (supervise_once); every one done so far, in order.
        self.supervisor = Supervisor(restart_policy)
        self.restarts: list[Restart] = []
        self._exited: dict[str, tuple[int, float]] = {}  # name -> (exit code, delay)
        # Held while supervising and while stop() marks the cluster stopping,
        # so stop() never races a restart.
        self._supervise_lock = threading.RLock()
        self._stopping = threading.Event()

    @property
    def api_address(self) -> str:
        return f"{connect_host(self.spec.host)}:{self.ports[0]}"

    @property
    def metrics_address(self) -> str:
        return f"http://{connect_host(self.spec.host)}:{self.ports.metrics}/metrics"

    @property
    def worker_metrics_addresses(self) -> list[str]:
        """Each rank's /metrics URL, in rank order."""
        host = connect_host(self.spec.host)
        return [f"http://{host}:{port}/metrics" for port in self.ports.worker_metrics]

    def check(self) -> None:
        """Resolve the model and the ports and preflight() them; spawns nothing."""
        self.model = _resolve_model(self.spec.model)
        self.ports = resolve_ports(self.spec)
        preflight(self.spec, self.model, self.ports)
        self._checked = True

    @property
    def restart_counts(self) -> dict[int, int]:
        """Restarts per rank so far (ranks never restarted are absent)."""
        counts: dict[int, int] = {}
        for restart in self.restarts:
            if restart.rank is not None:
                counts[restart.rank] = counts.get(restart.rank, 0) + 1
        return counts

    @property
    def stopping(self) -> bool:
        """stop() has been called."""
        return self._stopping.is_set()

    def start(self) -> None:
        """check() (unless done), spawn the controlplane and every rank, relay their logs."""
        if not self._checked:
            self.check()
        self._spawn("controlplane", controlplane_command(self.spec, self.model, self.ports))
        for rank in range(self.spec.world_size):
            argv = workerd_command(
                self.spec, self.ports.worker, rank, self.ports.worker_metrics[rank]
            )
            self._spawn(f"rank {rank}", argv)
        if self.log_dir is None:
            for proc in self.processes:
                self._start_relay(proc)

    def spawn_front(self, name: str, argv: list[str], env: dict[str, str]) -> ManagedProcess:
        """Start a process in front of the running cluster (the gateway), with
        its own environment (not the daemons': no auth token). It is
        supervised like a worker and stopped before the rest."""
        with self._supervise_lock:
            if self._stopping.is_set():
                raise ClusterError(f"the cluster is stopping; {name} not started")
            proc = self._launch(name, argv, env=env, front=True)
            self.processes.append(proc)
            self.supervisor.started(name)
        if self.log_dir is None:
            self._start_relay(proc)
        return proc

    def _spawn(self, name: str, argv: list[str]) -> None:
        self.processes.append(self._launch(name, argv))
        self.supervisor.started(name)

    def _launch(
        self, name: str, argv: list[str] | tuple[str, ...], tail: deque[str] | None = None,
        env: dict[str, str] | None = None, front: bool = False,
    ) -> ManagedProcess:
        command = list(argv)
        kwargs: dict = {"stdin": subprocess.DEVNULL, "stderr": subprocess.STDOUT}
        log_path = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log_path = self.log_dir / (name.replace(" ", "") + ".log")
            kwargs["stdout"] = open(log_path, "ab")  # noqa: SIM115 - the child owns it
            kwargs["start_new_session"] = True
        else:
            kwargs["stdout"] = subprocess.PIPE
            # Join the controlplane's group; 0 makes the controlplane its leader.
            # A cluster of front processes only (the gateway of a ClusterSet)
            # has no daemon to join: each gets a group of its own, so a
            # restart never names the group of a process already reaped.
            leader = next((p for p in self.processes if not p.front), None)
            kwargs["process_group"] = leader.popen.pid if leader is not None else 0
            argv = with_parent_death_signal(command, self.spec.python)
        try:
            popen = subprocess.Popen(argv, env=env if env is not None else child_env(self.spec),
                                     **kwargs)
        finally:
            if log_path is not None:
                kwargs["stdout"].close()
        proc = ManagedProcess(name, popen, log_path=log_path, argv=tuple(command), env=env,
                              front=front)
        if tail is not None:
            proc.tail = tail
        return proc

    def _start_relay(self, proc: ManagedProcess) -> None:
        args = (proc.popen.stdout, f"[{proc.name}] ", self.log_sink, proc.tail, self._lock)
        threading.Thread(target=relay_lines, args=args, daemon=True).start()

    def check_alive(self, phase: str = "during start-up") -> None:
        for proc in self.processes:
            code = proc.popen.poll()
            if code is not None:
                raise ClusterError(describe_exit(proc, code, phase))

    def monitor(
        self, poll_interval: float = 0.5, *, restart_workers: bool = False,
        stop_requested: Callable[[], bool] | None = None,
        on_restart: Callable[[list[Restart]], None] | None = None,
    ) -> None:
        """Block while the cluster runs; raise ClusterError when a child exits
        for good. restart_workers: a dead worker is restarted (supervise_once)
        instead, and only the controlplane's death or a crash loop is fatal.
        Returns once stop() was called (from another thread). Restarts are
        forked by the calling thread: call it from one that outlives the cluster.
        stop_requested: when it turns true (e.g. `kvloom down` is stopping
        us) exits are reported, not restarted; on_restart gets each pass's
        new restarts (e.g. to record the new pids)."""
        monitor_until_stopped(self, self._stopping, poll_interval, restart_workers,
                              stop_requested, on_restart)

    def supervise_once(self, *, stop_requested: Callable[[], bool] | None = None) -> list[Restart]:
        """One supervision pass: note the workers that died (each restart is
        scheduled after its back-off, one log line each) and restart those
        whose back-off has passed; returns the restarts done in this pass.
        Raises ClusterError when the controlplane died or a rank crash-loops.
        Does nothing once stop() was called; when stop_requested() is true,
        behaves like check_alive() (any exit raises, nothing restarts)."""
        with self._supervise_lock:
            if self._stopping.is_set():
                return []
            if stop_requested is not None and stop_requested():
                self.check_alive(phase="while serving")
                return []
            for proc in self.processes:
                code = proc.popen.poll()
                if code is None or self.supervisor.pending(proc.name):
                    continue
                if proc.name == "controlplane":
                    raise ClusterError(describe_exit(proc, code, "while serving"))
                try:
                    delay = self.supervisor.exited(proc.name)
                except CrashLoop as loop:
                    phase = (f"while serving, after {loop.restarts} restarts within "
                             f"{loop.window:.0f}s (a crash loop; giving up)")
                    raise ClusterError(describe_exit(proc, code, phase)) from None
                self._exited[proc.name] = (code, delay)
                when = f"in {delay:.1f}s" if delay > 0 else "now"
                same = "same rank and flags" if proc.rank is not None else "same flags"
                self._note(f"kvloom: {proc.name} {exit_how(code)}; restarting it {when} ({same})")
            return [self._restart(name) for name in self.supervisor.due()]

    def _restart(self, name: str) -> Restart:
        index, old = next((i, p) for i, p in enumerate(self.processes) if p.name == name)
        reap(old.popen)
        try:
            new = self._launch(name, old.argv, tail=old.tail, env=old.env, front=old.front)
        except (OSError, subprocess.SubprocessError) as exc:
            raise ClusterError(f"could not restart {name}: {exc}") from exc
        self.processes[index] = new  # same slot, same name: lookups by name see it
        self.supervisor.started(name)
        if self.log_dir is None:
            self._start_relay(new)
        code, delay = self._exited.pop(name)
        restart = Restart(name, old.rank, code, delay, new.popen.pid)
        self.restarts.append(restart)
        return restart

    def _note(self, line: str) -> None:
        with self._lock:  # the relay threads' lock: whole lines only
            self.log_sink.write(line + "\n")
            self.log_sink.flush()

    def wait_ready(self, timeout: float = 600.0, poll_interval: float = 0.1) -> None:
        """Block until the controlplane reports kvloom.v1.Generation SERVING."""
        deadline = time.monotonic() + timeout
        with self.client(options=READINESS_CHANNEL_OPTIONS) as client:
            while True:
                self.check_alive()
                try:
                    if client.health(READY_SERVICE, timeout=2.0) == "SERVING":
                        return
                except KvloomError:
                    pass  # not listening yet, or still loading
                if time.monotonic() > deadline:
                    raise ClusterError(f"cluster not ready after {timeout:.0f}s")
                time.sleep(poll_interval)

    def client(self, options: tuple = ()) -> KvloomClient:
        """A client of this cluster's API (with the client certificate under TLS)."""
        tls = self.spec.tls
        if tls is None:
            return KvloomClient(self.api_address, options=options)
        return KvloomClient(self.api_address, options=options, ssl_ca_certs=tls.ca_certs,
                            ssl_certfile=tls.client.certfile, ssl_keyfile=tls.client.keyfile)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every child, then SIGKILL those still running after `grace` seconds.
        Waits for a supervision pass under way, and none restarts anything after."""
        with self._supervise_lock:
            self._stopping.set()
        # Front processes first: the gateway stops taking requests before the
        # controlplane drains, so it never routes to a closing engine.
        for front in (True, False):
            group = [p for p in self.processes if p.front is front]
            stop_pids([(p.name, p.popen.pid) for p in group if p.popen.poll() is None], grace)
            for proc in group:
                reap(proc.popen)

    def state(self) -> ClusterState:
        processes = {}
        for proc in self.processes:
            processes[proc.name] = [proc.popen.pid, process_start_time(proc.popen.pid) or 0]
        return ClusterState(
            api=self.api_address, metrics=self.metrics_address, worker_port=self.ports[1],
            model=self.model, processes=processes, log_dir=str(self.log_dir or ""),
            worker_metrics=self.worker_metrics_addresses,
            front=[p.name for p in self.processes if p.front],
        )

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.stop()  # the processes spawned before the failure
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


class SupervisorThread(threading.Thread):
    """Runs cluster.monitor(restart_workers=True) in the background until
    cluster.stop(), for callers whose main thread is busy (`kvloom run`, tests).
    The workers it restarts are its children, tied to its life by
    PR_SET_PDEATHSIG; it lives until the cluster stops. A fatal ClusterError
    (the controlplane died, a rank crash-loops) is kept in .error and stops
    the cluster, so a client waiting on it fails instead of hanging."""

    def __init__(self, cluster: Cluster, poll_interval: float = 0.5):
        super().__init__(name="kvloom-supervisor", daemon=True)
        self.cluster = cluster
        self.poll_interval = poll_interval
        self.error: ClusterError | None = None

    def run(self) -> None:
        try:
            self.cluster.monitor(self.poll_interval, restart_workers=True)
        except ClusterError as exc:
            self.error = exc
            self.cluster.stop()


def _resolve_model(model: str | None) -> str:
    # Unset or an embedded model's name: resolved here, once, so a conversion
    # (first run only) happens before any daemon starts instead of racing the
    # controlplane's start-up timeout. A path goes on as given: preflight's
    # `controlplane --check` judges it (and names the models if it is neither).
    from kvloom.common.embedded_model_spec import EmbeddedModelError
    from kvloom.common.embedded_models import is_model_name, resolve_model

    if not is_model_name(model):
        return model
    try:
        return resolve_model(model)
    except EmbeddedModelError as exc:
        raise ClusterError(str(exc)) from None


def monitor_until_stopped(
    supervised, stopping: threading.Event, poll_interval: float, restart_workers: bool,
    stop_requested: Callable[[], bool] | None,
    on_restart: Callable[[list[Restart]], None] | None,
) -> None:
    """Cluster.monitor's loop, for a cluster or a set of them (cluster_set.py):
    supervise (restart dead workers) or only check, until `stopping` is set."""
    while not stopping.is_set():
        if restart_workers:
            done = supervised.supervise_once(stop_requested=stop_requested)
            if done and on_restart is not None:
                on_restart(done)
        else:
            supervised.check_alive(phase="while serving")
        stopping.wait(poll_interval)
