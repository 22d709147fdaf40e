"""Run deployment definitions as plain processes on loopback.

The compose file and the Helm chart are only trustworthy if the commands,
environment and probes they define really start a working cluster. CI has no
Docker engine and no Kubernetes, so the tests take those definitions verbatim
and play the orchestrator's part on one machine: every container becomes a
local process with the container's own command and environment, service and
pod host names resolve to 127.0.0.1, and the health checks and probes run
against the local processes. What needs an image (the Dockerfile build) is
left to the static checks.

Every process is started with a parent-death signal and stopped (SIGTERM, then
SIGKILL) when the `LocalProcesses` context ends, whether or not the test passed.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvloom.client import READY_SERVICE, KvloomClient, KvloomError
from kvloom_cli.launcher import pick_free_ports, stop_pids, with_parent_death_signal

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
LOOPBACK = "127.0.0.1"
TAIL_LINES = 60


def find_helm() -> str | None:
    """helm from $HELM, scripts/install_deploy_tools.sh's .tools/bin, or PATH."""
    for candidate in (os.environ.get("HELM"), str(ROOT / ".tools" / "bin" / "helm")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("helm")


def find_docker_compose() -> str | None:
    return shutil.which("docker-compose")


def assign_ports(wanted: dict[str, int]) -> dict[str, int]:
    """A distinct free loopback port for each port a definition declares.

    Never the declared number itself (50051, 9090, 29500...): containers each
    have their own network namespace, so a definition may use one number in
    several of them, and a well-known port that is free when checked can be
    taken by another test or service before the daemon binds it.
    """
    return dict(zip(wanted, pick_free_ports(len(wanted)), strict=True))


def base_env(tmp: Path) -> dict[str, str]:
    """The test's environment without KVLOOM_* settings, which would leak into
    the daemons and change what the definitions under test configure."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLOOM_")}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    # A private cache: a daemon that fell back to the default model would
    # otherwise convert it into the user's cache (and take minutes).
    env["KVLOOM_CACHE_DIR"] = str(tmp / "kvloom-cache")
    # Test-only: a small KV pool (the definitions under test leave it to the
    # workers' memory profile, gigabytes per rank on CPU).
    env["KVLOOM_KV_CACHE_MEMORY_BYTES"] = str(64 << 20)
    return env


@dataclass
class LocalProcess:
    name: str
    popen: subprocess.Popen
    log_path: Path

    def tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(f"  [{self.name}] {line}" for line in lines[-TAIL_LINES:])


@dataclass
class LocalProcesses:
    """The cluster's processes; a context manager that always stops them."""

    log_dir: Path
    processes: list[LocalProcess] = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> LocalProcess:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                with_parent_death_signal(argv),
                env=env,
                cwd=self.log_dir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        proc = LocalProcess(name, popen, log_path)
        self.processes.append(proc)
        return proc

    def check_alive(self) -> None:
        for proc in self.processes:
            code = proc.popen.poll()
            if code is not None:
                raise AssertionError(f"{proc.name} exited with {code}:\n{proc.tail()}")

    def logs(self) -> str:
        return "\n".join(proc.tail() for proc in self.processes)

    def wait_for(self, what: str, check: Callable[[], bool], timeout: float) -> None:
        """Poll check() until true; fail early if a process died, with the logs."""
        deadline = time.monotonic() + timeout
        while not check():
            self.check_alive()
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not reached within {timeout:.0f}s:\n{self.logs()}")
            time.sleep(0.5)

    def stop(self) -> None:
        running = [(p.name, p.popen.pid) for p in self.processes if p.popen.poll() is None]
        stop_pids(running, grace=5.0)
        for proc in self.processes:
            try:
                proc.popen.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(timeout=5.0)

    def __enter__(self) -> LocalProcesses:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def command_succeeds(argv: list[str], env: dict[str, str], timeout: float = 20.0) -> bool:
    """Run a health-check command the way Docker or the kubelet would: exit 0 = healthy."""
    try:
        done = subprocess.run(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def grpc_health_serving(address: str, service: str) -> bool:
    """What a Kubernetes `grpc:` probe does: grpc.health.v1 Check == SERVING."""
    with KvloomClient(address) as client:
        try:
            return client.health(service, timeout=2.0) == "SERVING"
        except KvloomError:
            return False


def check_greedy_completion(
    address: str, model_dir: str, layout: tuple[int, int], max_tokens: int = 12,
    node_id: str = "", **client_kwargs,
) -> None:
    """The cluster serves model_dir with layout (tp, pp), each rank reporting
    node_id, and one request through the client API matches transformers'
    greedy output token for token (client_kwargs: KvloomClient's TLS files
    and API key)."""
    from transformers import AutoConfig

    from tests.integration.reference import hf_greedy

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    rng = random.Random(7)
    prompt = [rng.randrange(3, vocab) for _ in range(9)]
    with KvloomClient(address, **client_kwargs) as client:
        assert client.health(READY_SERVICE) == "SERVING"
        info = client.server_info()
        assert (info.tensor_parallel_size, info.pipeline_parallel_size) == layout
        assert info.num_ranks_attached == layout[0] * layout[1]
        assert [r.rank for r in info.ranks] == list(range(layout[0] * layout[1]))
        assert {r.node_id for r in info.ranks} == {node_id}
        assert client.model_info().model_path == model_dir
        result = client.generate_text(
            prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=120
        )
    assert result.finish.reason == "length", result.finish
    assert result.finish.prompt_tokens == len(prompt)
    assert result.token_ids == hf_greedy(model_dir, prompt, max_tokens)
