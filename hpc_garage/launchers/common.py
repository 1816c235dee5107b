"""What every launcher does the same way: worker options from a WorkerSpec, and waiting for workers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hpc_garage import log
from hpc_garage.core.errors import UserError
from hpc_garage.variables import WORKER_PRELOAD, modules
from hpc_garage.core.layout import WorkerSpec

if TYPE_CHECKING:
    from hpc_garage.rundir import RunDir

logger = logging.getLogger(__name__)


def worker_options(spec: WorkerSpec, *, env: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    """Keyword arguments for a distributed Nanny that starts exactly this worker (bound to its cores, where
    its spec says which: `launchers.affinity.BoundWorker` binds itself to them as it starts)."""
    options = {
        "name": spec.name,
        "nthreads": spec.nthreads,
        "memory_limit": spec.memory_limit,
        "resources": dict(spec.resources),
        "env": {**(env or {}), **spec.env},
        "preload": dask_worker_preload(),
        **extra,
    }
    if spec.cpus:
        from hpc_garage.launchers.affinity import BoundWorker

        options["worker_class"] = BoundWorker
    return options


WORKER_SETUP = "hpc_garage.launchers.worker_setup"  # every worker's own set-up (its dask_setup)


def dask_worker_preload() -> list[str]:
    """Dask's worker preload: the user's (`distributed.worker.preload` in their Dask config), then ours. Given
    explicitly, a worker would otherwise read the config's alone."""
    import dask.config

    configured = [str(m) for m in dask.config.get("distributed.worker.preload", []) or []]
    return [*configured, WORKER_SETUP] if WORKER_SETUP not in configured else configured


async def wait_for_workers(
    registered: Callable[[], Iterable[str]],
    expected: list[str],
    timeout: float,
    *,
    alive: Callable[[], str | None] = lambda: None,
    progress: Callable[[int, int], None] = lambda k, n: None,
) -> None:
    """Wait until every expected worker name has registered; name the missing ones on timeout.

    `alive()` returns a reason when the processes that should bring the workers up have died, so a crash
    is reported at once instead of after the timeout.
    """
    deadline = time.monotonic() + timeout
    last = -1
    while True:
        present = set(map(str, registered()))
        missing = [name for name in expected if name not in present]
        if len(expected) - len(missing) != last:
            last = len(expected) - len(missing)
            progress(last, len(expected))
        if not missing:
            return
        if reason := alive():
            raise UserError(f"workers did not start: {reason}; missing {_names(missing)}")
        if time.monotonic() > deadline:
            raise UserError(
                f"{len(missing)} of {len(expected)} workers did not register within {timeout:.0f} s: "
                f"{_names(missing)}; see the job log, or raise --timeout"
            )
        await asyncio.sleep(0.1)


def _names(names: list[str]) -> str:
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


@dataclass(frozen=True)
class Preload:
    """What a cluster's processes import before their first task: each host's worker forkserver, and the
    scheduler's process while the workers start. Named by the layer that knows what the tasks need (the CLI
    passes Prefect's, prefect/preload.py); `run` gives the workers theirs in $HPC_GARAGE_WORKER_PRELOAD."""

    workers: tuple[str, ...] = ("distributed",)
    scheduler: tuple[str, ...] = ()


def worker_preload(env: Mapping[str, str]) -> list[str]:
    """Modules every worker process starts with: $HPC_GARAGE_WORKER_PRELOAD (comma-separated; `run` sets it
    in the workers' environment), else distributed alone."""
    if (given := modules(env, WORKER_PRELOAD)) is not None:
        return given
    return list(Preload().workers)


# What distributed's Nanny puts in a spawned worker's environment before Python starts there
# (`distributed.nanny.pre-spawn-environ`, plus a fixed hash seed so that every worker hashes strings alike).
# Forked workers inherit them from the forkserver, so it must start with them (tests compare with Dask's).
PRE_SPAWN_ENV = {"MALLOC_TRIM_THRESHOLD_": "65536", "PYTHONHASHSEED": "6640"}


def forkserver_env(worker_env: Mapping[str, str], workers: Iterable[WorkerSpec]) -> dict[str, str]:
    """The environment a host's worker forkserver starts with: what all its workers share, Dask's
    pre-spawn variables, and thread caps no larger than any worker's (numpy's BLAS reads them once, in the
    server, when it is imported)."""
    caps: dict[str, str] = {}
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        values = [int(w.env[var]) for w in workers if str(w.env.get(var, "")).isdigit()]
        if values:
            caps[var] = str(min(values))
    pre = {k: v for k, v in PRE_SPAWN_ENV.items() if os.environ.get(k, "0") == "0"}  # the user's own win
    return {**pre, **worker_env, **caps}


def start_worker_forkserver(env: Mapping[str, str], preload: list[str]) -> None:
    """Make this process's Nannies fork their workers from one server that imported `preload` once.

    Dask's default, spawn, starts a fresh interpreter per worker, each importing distributed (and later
    Prefect) again: on a node with 8 workers that is 8x the CPU before the first task. A forkserver is a
    clean single-threaded process (unlike this one, which holds sockets and an event loop, so plain fork
    is unsafe); it starts at once and imports while this process goes on. `env` is the environment the
    workers share (Prefect reads its settings when imported, so the API must be in it); each worker's own
    variables (CUDA_VISIBLE_DEVICES, ...) are still set by its Nanny before the worker starts.
    """
    import multiprocessing
    import multiprocessing.forkserver

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(preload)
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        multiprocessing.forkserver.ensure_running()  # the server inherits this environment
    finally:
        os.environ.clear()
        os.environ.update(saved)
    import dask

    dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})
    from hpc_garage.compat import skip_forkserver_optional_preload

    skip_forkserver_optional_preload()


# Issue 32: what the workers benchmark (bench/workers.py) showed a cluster of many workers on one scheduler
# needs. Workers connect all at once; the scheduler answers their TLS handshakes one at a time on its event
# loop, so the last waits about the whole registration. With Dask's 30 s connect timeout (`--dask-defaults`;
# that run was stopped before 1,024, so not stored) 512 workers took 193 s to register at load 17, over a
# thousand handshakes timed out and started over, and the scheduler spent 12.3 ms of CPU per worker; with
# these settings (bench/results/runs/20261127-222609-workers.md) 10.9 s and 3.4 ms. Dask asks for a heartbeat
# every n/200 + 1 s past 200 workers, which nears its fixed 5-minute worker TTL at tens of thousands.
# Checked at 128-1,024 on an idle machine (runs/20261128-010836-workers.md): 1,024 registered in 12.2 s, and
# through a 13-minute run of 50,000 tasks at load ~40 heartbeats came at most 82 s late: the TTL (300 s) held.
CONNECT_SECONDS_PER_WORKER = 0.1  # ~2x the window per worker measured at 256 with Dask's defaults (15.9 s)
CONNECT_SECONDS_MAX = 600.0
TTL_HEARTBEATS = 5  # a worker is removed after this many heartbeat intervals unheard (never under Dask's 300 s)
LARGE_CLUSTER = 256  # up to this many workers Dask's own settings held (registered in 16 s): nothing is set


def cluster_settings(workers: int, current: Callable[[str], Any] | None = None) -> dict[str, str]:
    """Dask settings for a cluster of `workers` workers on one scheduler, as `dask.config` keys: the connect
    timeout grows with the workers that connect at once, the worker TTL with the heartbeat interval. Each only
    raises what is configured already (`current(key)`, default `dask.config.get`), so a user's larger wins."""
    if workers <= LARGE_CLUSTER:  # and no import of dask here: `run` computes this before the scheduler's imports
        return {}
    import dask
    from dask.utils import parse_timedelta
    from distributed.scheduler import heartbeat_interval

    get = current or dask.config.get
    wanted = {"distributed.comm.timeouts.connect": min(CONNECT_SECONDS_MAX, workers * CONNECT_SECONDS_PER_WORKER),
              "distributed.scheduler.worker-ttl": TTL_HEARTBEATS * heartbeat_interval(workers)}
    settings = {}
    for key, seconds in wanted.items():
        configured = get(key)
        if configured is not None and parse_timedelta(configured, "s") < seconds:  # None: no TTL at all, kept
            settings[key] = f"{seconds:.0f}s"
    return settings


# Issue 32: Dask's statistical profiler samples every worker thread's stack every 10 ms and keeps about 17 minutes
# of it (a tree per second of Prefect's deep stacks). 100,000 trivial trials ended with the two workers at 764 MiB,
# most of it that history, and with it on 10,000 trials ran at 60.3 trials/s against 67.0 with it off
# (bench/results/profiles/20261130-scale-growth-per-trial.md). Off unless the user's Dask config sets it: the
# dashboard's Profile tab is then empty.
PROFILER_SETTING = "distributed.worker.profile.enabled"


def profiler_settings(env: Mapping[str, str]) -> dict[str, Any]:
    """Dask's worker profiler off, as a `dask.config` key, where the user's Dask config (its YAML files, or a
    DASK_* variable in `env`) leaves it unset; nothing where the user set it either way."""
    import dask.config

    user = dask.config.collect(paths=dask.config.paths, env=dict(env))  # the user's files and variables, no defaults
    unset = object()
    return {} if dask.config.get(PROFILER_SETTING, unset, config=user) is not unset else {PROFILER_SETTING: False}


def dask_environment(settings: Mapping[str, Any]) -> dict[str, str]:
    """The same settings as DASK_* variables, which a worker process reads when it imports dask (which reads
    `False` back as the boolean)."""
    return {"DASK_" + key.upper().replace(".", "__").replace("-", "_"): str(value) for key, value in settings.items()}


class Launcher:
    """Starts a layout's workers against a running scheduler, says if they died, and stops them."""

    scheduler_host: dict[str, Any] = {"host": "127.0.0.1"}  # Scheduler(...) keywords: where it listens
    command_env: dict[str, str] = {}  # exported to COMMAND besides the scheduler file
    nodes_watched = False  # hosts a fixed allocation's nodes, whose loss `run` watches for (cluster/node_loss.py)
    per_node = False  # each node has a process of its own: `lost_nodes()` tells each loss as it happens

    async def prepare(self, tls: dict[str, str] | None, worker_env: dict[str, str], rundir: RunDir,
                      timeout: float) -> None:
        """Before the scheduler exists: start whatever can start early (ranks that will wait for the
        scheduler's address, a worker forkserver), so that it overlaps the scheduler's own start."""

    async def start(self, address: str, tls: dict[str, str] | None, worker_env: dict[str, str],
                    rundir: RunDir) -> None:
        raise NotImplementedError

    def failure(self) -> str | None:
        """Why the workers cannot come up any more (their launcher exited), or None."""
        return None

    def lost_nodes(self) -> list[tuple[int, str]]:
        """(node index, why) for each node whose process ended since the last call (each told once), where
        this launcher can tell; cluster/node_loss.py watches it for the whole run."""
        return []

    async def restart_node(self, node: int) -> bool:
        """Start a lost node's process again, with the same workers and GPU pins; False where it cannot."""
        return False

    def draining(self) -> None:
        """Teardown begins: the workers are about to leave on purpose, so nothing may replace them."""

    async def stop_workers(self) -> None:
        """Before the scheduler closes: end the workers this process holds itself, so that none outlives it
        (a worker heartbeating into a closed scheduler logs a traceback). Elsewhere workers leave as the
        scheduler closes, and `stop` ends what is left."""

    async def stop(self) -> None:
        raise NotImplementedError

    def abandon(self) -> None:
        """Last resort once the event loop is gone (a teardown cut short): release what outlives this
        process, such as batch jobs. Must be synchronous, quick, and safe to call after `stop`."""


def listening_host(options: Mapping[str, Any]) -> str:
    """The IP address a Scheduler given these keywords (interface= or host=) will listen on, known before
    it starts, and without importing distributed (~1 s): the Prefect API binds there, and COMMAND and the
    workers are started with it while distributed is still importing. Same rules as distributed.utils'
    get_ip_interface / get_ip (tests compare them)."""
    import socket

    if interface := options.get("interface"):
        import psutil

        addresses = psutil.net_if_addrs()
        if interface not in addresses:
            raise UserError(f"network interface {interface!r} does not exist on {socket.gethostname()} "
                            f"(it has {', '.join(sorted(addresses))}); fix the site's interface")
        for address in addresses[interface]:
            if address.family == socket.AF_INET:
                return str(address.address)
        raise UserError(f"network interface {interface!r} has no IPv4 address; fix the site's interface")
    if host := options.get("host"):
        return str(host)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent
        try:
            probe.connect(("8.8.8.8", 80))
            if (ip := str(probe.getsockname()[0])) != "0.0.0.0":
                return ip
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def node_gpus(env: Mapping[str, str], vendor: str = "nvidia") -> list[str]:
    """The GPU ids this node shows the job, read on the node itself, as `vendor`'s runtime reads them
    (`core.gpus.job_gpus`: CUDA_VISIBLE_DEVICES; ROCR_VISIBLE_DEVICES then HIP's stage; ZE_AFFINITY_MASK).
    A malformed list (duplicates, blank or non-numeric entries) is refused in one line before any worker
    starts; an empty one or NoDevFiles is no GPUs (a worker that needs one then says so)."""
    from hpc_garage.core.gpus import job_gpus

    return list(job_gpus(vendor, env).ids)


async def end_process(proc: asyncio.subprocess.Process, steps: Iterable[tuple[int | None, float]], *,
                      group: bool = False) -> None:
    """Wait for `proc` to exit, escalating: each step sends its signal (None: just wait) to the process, or
    its whole process group, then waits up to its seconds."""
    for sig, wait in steps:
        if proc.returncode is not None:
            return
        if sig is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(proc.wait(), wait)


NOTICE_TOPIC = "hpc-garage-notice"  # the Dask event a node process sends `run` on the batch system's SIGTERM


async def tell_scheduler_of_term(address: str, security: Any, job: str | None) -> None:
    """The batch system sent this node's step SIGTERM (Slurm's preemption notice goes to the steps, not to
    `run`): say so to the scheduler, whose wind-down (cluster/wind_down.py) gives the trials the time left.
    Best effort: a scheduler that does not answer within 10 s is not told."""
    from distributed.core import rpc

    args = security.get_connection_args("worker") if security is not None else {}
    with contextlib.suppress(Exception):
        async with rpc(address, connection_args=args) as scheduler:
            await asyncio.wait_for(scheduler.log_event(topic=NOTICE_TOPIC, msg={"job": job, "at": time.time()}), 10)


def run_entry(main: Callable[[], int]) -> None:
    """`python -m` entry of a process a launcher starts (a node, a rank, a worker job): its `hpc-garage: ...`
    lines go to its stderr, the job log (hpc_garage/log.py); a user error is one line there and exit 2."""
    import sys

    log.setup()
    try:
        sys.exit(main())
    except UserError as exc:
        logger.error(str(exc))
        sys.exit(2)


def local_directory(configured: str | None) -> str | None:
    """A site's `local_directory` expanded on this node; None (Dask's default) while a variable in it is
    unset here, e.g. $TMPDIR on a login node."""
    if not configured:
        return None
    expanded = os.path.expanduser(os.path.expandvars(configured))
    return None if "$" in expanded else expanded


def security_from(tls: dict[str, str] | None) -> Any:
    """A distributed Security from the run directory's TLS files; None means plain tcp (--insecure)."""
    if tls is None:
        return None
    from distributed.security import Security

    return Security(require_encryption=True, **tls)
