"""Local cluster launcher: one controlplane and T*P workerd child processes.

Used by `kvloom up`, `kvloom run` and the serving benchmark's --launch mode.
`Cluster.start()` picks free ports, spawns `python -m controlplane` and one
`python -m workerd --rank R` per rank, and relays their output with a
"[controlplane] " / "[rank R] " prefix; `wait_ready()` polls the grpc health
service "kvloom.v1.Generation" until SERVING, failing fast (with the dead
process's last log lines) if a child exits first; `stop()` sends SIGTERM and
SIGKILLs whatever outlives the grace period.

Foreground children share a process group of their own (so a terminal
Ctrl-C reaches only the launcher, which then stops them in order) and, on
Linux, get PR_SET_PDEATHSIG so a SIGKILLed launcher leaves no orphans.
Detached children (`kvloom up --detach`) get their own session and log files
instead; their pids go into a state file that `kvloom down` reads.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, closing, contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

from kvloom.client import READY_SERVICE, KvloomClient, KvloomError

TAIL_LINES = 40


class ClusterError(RuntimeError):
    """The local cluster failed to start or stop."""


@dataclass(frozen=True)
class ClusterSpec:
    """What to launch. Ports left at 0 are picked free on the host."""

    model: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    host: str = "127.0.0.1"
    port: int = 0
    worker_port: int = 0
    metrics_port: int = 0
    # Threads per worker for torch; None = the CPU count shared among ranks.
    worker_threads: int | None = None
    controlplane_args: tuple[str, ...] = ()
    python: str = sys.executable

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class ClusterState:
    """What `kvloom down` needs to find a detached cluster again."""

    api: str
    metrics: str
    worker_port: int
    model: str
    # name -> [pid, start time in clock ticks]; the start time tells our
    # process apart from an unrelated one that reused its pid.
    processes: dict[str, list[int]] = field(default_factory=dict)
    log_dir: str = ""

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> ClusterState:
        return cls(**json.loads(path.read_text()))


def pick_free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Distinct ports free right now; all sockets stay open until every port is chosen."""
    with ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)))
            sock.bind((host, 0))
            ports.append(sock.getsockname()[1])
        return ports


def resolve_ports(spec: ClusterSpec) -> tuple[int, int, int]:
    """(port, worker_port, metrics_port) with every 0 replaced by a free port."""
    wanted = [spec.port, spec.worker_port, spec.metrics_port]
    free = iter(pick_free_ports(wanted.count(0), spec.host))
    port, worker_port, metrics_port = (p or next(free) for p in wanted)
    return port, worker_port, metrics_port


def connect_host(host: str) -> str:
    # A wildcard bind address is not something a client can dial.
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def controlplane_command(spec: ClusterSpec, model: str, ports: tuple[int, int, int]) -> list[str]:
    port, worker_port, metrics_port = ports
    return [
        spec.python, "-m", "controlplane",
        "--model", model,
        "--tensor-parallel-size", str(spec.tensor_parallel_size),
        "--pipeline-parallel-size", str(spec.pipeline_parallel_size),
        "--host", spec.host,
        "--port", str(port),
        "--worker-port", str(worker_port),
        "--metrics-port", str(metrics_port),
        *spec.controlplane_args,
    ]


def workerd_command(spec: ClusterSpec, worker_port: int, rank: int) -> list[str]:
    threads = spec.worker_threads or max(1, (os.cpu_count() or 1) // spec.world_size)
    return [
        spec.python, "-m", "workerd",
        "--controlplane", f"{connect_host(spec.host)}:{worker_port}",
        "--rank", str(rank),
        "--num-threads", str(threads),
    ]


def relay_lines(
    stream: Iterable[bytes], prefix: str, sink: IO[str], tail: deque[str], lock: threading.Lock
) -> None:
    """Copy a child's output line by line to sink with a prefix, keeping the last lines."""
    for raw in stream:
        line = raw.decode("utf-8", errors="replace").rstrip("\n")
        tail.append(line)
        with lock:  # one writer at a time, so lines of different ranks never interleave
            sink.write(f"{prefix}{line}\n")
            sink.flush()


def process_start_time(pid: int) -> int | None:
    """Start time of pid in clock ticks since boot (Linux /proc), None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Fields after the parenthesised command name; starttime is field 22.
    return int(stat.rsplit(")", 1)[1].split()[19])


# Runs in the child before it becomes the daemon: ask the kernel for SIGTERM
# when the launcher dies, give up if it already has, then exec the real command
# (same pid; the death signal survives exec). Doing this in a trampoline rather
# than a preexec_fn keeps spawning safe while relay and gRPC threads run.
_PDEATHSIG_TRAMPOLINE = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM)\n"  # 1 = PR_SET_PDEATHSIG
    "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def with_parent_death_signal(argv: list[str], python: str = sys.executable) -> list[str]:
    """argv wrapped so the child is SIGTERMed when this process dies (Linux only).

    The kernel ties the signal to the thread that forked the child, so start
    clusters from a thread that lives as long as the cluster (e.g. the main one).
    """
    if not sys.platform.startswith("linux"):
        return argv
    return [python, "-c", _PDEATHSIG_TRAMPOLINE, str(os.getpid()), *argv]


@dataclass
class ManagedProcess:
    name: str
    popen: subprocess.Popen
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    log_path: Path | None = None

    def last_lines(self) -> list[str]:
        if self.log_path is not None and self.log_path.exists():
            lines = self.log_path.read_text(errors="replace").splitlines()
            return lines[-TAIL_LINES:]
        return list(self.tail)


class Cluster:
    """A controlplane and its workers as children of this process."""

    def __init__(
        self, spec: ClusterSpec, *, log_sink: IO[str] | None = None, log_dir: Path | None = None
    ):
        self.spec = spec
        self.log_sink = log_sink if log_sink is not None else sys.stderr
        # With a log_dir the children write files and outlive us (detached mode).
        self.log_dir = log_dir
        self.processes: list[ManagedProcess] = []
        self.model = ""
        self.ports = (0, 0, 0)
        self._lock = threading.Lock()

    @property
    def api_address(self) -> str:
        return f"{connect_host(self.spec.host)}:{self.ports[0]}"

    @property
    def metrics_address(self) -> str:
        return f"http://{connect_host(self.spec.host)}:{self.ports[2]}/metrics"

    def start(self) -> None:
        """Spawn the controlplane and every rank, then relay their logs."""
        self.model = self.spec.model or _default_model()
        self.ports = resolve_ports(self.spec)
        self._spawn("controlplane", controlplane_command(self.spec, self.model, self.ports))
        for rank in range(self.spec.world_size):
            self._spawn(f"rank {rank}", workerd_command(self.spec, self.ports[1], rank))
        if self.log_dir is None:
            for proc in self.processes:
                self._start_relay(proc)

    def _spawn(self, name: str, argv: list[str]) -> None:
        kwargs: dict = {"stdin": subprocess.DEVNULL, "stderr": subprocess.STDOUT}
        log_path = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log_path = self.log_dir / (name.replace(" ", "") + ".log")
            kwargs["stdout"] = open(log_path, "ab")  # noqa: SIM115 - the child owns it
            kwargs["start_new_session"] = True
        else:
            kwargs["stdout"] = subprocess.PIPE
            # Join the group of the first child; 0 makes the controlplane its leader.
            kwargs["process_group"] = self.processes[0].popen.pid if self.processes else 0
            argv = with_parent_death_signal(argv, self.spec.python)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        try:
            popen = subprocess.Popen(argv, env=env, **kwargs)
        finally:
            if log_path is not None:
                kwargs["stdout"].close()
        self.processes.append(ManagedProcess(name, popen, log_path=log_path))

    def _start_relay(self, proc: ManagedProcess) -> None:
        args = (proc.popen.stdout, f"[{proc.name}] ", self.log_sink, proc.tail, self._lock)
        threading.Thread(target=relay_lines, args=args, daemon=True).start()

    def check_alive(self, phase: str = "during start-up") -> None:
        for proc in self.processes:
            code = proc.popen.poll()
            if code is not None:
                raise ClusterError(describe_exit(proc, code, phase))

    def monitor(self, poll_interval: float = 0.5) -> None:
        """Block while every child runs; raise ClusterError when one exits."""
        while True:
            self.check_alive(phase="while serving")
            time.sleep(poll_interval)

    def wait_ready(self, timeout: float = 600.0, poll_interval: float = 0.5) -> None:
        """Block until the controlplane reports kvloom.v1.Generation SERVING."""
        deadline = time.monotonic() + timeout
        with KvloomClient(self.api_address) as client:
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

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every child, then SIGKILL those still running after `grace` seconds."""
        stop_pids([(p.name, p.popen.pid) for p in self.processes if p.popen.poll() is None], grace)
        for proc in self.processes:
            _reap(proc.popen)

    def state(self) -> ClusterState:
        processes = {}
        for proc in self.processes:
            processes[proc.name] = [proc.popen.pid, process_start_time(proc.popen.pid) or 0]
        return ClusterState(
            api=self.api_address, metrics=self.metrics_address, worker_port=self.ports[1],
            model=self.model, processes=processes, log_dir=str(self.log_dir or ""),
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


def describe_exit(proc: ManagedProcess, code: int, phase: str = "during start-up") -> str:
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    # Give the relay thread a moment to drain the pipe so the tail is complete.
    time.sleep(0.2)
    lines = proc.last_lines()
    shown = "\n".join(f"  {line}" for line in lines) if lines else "  (no output)"
    return f"{proc.name} {how} {phase}; its last log lines:\n{shown}"


def _reap(popen: subprocess.Popen) -> None:
    with suppress(subprocess.TimeoutExpired):
        popen.wait(timeout=1.0)


def stop_pids(targets: list[tuple[str, int]], grace: float) -> list[str]:
    """SIGTERM, wait up to grace, SIGKILL; returns the names that needed SIGKILL."""
    for _, pid in targets:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(pid) for _, pid in targets):
        time.sleep(0.1)
    killed = [name for name, pid in targets if _alive(pid)]
    for name, pid in targets:
        if name in killed:
            _signal(pid, signal.SIGKILL)
    return killed


def _signal(pid: int, sig: int) -> None:
    with suppress(ProcessLookupError):
        os.kill(pid, sig)


def _alive(pid: int) -> bool:
    # A zombie child of ours counts as gone: it has stopped running.
    try:
        finished, _ = os.waitpid(pid, os.WNOHANG)
        if finished == pid:
            return False
    except ChildProcessError:
        pass  # not our child (kvloom down): fall back to probing
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False  # no /proc (not Linux): trust kill(pid, 0)
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def running_processes(state: ClusterState) -> list[tuple[str, int]]:
    """(name, pid) of the recorded processes still running, pid reuse excluded."""
    return [
        (name, pid)
        for name, (pid, started) in state.processes.items()
        if process_start_time(pid) == started and _alive(pid)
    ]


def stop_detached(state: ClusterState, grace: float = 10.0) -> list[str]:
    """Stop a cluster recorded by `kvloom up --detach`; returns names that were SIGKILLed."""
    return stop_pids(running_processes(state), grace)


class Terminated(Exception):
    """SIGTERM or SIGHUP arrived; raised so `finally` blocks stop the children."""


@contextmanager
def termination_as_exception() -> Iterator[None]:
    def handler(signum, frame):
        raise Terminated(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _default_model() -> str:
    # Resolved here, once, so the conversion (first run only) happens before any
    # daemon starts instead of racing the controlplane's start-up timeout.
    from kvloom.default_model import default_model_dir

    return default_model_dir()


def default_state_file() -> Path:
    from kvloom.default_model import cache_root

    return cache_root() / "cluster.json"
