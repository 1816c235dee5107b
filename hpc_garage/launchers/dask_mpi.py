"""The dask-mpi launcher (`mpi: {launch: dask-mpi}`): one MPI rank per worker, started by srun or mpiexec,
each running dask-mpi's own worker side against the scheduler of `hpc-garage run`.

`run` keeps its scheduler in its own process on the first node (placement plugin, TLS, the scheduler file
published only once every worker has registered: all as with the default launcher), so dask-mpi runs with
`--no-scheduler`; there is no scheduler rank. `run` starts `jobscript.dask_mpi_ranks()`'s command: K ranks on
each node (K = the most workers a node has), each `python -m hpc_garage.launchers.dask_mpi RANKS.json`.

Each rank, before MPI starts and before anything can load CUDA:
- finds its node (by name, else by the batch system's node rank, else world rank // K) and its local rank
  (MPI's variable, else srun's), and so its WorkerSpec, the node's `local rank`-th worker;
- puts that worker's environment in its own: CUDA_VISIBLE_DEVICES (and the vendor's variables) mapped onto
  the GPU ids its node shows, OMP_NUM_THREADS, the site's env and the Prefect API;
- starts a forkserver that imports what workers preload (as the default launcher's node process does), so
  that the Nanny's worker is forked from it while this rank initialises MPI. Prefect's task path is in it:
  once per worker here, not once per node (~2.5 s of CPU each). Importing it in each worker after it
  registered was tried: registration came earlier, the first task later (on 2 cores, 8 workers importing
  Prefect at once as the flow starts), so the worker is ready when it registers, as with the default;
- runs dask-mpi's CLI (`dask_mpi.cli.main`) with `--scheduler-file` (Dask's file of this run, written when
  the scheduler listens), `--no-scheduler`, `--protocol tls|tcp`, `--interface`, `--local-directory`, and
  `--worker-options` (name, threads, memory limit, resources, env: this rank's own). The run's TLS
  credentials reach the worker through Dask's configuration (`distributed.comm.tls.*`), which the Nanny's
  default Security reads: dask-mpi's `--worker-options` is JSON and cannot carry a Security object.

Each rank records that it started (`dask-mpi-ranks/started/`) and, if it fails, why (`.../failed/`); the
launcher's own error lines (srun's `error: node2: task 5: Killed`, mpiexec's `process rank 5 ... on node
node2 exited`) are kept as they pass through. `failure()` tells `run` at once when a rank failed or the
launcher exited, and, when the start timeout is up, which ranks never started: naming rank, node and worker.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_garage.core.errors import UserError
from hpc_garage.core.layout import Layout, WorkerSpec
from hpc_garage.launchers.common import (Launcher, end_process, forkserver_env, local_directory, node_gpus, run_entry,
                                        start_worker_forkserver, worker_options, worker_preload)
from hpc_garage.launchers.mpi import node_index, node_workers, write_rank_file
from hpc_garage.rundir import RunDir
from hpc_garage.schedulers import for_allocation, local_rank, node_name, node_rank

# Where MPI implementations put a rank's place among the ranks of its node, and in the whole job, before
# MPI_Init. Read before srun's own variables: under an mpirun that SLURM started, those are its daemon's.
LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "PALS_LOCAL_RANKID", "MPI_LOCALRANKID", "PMI_LOCAL_RANK")
WORLD_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "PALS_RANKID")
# The launcher's own words about a rank that ended: srun's and mpiexec's (OpenMPI, Hydra) error lines
LAUNCHER_ERROR = re.compile(r"^srun: error: .*task|rank \d+.* (exited|killed|terminated)|BAD TERMINATION|"
                            r"^mpiexec.*(noticed|terminated)|^\[proxy.*(exit|kill)", re.IGNORECASE)
# ... and which ranks such a line names: srun's `error: node1: task 3: Exited with exit code 137` (or
# `tasks 4-7: Terminated`), OpenMPI's `process rank 3 with PID 0 on node node1 exited on signal 9 (Killed)`
SRUN_TASKS = re.compile(r"^srun: error: (?P<node>[^:\s]+): tasks? (?P<first>\d+)(?:-(?P<last>\d+))?: (?P<what>.+)$")
OPENMPI_RANK = re.compile(r"process rank (?P<first>\d+) with PID \d+ on node (?P<node>\S+) (?P<what>exited .+?)\.?$")

logger = logging.getLogger(__spec__.name)  # not __name__: a rank runs this module as __main__


# ------------------------------------------------------------------------------------- a rank, before MPI


def _first_int(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        if env.get(name, "").isdigit():
            return int(env[name])
    return None


def world_rank(env: Mapping[str, str]) -> int | None:
    """This rank in the whole job, as the MPI launcher says before MPI_Init (None: it does not say)."""
    return _first_int(env, WORLD_RANK_VARIABLES)


def rank_place(env: Mapping[str, str], hosts: list[str | None], per_node: int) -> tuple[int, int]:
    """(node index, local rank) of this rank: the node by its name (unique names), else the batch system's
    node rank, else world rank // per_node (block placement: srun's default, mpiexec's ppr/-ppn); the local
    rank by MPI's variable, else srun's, else world rank % per_node."""
    world = world_rank(env)
    by_rank = node_rank(env)
    if by_rank is None and world is not None:
        by_rank = world // per_node
    node = node_index(node_name(env), hosts, by_rank)
    local = _first_int(env, LOCAL_RANK_VARIABLES)
    if local is None:
        local = local_rank(env)
    if local is None and world is not None:
        local = world % per_node
    if local is None:
        raise UserError(f"rank on node {node}: its launcher set no local-rank variable "
                        f"({', '.join(LOCAL_RANK_VARIABLES)} or srun's); start the ranks with srun or mpiexec")
    return node, local


def rank_worker(workers: list[WorkerSpec], node: int, local: int, gpus: list[str], vendor: str | tuple[str, ...],
                shared: Mapping[str, str]) -> tuple[WorkerSpec, dict[str, str]] | None:
    """The worker a rank runs, its node's `local`-th, with its whole environment as the default launcher
    gives it (`mpi.node_workers`: shared, the worker's own, its GPUs as its node shows them, masked as the
    site's GPU vendor's runtime reads them); None: a spare rank on a node with fewer workers."""
    mine = node_workers(workers, node, gpus, vendor, shared)
    return mine[local] if local < len(mine) else None


def tls_config(tls: Mapping[str, str] | None) -> dict[str, Any]:
    """The run's TLS files as Dask configuration: what `Security()` (the Nanny's default) reads, equal to
    `Security(require_encryption=True, **tls)` (launchers/common.security_from)."""
    if tls is None:
        return {}
    config: dict[str, Any] = {"distributed.comm.require-encryption": True}
    for key, path in tls.items():
        parts = key.split("_")  # tls_ca_file, tls_<role>_<cert|key>
        if parts == ["tls", "ca", "file"]:
            config["distributed.comm.tls.ca-file"] = path
        elif len(parts) == 3 and parts[0] == "tls" and parts[2] in ("cert", "key"):
            config[f"distributed.comm.tls.{parts[1]}.{parts[2]}"] = path
        else:
            raise ValueError(f"unknown TLS option {key!r}")
    return config


def dask_mpi_args(data: Mapping[str, Any], spec: WorkerSpec, env: dict[str, str]) -> list[str]:
    """dask-mpi's CLI arguments for this rank's worker."""
    options = worker_options(spec)
    options.pop("worker_class", None)  # a class is no JSON: cores are not bound in this mode (README)
    options["env"] = env  # the pinned GPU ids win over the spec's own
    options["death_timeout"] = float(data["timeout"])  # the scheduler file not there by then: give up, no hang
    args = ["--scheduler-file", str(data["scheduler_file"]), "--no-scheduler",
            "--protocol", "tls" if data["tls"] else "tcp"]
    if data.get("interface"):
        args += ["--interface", str(data["interface"])]
    if directory := local_directory(data.get("local_directory")):
        args += ["--local-directory", directory]
    return [*args, "--worker-options", json.dumps(options)]


class Records:
    """What each rank says about itself, in the run directory (shared by the nodes, as the rank file is)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def create(self) -> Records:
        for sub in ("started", "failed"):
            (self.root / sub).mkdir(parents=True, mode=0o700, exist_ok=True)
        return self

    def write(self, kind: str, key: str, data: dict[str, Any]) -> None:
        from hpc_garage.files import write_private

        with contextlib.suppress(OSError):  # a record is a courtesy: never the reason a rank fails
            write_private(self.root / kind / f"{key}.json", json.dumps(data))

    def read(self, kind: str) -> dict[str, dict[str, Any]]:
        found: dict[str, dict[str, Any]] = {}
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.root / kind):
                if entry.name.endswith(".json") and not entry.name.startswith("."):
                    with contextlib.suppress(OSError, ValueError):
                        found[entry.name[:-5]] = json.loads(Path(entry.path).read_text())
        return found

    def any_failed(self) -> bool:
        with contextlib.suppress(OSError):
            return any(e.name.endswith(".json") and not e.name.startswith(".") for e in os.scandir(self.root / "failed"))
        return False


def main(argv: list[str] | None = None) -> int:
    """Entry point of one rank: `python -m hpc_garage.launchers.dask_mpi RANKS.json`."""
    argv = sys.argv[1:] if argv is None else argv
    path = Path(argv[0])
    data: dict[str, Any] = json.loads(path.read_text())
    records = Records(RunDir(path.parent).rank_records)  # the rank file is in the run directory
    workers = [WorkerSpec.from_dict(w) for w in data["workers"]]
    per_node = max(collections.Counter(w.node for w in workers).values())
    world = world_rank(os.environ)
    here = {"rank": world, "host": node_name(os.environ), "pid": os.getpid()}
    key = f"rank-{world}" if world is not None else f"pid-{os.getpid()}"
    try:
        node, local = rank_place(os.environ, data["hosts"], per_node)
        key, here = f"{node}-{local}", {**here, "node": node, "local_rank": local}
        vendor = data["gpu_vendor"]
        records.write("started", key, {**here, "time": time.time()})
        mine = rank_worker(workers, node, local, node_gpus(os.environ, vendor), vendor, data["env"])
        if mine is None:
            from mpi4py import MPI

            MPI.COMM_WORLD.Barrier()  # dask-mpi's ranks wait for each other once: a spare rank takes part
            return 0
        spec, env = mine
        os.environ.update(env)  # before MPI_Init and before anything that may load CUDA
        start_worker_forkserver(forkserver_env(env, [spec]), data["preload"])
        import dask
        from dask_mpi.cli import main as dask_mpi_cli

        dask.config.set(tls_config(data["tls"]))
        dask_mpi_cli.main(args=dask_mpi_args(data, spec, env), prog_name="dask-mpi", standalone_mode=False)
        return 0
    except BaseException as exc:
        if not isinstance(exc, (KeyboardInterrupt, SystemExit)) or isinstance(exc, SystemExit) and exc.code:
            records.write("failed", key, {**here, "error": f"{type(exc).__name__}: {exc}", "time": time.time()})
        raise


# ------------------------------------------------------------------------------------- the driver side


class DaskMpiLauncher(Launcher):
    """Inside `hpc-garage run` on the job's first node: writes the rank file, starts one rank per worker."""

    def __init__(self, layout_: Layout, env: Mapping[str, str]) -> None:
        self.layout = layout_
        self.env = dict(env)
        self.proc: asyncio.subprocess.Process | None = None
        self.argv: list[str] = []
        self.records: Records | None = None
        self.deadline = float("inf")
        self.timeout = 0.0
        self.failed = False  # failure() gave a reason: the ranks are not coming, so stop ends them at once
        self.said: collections.deque[str] = collections.deque(maxlen=12)  # the launcher's last error lines
        self._relay: asyncio.Task[None] | None = None
        iface = layout_.site.interface
        self.scheduler_host = {"interface": iface} if iface else {"host": None}
        counts = collections.Counter(w.node for w in layout_.workers)
        self.per_node = max(counts.values(), default=1)

    def rank_argv(self, ranks_file: Path) -> list[str]:
        from hpc_garage.schedulers.jobscript import dask_mpi_ranks  # the site models: not in every rank

        batch = for_allocation(self.layout.allocation)
        in_slurm = bool(batch and batch.launches_ranks)
        via = self.layout.site.mpi.via
        if via == "srun" and not in_slurm:
            raise UserError("mpi.via: srun, but this job is not a SLURM job; use via: mpiexec or auto")
        nodefile = batch.nodefile(self.env) if batch else None
        from hpc_garage.schedulers.container import python_argv

        rank_argv = [*python_argv(self.layout.site), "-m", "hpc_garage.launchers.dask_mpi", str(ranks_file)]
        return dask_mpi_ranks(self.layout, rank_argv, in_slurm=in_slurm, nodefile=nodefile)

    async def prepare(self, tls: dict[str, str] | None, worker_env: dict[str, str], rundir: RunDir,
                      timeout: float) -> None:
        """Start the ranks now; dask-mpi's Nannies wait for the scheduler file while the scheduler starts."""
        ranks_file = rundir.ranks_file
        write_rank_file(ranks_file, self.layout, scheduler_file=rundir.dask_scheduler_file, tls=tls,
                        worker_env=worker_env, timeout=timeout, preload=worker_preload(worker_env))
        self.records = Records(rundir.rank_records)
        shutil.rmtree(self.records.root, ignore_errors=True)  # a rerun of the same job id starts clean
        self.records.create()
        self.argv = self.rank_argv(ranks_file)
        env = {**self.env, **self.layout.site.env}
        if self.argv[0] != "srun" and self.layout.site.mpi.flavor == "openmpi" and os.geteuid() == 0:
            env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}  # OpenMPI refuses root
        logger.info(f"starting dask-mpi ranks: {shlex.join(self.argv)}")
        self.timeout, self.deadline = timeout, time.monotonic() + timeout
        try:
            self.proc = await asyncio.create_subprocess_exec(*self.argv, env=env, start_new_session=True,
                                                             stderr=asyncio.subprocess.PIPE)
        except FileNotFoundError:
            raise UserError(f"{self.argv[0]}: not found; install MPI or set the site's mpi.via") from None
        self._relay = asyncio.ensure_future(self._relay_stderr())

    async def _relay_stderr(self) -> None:
        """The ranks' and the launcher's stderr, passed on as it comes (any line length: a stalled reader
        would stall the ranks); the launcher's error lines kept."""
        assert self.proc is not None and self.proc.stderr is not None
        out = getattr(sys.stderr, "buffer", None)
        pending = b""
        while chunk := await self.proc.stderr.read(65536):
            if out is not None:
                out.write(chunk)
            else:
                sys.stderr.write(chunk.decode(errors="replace"))
            sys.stderr.flush()
            *lines, pending = (pending + chunk).split(b"\n")
            pending = pending[-4096:]
            for line in lines:
                text = line[:4096].decode(errors="replace").strip()
                if LAUNCHER_ERROR.search(text):
                    self.said.append(text)

    async def start(self, address: str, tls: dict[str, str] | None, worker_env: dict[str, str],
                    rundir: RunDir) -> None:
        """Nothing left to do: the ranks read the scheduler's address from Dask's scheduler file."""

    def failure(self) -> str | None:
        """A reason naming ranks, their nodes and workers, once the ranks cannot all come up: one failed,
        the launcher exited, or the start timeout is up with ranks that never started."""
        if self.proc is None or self.records is None:
            return None
        ended = self.proc.returncode is not None
        if ended or self.records.any_failed():
            self.failed = True
            return self.report(f"`{self.argv[0]}` exited with code {self.proc.returncode}" if ended else None)
        if time.monotonic() > self.deadline and self.never_started():
            self.failed = True
            return self.report(None, f"none within the {self.timeout:.0f} s start timeout")
        return None

    def expected(self) -> dict[str, str]:
        """Every rank that runs a worker, by record key, described as `rank R (node N, HOST, worker W)`."""
        hosts = [n.host for n in self.layout.allocation.nodes]
        seen: dict[int, int] = {}
        out: dict[str, str] = {}
        for w in self.layout.workers:
            local = seen[w.node] = seen.get(w.node, -1) + 1
            rank = w.node * self.per_node + local
            out[f"{w.node}-{local}"] = f"rank {rank} (node {w.node}{f', {hosts[w.node]}' if hosts[w.node] else ''}, worker {w.name})"
        return out

    def never_started(self) -> list[str]:
        started = self.records.read("started") if self.records else {}
        return [label for key, label in self.expected().items() if key not in started]

    def first_ended(self) -> str | None:
        """The rank the launcher reported first (srun and mpiexec name it before the ranks they ended)."""
        for line in self.said:
            if m := SRUN_TASKS.match(line) or OPENMPI_RANK.search(line):
                first = int(m["first"])
                last = int(m["last"]) if m.groupdict().get("last") else first
                node, local = divmod(first, self.per_node)  # block placement: K ranks per node, in node order
                label = self.expected().get(f"{node}-{local}", f"rank {first} (on {m['node']})")
                more = f" (and ranks {first + 1}-{last})" if last > first else ""
                return f"{label}{more} ended first: {m['what'].strip()}"
        return None

    def report(self, launcher: str | None, waited: str | None = None) -> str:
        """What went wrong, ranks first: those that said why they failed, else the one the launcher saw end
        first; those that never started (at the timeout, or when nothing else is known); the launcher's own
        error lines."""
        assert self.records is not None
        expected = self.expected()
        parts = []
        for key, rec in sorted(self.records.read("failed").items()):
            where = expected.get(key) or f"rank {rec.get('rank')} on {rec.get('host')} (pid {rec.get('pid')})"
            parts.append(f"{where} failed: {rec.get('error')}")
        if not parts and launcher and (first := self.first_ended()):
            parts.append(first)
        never = self.never_started()
        if never and (waited or not parts):
            shown = "; ".join(never[:4]) + (f"; and {len(never) - 4} more" if len(never) > 4 else "")
            parts.append(f"{len(never)} of {len(expected)} ranks never started ({waited or 'before it ended'}): "
                         f"{shown}")
        if self.said:
            parts.append("the launcher said: " + " | ".join(list(self.said)[-4:]))
        if launcher:
            parts.insert(0, launcher)
        return "; ".join(parts) or "a rank failed"

    async def stop(self) -> None:
        """Workers leave when the scheduler closes; ranks still running after that are ended."""
        if self.proc is not None:
            steps = ((None, 20.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0))
            await end_process(self.proc, steps[1:] if self.failed else steps, group=True)
        if self._relay is not None:
            with contextlib.suppress(asyncio.TimeoutError, Exception):
                await asyncio.wait_for(self._relay, 5)
        if self.records is not None:
            shutil.rmtree(self.records.root, ignore_errors=True)


if __name__ == "__main__":
    run_entry(main)
