"""``minisgl serve --dp N``: N engine replicas behind one router.

Each replica is an ordinary ``minisgl serve`` (its own process tree: API server, tokenizers, scheduler and its
tensor-parallel ranks) listening on a loopback port, with its own devices: a slice of ``--tp`` GPUs, or a share of
one GPU's memory when there are fewer GPUs than replicas. In front of them runs sglang-router on ``--host/--port``:
it routes each request (by default to the replica that holds the longest prefix of it), checks every replica's
``/health`` each second and takes out one that fails twice. This process watches them all: a replica that exits is
taken out of the router at once and started again with back-off; once its ``/health`` answers it is added to the
router anew, so that the router's view of it (its load, the prefixes it holds) starts empty, as the replica's own
cache does. (A worker that only went unhealthy and came back keeps its place: the router puts it back itself.)
SIGINT/SIGTERM drains the router, then the replicas, and leaves no process behind.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, Any

from .settings import ServeSettings, likely_device

logger = logging.getLogger("minisgl.server")

ROUTER_MISSING = "the --dp router needs sglang-router: pip install 'minisgl[router]' (or: pip install sglang-router)"
LOOPBACK = "127.0.0.1"
# The router's view of a replica: probed every second, out after two failures, back after one success.
HEALTH_FLAGS = (
    "--health-check-interval-secs", "1",
    "--health-failure-threshold", "2",
    "--health-success-threshold", "1",
    "--health-check-timeout-secs", "3",
)  # fmt: skip
# Replica log lines left out: the router's health probe each second, and its HTTP/2 probe (is it a gRPC
# worker?) at registration, which uvicorn reports as an invalid request.
QUIET = (b'"GET /health HTTP/1.1" 200', b"Invalid HTTP request received.")
MAX_BACKOFF = 30.0


class ReplicaError(ValueError):
    """``--dp`` settings that cannot work on this machine."""


@dataclass(frozen=True)
class ReplicaPlan:
    """Where one replica runs: ``devices`` is its CUDA_VISIBLE_DEVICES (None on CPU) and ``mem_fraction`` its
    ``--mem-fraction`` when it shares its GPUs with other replicas (None: the setting as given). ``wave`` orders the
    start-up: replicas sharing GPUs start one after another, so each sizes its KV cache from what the others left."""

    index: int
    devices: str | None
    mem_fraction: float | None
    wave: int
    cpu_threads: int | None = None  # on CPU: its share of the cores (OMP_NUM_THREADS), so replicas do not contend


def plan_replicas(
    dp: int, tp: int, gpus: list[str] | None, mem_fraction: float, cpus: int | None = None
) -> list[ReplicaPlan]:
    """``dp`` replicas of ``tp`` devices each over ``gpus`` (None: CPU, where each gets ``cpus // dp`` of the
    ``cpus`` cores, at least one). With at least ``dp * tp`` GPUs every replica gets its own; with fewer they are
    dealt round-robin over the ``len(gpus) // tp`` slices, and the ``n`` replicas on one slice split its free
    memory: the one started ``k``-th takes ``f / (n - k f)`` of what is free then, which gives each ``f / n`` of the
    memory that was free before any started."""
    if gpus is None:
        threads = max(1, (cpus if cpus is not None else _usable_cpus()) // dp)
        return [ReplicaPlan(i, None, None, 0, threads) for i in range(dp)]
    if tp > len(gpus):
        raise ReplicaError(
            f"--tp {tp} needs {tp} GPUs per replica, but {len(gpus)} are visible (CUDA_VISIBLE_DEVICES); "
            "lower --tp or make more GPUs visible"
        )
    slices = len(gpus) // tp
    plans = []
    for i in range(dp):
        group, wave = i % slices, i // slices
        sharing = len(range(group, dp, slices))
        fraction = None if sharing == 1 else mem_fraction / (sharing - wave * mem_fraction)
        plans.append(ReplicaPlan(i, ",".join(gpus[group * tp : (group + 1) * tp]), fraction, wave))
    return plans


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def visible_gpus(device: str) -> list[str] | None:
    """The GPUs replicas may use, as CUDA_VISIBLE_DEVICES items (None: the replicas run on CPU)."""
    from ..plugins import devices

    target = likely_device() if device == "auto" else device
    if target is None or target == "cpu":
        return None
    caps = devices.nvml_capabilities() or []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = len(devices.only_visible(caps, visible))
    names = [s.strip() for s in visible.split(",") if s.strip()] if visible is not None else []
    names = names[:count] if visible is not None else [str(i) for i in range(count)]
    if not names:
        raise ReplicaError("--device cuda: no GPU is visible (CUDA_VISIBLE_DEVICES, nvidia-smi); use --device cpu")
    return names


def check_dp_settings(settings: ServeSettings) -> str | None:
    """Why these settings cannot run as ``--dp`` replicas, or None."""
    if importlib.util.find_spec("sglang_router") is None:
        return ROUTER_MISSING
    if settings.device.startswith("cuda:"):
        return (
            f"--device {settings.device} names one GPU, but --dp {settings.dp} gives each replica its own; use "
            "--device cuda (or auto) and choose the GPUs with CUDA_VISIBLE_DEVICES"
        )
    if settings.nnodes > 1:
        return "--dp runs replicas on this host only; for replicas on several hosts see docs/serving.md (Multi-host)"
    if settings.shell:
        return "--shell chats with one engine; leave out --dp"
    return None


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def answers(url: str, timeout: float = 2.0) -> bool:
    """Whether ``url`` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - our own loopback URL
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _relay(stream: IO[bytes], prefix: str) -> None:
    """Copy a child's output to ours, each line prefixed with its name."""
    for line in iter(stream.readline, b""):
        if any(quiet in line for quiet in QUIET):
            continue
        sys.stderr.write(f"[{prefix}] {line.decode(errors='replace')}")
        sys.stderr.flush()
    stream.close()


@dataclass
class Child:
    """One supervised process tree (a replica or the router), restarted with back-off when it exits."""

    name: str
    command: list[str]
    env: dict[str, str]
    url: str  # what answers 200 once it is ready
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    restart_at: float | None = None
    backoff: float = 1.0
    rejoin: bool = False  # started again: to be added to the router once it answers
    relays: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        # Its own session: the whole tree can be signalled at once, and a Ctrl-C in our terminal reaches us only.
        self.proc = subprocess.Popen(
            self.command, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        assert self.proc.stdout is not None
        relay = threading.Thread(target=_relay, args=(self.proc.stdout, self.name), daemon=True)
        relay.start()
        self.relays.append(relay)
        self.started, self.restart_at = time.monotonic(), None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()

    def wait_stopped(self, deadline: float) -> None:
        """Wait until the tree's leader has exited (SIGKILL to the whole tree after ``deadline``), then end what is
        left of the tree."""
        if self.proc is None:
            return
        try:
            self.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s did not exit after SIGTERM; killing it", self.name)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # what is left of the tree
        self.proc.wait()
        for relay in self.relays:
            relay.join(1.0)


class ReplicaSet:
    """The replicas and the router of one ``minisgl serve --dp N``."""

    def __init__(self, settings: ServeSettings, argv: list[str]):
        self.settings = settings
        self.stopping = threading.Event()
        self.plans = plan_replicas(settings.dp, settings.tp, visible_gpus(settings.device), settings.mem_fraction)
        waves = max(p.wave for p in self.plans) + 1
        self.waves = [[p.index for p in self.plans if p.wave == w] for w in range(waves)]
        self.replicas = [self._replica(plan, argv) for plan in self.plans]
        self.metrics_port = settings.router_metrics_port or free_port(LOOPBACK if settings.host == LOOPBACK else "")
        # Ready once it has registered a replica (/health answers as soon as it listens).
        self.router = Child("router", self.router_command(), dict(os.environ), self.router_url("/readiness"))

    def _replica(self, plan: ReplicaPlan, argv: list[str]) -> Child:
        port = free_port()
        overrides = ["--dp", "1", "--host", LOOPBACK, "--port", str(port)]  # the last of a repeated flag wins
        if plan.mem_fraction is not None:
            overrides += ["--mem-fraction", f"{plan.mem_fraction:.6f}"]
        env = dict(os.environ)
        if plan.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = plan.devices
        if plan.cpu_threads is not None and "OMP_NUM_THREADS" not in os.environ:
            # Each replica computes at the same time as the others: with every replica on every core, their
            # threads contend (on 2 cores, round-robin routing ran 15x slower than one replica's).
            env["OMP_NUM_THREADS"] = str(plan.cpu_threads)
        command = [sys.executable, "-m", "minisgl", "serve", *argv, *overrides]
        return Child(f"replica-{plan.index}", command, env, f"http://{LOOPBACK}:{port}/health")

    def worker_urls(self) -> list[str]:
        return [r.url.removesuffix("/health") for r in self.replicas]

    def router_url(self, path: str) -> str:
        host = LOOPBACK if self.settings.host in ("0.0.0.0", "", "::") else self.settings.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.settings.port}{path}"

    def router_command(self) -> list[str]:
        """The sglang-router command line: our replicas, our address, policy, key and health checking."""
        s = self.settings
        command = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *self.worker_urls()]
        command += ["--host", s.host, "--port", str(s.port), "--policy", s.router_policy]
        command += ["--prometheus-host", s.host, "--prometheus-port", str(self.metrics_port), *HEALTH_FLAGS]
        command += ["--shutdown-grace-period-secs", str(int(s.shutdown_timeout) + 1)]
        command += ["--log-level", "debug" if s.log_level == "debug" else "warn"]  # its info is a line per request
        if s.api_key:
            command += ["--api-key", s.api_key]
        return command + shlex.split(s.router_args or "")

    def _router_call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One call of the router's worker API (JSON in and out, with our key when there is one)."""
        headers = {"Content-Type": "application/json"}
        if self.settings.api_key:
            headers["Authorization"] = f"Bearer {self.settings.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.router_url(path), data=data, method=method, headers=headers)
        with urllib.request.urlopen(request, timeout=10) as response:
            raw = response.read()
        return json.loads(raw) if raw else None

    def _router_worker_ids(self, replica: Child) -> list[str]:
        """The router's ids of the workers at ``replica``'s URL (none when it does not list it)."""
        url = replica.url.removesuffix("/health")
        return [w["id"] for w in self._router_call("GET", "/workers")["workers"] if w.get("url") == url]

    def _router_remove(self, replica: Child) -> None:
        """Take ``replica`` out of the router now (it exited): no request waits for its health checks to fail."""
        try:
            for worker_id in self._router_worker_ids(replica):
                self._router_call("DELETE", f"/workers/{worker_id}")
        except (OSError, ValueError, KeyError, TypeError) as exc:  # the router itself may be down or restarting
            logger.warning("could not take %s out of the router (%s); its health checks will", replica.name, exc)

    def _router_add(self, replica: Child) -> bool:
        """Add ``replica`` (started again and answering) to the router; whether the router took it."""
        body: dict[str, Any] = {"url": replica.url.removesuffix("/health")}
        if self.settings.api_key:
            body["api_key"] = self.settings.api_key
        try:
            if self._router_worker_ids(replica):
                return True  # a router started again meanwhile registered it from its command line
            self._router_call("POST", "/workers", body)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("could not add %s to the router yet (%s); trying again", replica.name, exc)
            return False
        logger.info("%s rejoined the router", replica.name)
        return True

    def _wait_ready(self, children: list[Child]) -> str | None:
        """Wait until every child answers /health; why not, if one exits first or we are told to stop."""
        pending = list(children)
        while pending:
            for child in list(pending):
                code = child.exit_code()
                if code is not None:
                    return f"{child.name} exited with code {code} during start-up (its output is above)"
                if answers(child.url):
                    logger.info("%s ready", child.name)
                    pending.remove(child)
            if pending and self.stopping.wait(0.5):
                return "stopped during start-up"
        return None

    def start(self) -> str | None:
        """Start the replicas (wave by wave) and then the router; why not, or None once all answer."""
        for wave in self.waves:
            for i in wave:
                replica = self.replicas[i]
                replica.start()
                assert replica.proc is not None
                plan = self.plans[i]
                logger.info(
                    "replica %d: %s pid=%d devices=%s", i, replica.url.removesuffix("/health"), replica.proc.pid,
                    plan.devices or "cpu",
                )  # fmt: skip
            problem = self._wait_ready([self.replicas[i] for i in wave])
            if problem is not None:
                return problem
        self.router.start()
        assert self.router.proc is not None
        logger.info(
            "router: %s pid=%d policy=%s metrics=:%d", self.router_url(""), self.router.proc.pid,
            self.settings.router_policy, self.metrics_port,
        )  # fmt: skip
        return self._wait_ready([self.router])

    def watch(self) -> None:
        """Until told to stop: start again, with back-off, any replica (or the router) that exited."""
        while not self.stopping.wait(0.5):
            now = time.monotonic()
            for child in [*self.replicas, self.router]:
                is_replica = child is not self.router
                code = child.exit_code()
                if code is None:
                    if now - child.started > 60:
                        child.backoff = 1.0  # it stayed up: the next failure is a new one
                    if child.rejoin and answers(child.url) and self._router_add(child):
                        child.rejoin = False
                    continue
                if child.restart_at is None:
                    child.restart_at = now + child.backoff
                    logger.warning(
                        "%s exited with code %s; starting it again in %.0f s", child.name, code, child.backoff
                    )
                    child.backoff = min(MAX_BACKOFF, child.backoff * 2)
                    if is_replica and not child.rejoin:
                        self._router_remove(child)
                elif now >= child.restart_at:
                    child.wait_stopped(now)  # what is left of its tree
                    child.relays.clear()
                    child.start()
                    assert child.proc is not None
                    child.rejoin = is_replica  # a restarted router registers every replica itself
                    logger.info("%s started again: pid=%d", child.name, child.proc.pid)

    def shutdown(self) -> None:
        """Drain the router (it finishes the requests it holds), then the replicas; then end whatever is left."""
        grace = self.settings.shutdown_timeout + 5
        self.router.terminate()
        self.router.wait_stopped(time.monotonic() + grace)
        for replica in self.replicas:
            replica.terminate()
        deadline = time.monotonic() + grace + 5
        for replica in self.replicas:
            replica.wait_stopped(deadline)


def serve_replicas(settings: ServeSettings, argv: list[str]) -> int:
    """Run ``settings.dp`` replicas and the router until SIGINT/SIGTERM (exit 0) or a failed start (exit 1)."""
    from .launcher import check_port

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    problem = check_dp_settings(settings) or check_port(settings.host, settings.port)
    if problem is not None:
        print(f"minisgl serve: error: {problem}", file=sys.stderr)
        return 2
    try:
        replicas = ReplicaSet(settings, argv)
    except ReplicaError as exc:
        print(f"minisgl serve: error: {exc}", file=sys.stderr)
        return 2

    def on_signal(sig: int, frame: FrameType | None) -> None:
        if not replicas.stopping.is_set():
            logger.info("shutting down: draining the router, then %d replicas", settings.dp)
        replicas.stopping.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        problem = replicas.start()
        if problem is None:
            logger.info("serving %d replicas on %s", settings.dp, replicas.router_url(""))
            replicas.watch()
        elif not replicas.stopping.is_set():
            print(f"minisgl serve: error: {problem}", file=sys.stderr)
            return 1
        return 0
    finally:
        replicas.stopping.set()
        replicas.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
