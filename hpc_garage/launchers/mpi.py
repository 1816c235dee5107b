"""The mpi launcher: one process per node of the allocation, started by srun or mpiexec, hosting that
node's workers.

`hpc-garage run` (on the job's first node) runs the scheduler itself, so no GPU is spent on it. It starts
the node processes first (`rank_commands()`), while its own scheduler is still starting: each finds its node,
starts a forkserver that imports distributed (and Prefect's task path) once, waits for the scheduler's
address in the run directory, then starts one Nanny per WorkerSpec of its node, each worker with its own
GPUs (as its own node shows them), threads, memory limit and resources, forked from that server.

Why not dask-mpi's one rank per worker (which the first version used): every rank is a fresh interpreter
that initialises MPI and imports distributed, and its Nanny spawns another; on a node with 4 workers that
is 8 imports before the first task, measured here as 5.0 s from job start to 4 registered workers. MPI
itself is not needed: a node process knows its node by name (or by its launcher's rank variable).

A node process that dies takes only its own workers (issue 11). Under srun each node has its own job step
(`srun --nodes=1 --nodelist=HOST --kill-on-bad-exit=0`), so `run` knows which node it lost, when, and can
start that node's process again in a new step, with the same GPU pins (cluster/node_loss.py decides).
mpiexec starts all nodes at once, told not to end the others when one rank dies (OpenMPI
`--enable-recovery`, Hydra `-disable-auto-cleanup`); there a lost node shows as all its workers leaving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import shlex
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_garage.core.errors import UserError
from hpc_garage.launchers.common import (Launcher, end_process, forkserver_env, local_directory, node_gpus, run_entry,
                                        security_from, start_worker_forkserver, tell_scheduler_of_term,
                                        worker_options, worker_preload)
from hpc_garage.core.gpus import vendor_of
from hpc_garage.core.layout import Layout, WorkerSpec, pin_gpus
from hpc_garage.variables import CPUS_ENV
from hpc_garage.schedulers import for_allocation, job_id, node_name, node_rank

if TYPE_CHECKING:
    from hpc_garage.rundir import RunDir

RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "PALS_RANKID")  # after the batch system's own

logger = logging.getLogger(__spec__.name)  # not __name__: a node process runs this module as __main__


@dataclass(frozen=True)
class RankLaunch:
    """The command that starts the node processes of `nodes` (all of them, or one srun step's node)."""

    argv: list[str]
    env: dict[str, str]
    nodes: tuple[int, ...] = ()


def uses_srun(layout_: Layout, *, in_slurm: bool) -> bool:
    mpi = layout_.site.mpi
    return (mpi.launch if mpi.launch != "auto" else ("srun" if in_slurm else "mpiexec")) == "srun"


def rank_commands(layout_: Layout, rank_argv: list[str], *, in_slurm: bool, nodefile: str | None) -> list[RankLaunch]:
    """How the node processes start: under srun one job step per node (so losing one is seen, named and
    restartable: `node_command`), where every node's host is known; else one launch for all nodes."""
    hosts = [n.host for n in layout_.allocation.nodes]
    if uses_srun(layout_, in_slurm=in_slurm) and all(hosts) and len(set(hosts)) == len(hosts):
        return [node_command(layout_, rank_argv, i) for i in range(len(hosts))]
    return [rank_command(layout_, rank_argv, in_slurm=in_slurm, nodefile=nodefile)]


def _node_cores(layout_: Layout, node: int) -> int:
    return max(1, int(sum(w.resources.get("CPU", w.nthreads) for w in layout_.workers if w.node == node)))


def node_command(layout_: Layout, rank_argv: list[str], node: int) -> RankLaunch:
    """One srun step running `node`'s process on that node alone; the process is told its node index.
    `--kill-on-bad-exit=0`: a step whose process dies ends alone (the site's srun_args may not undo that)."""
    host = str(layout_.allocation.nodes[node].host)
    argv = ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={host}", f"--cpus-per-task={_node_cores(layout_, node)}",
            *layout_.site.mpi.srun_args, "--kill-on-bad-exit=0", *rank_argv, str(node)]
    return RankLaunch(argv, {}, (node,))


def rank_command(layout_: Layout, rank_argv: list[str], *, in_slurm: bool, nodefile: str | None) -> RankLaunch:
    """The launch command for one process per node, all nodes at once: pure, so each launcher's spelling is
    easy to test. The launcher is told not to end the other ranks when one dies."""
    mpi = layout_.site.mpi
    nodes = len(layout_.allocation.nodes)
    every = tuple(range(nodes))
    env: dict[str, str] = {}
    if uses_srun(layout_, in_slurm=in_slurm):
        cores = min(_node_cores(layout_, i) for i in range(nodes))
        argv = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1",
                f"--cpus-per-task={cores}", *mpi.srun_args, "--kill-on-bad-exit=0", *rank_argv]
        return RankLaunch(argv, env, every)
    if mpi.flavor == "openmpi":  # --enable-recovery: a rank that dies does not abort the others (4.x and 5.x)
        argv = [mpi.mpiexec, "-n", str(nodes), "--map-by", "ppr:1:node", "--bind-to", "none", "--enable-recovery"]
        argv += ["--hostfile", nodefile] if nodefile else []
        if os.geteuid() == 0:  # OpenMPI refuses root without both of these
            env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    else:  # MPICH / Hydra, Cray PALS, Intel MPI: -disable-auto-cleanup keeps the others when one rank dies
        argv = [mpi.mpiexec, "-n", str(nodes), "-ppn", "1", "-disable-auto-cleanup"]
        argv += ["-f", nodefile] if nodefile else []
    return RankLaunch([*argv, *mpi.mpiexec_args, *rank_argv], env, every)


def write_rank_file(path: Path, layout_: Layout, *, scheduler_file: Path, tls: dict[str, str] | None,
                    worker_env: dict[str, str], timeout: float, preload: list[str]) -> None:
    """Everything a node process needs, in one private file (a command line would show it to `ps`).

    The scheduler's address is not in it: the node processes start before the scheduler does and read
    the address from `scheduler_file`, which the scheduler writes once it listens.
    """
    from hpc_garage.files import write_private

    data = {
        "scheduler_file": str(scheduler_file),
        "timeout": timeout,
        "tls": tls,
        "env": worker_env,
        "preload": preload,
        "interface": layout_.site.interface,
        "local_directory": layout_.site.local_directory,  # expanded on each node: $TMPDIR differs there
        "gpu_vendor": layout_.site.node.gpu_vendor,
        "bind_cpus": layout_.site.workers.bind_cpus,
        "hosts": [n.host for n in layout_.allocation.nodes],
        "workers": [w.to_dict() for w in layout_.workers],
    }
    write_private(path, json.dumps(data))


def launcher_rank(env: Mapping[str, str]) -> int | None:
    """The rank its launcher gave this process (one per node, in the node list's order), if it says."""
    if (rank := node_rank(env)) is not None:
        return rank
    for name in RANK_VARIABLES:
        if env.get(name, "").isdigit():
            return int(env[name])
    return None


def node_index(name: str, hosts: list[str | None], rank: int | None) -> int:
    """Which node of the allocation this process runs on: by name (short names match FQDNs); by the
    launcher's rank where names are missing or repeat (several batch nodes on one host)."""
    short = name.split(".")[0]
    matches = [i for i, host in enumerate(hosts) if host and (host == name or host.split(".")[0] == short)]
    if len(matches) == 1:
        return matches[0]
    if rank is not None and rank < len(hosts) and (not matches or rank in matches):
        return rank
    if matches:
        return matches[0]
    raise UserError(f"node {name!r} is not one of this job's nodes ({', '.join(map(str, hosts))}) and its "
                    f"launcher set no rank variable; set the site's mpi.launch")


def node_workers(workers: list[WorkerSpec], node: int, gpus: list[str], gpu_vendor: str | tuple[str, ...],
                 shared_env: Mapping[str, str], *, bind: bool = False,
                 env: Mapping[str, str] | None = None) -> list[tuple[WorkerSpec, dict[str, str]]]:
    """This node's workers, each with its whole environment: shared, its own, its GPUs pinned last (as the
    site's `gpu_vendor` masks them), and with `bind`, its cores chosen on this machine (`env` says where its
    topology is read: $HPC_GARAGE_SYSFS_ROOT) and printed, with what was assumed."""
    mine = [(w, {**shared_env, **w.env, **pin_gpus(w, gpus, gpu_vendor)}) for w in workers if w.node == node]
    if not bind or not mine:
        return mine
    from dataclasses import replace

    from hpc_garage.launchers.topology import bind_here

    vendor = vendor_of(gpu_vendor)
    bound, notes = bind_here([replace(w, env=e) for w, e in mine], node, vendor, os.environ if env is None else env)
    for note in notes:
        logger.info(f"node {node}: {note}")
    for w in bound:
        if w.cpus:
            logger.info(f"worker {w.name}: cores {w.env[CPUS_ENV]}, OMP_NUM_THREADS {w.env['OMP_NUM_THREADS']}, "
                        f"{w.nthreads} threads")
    return [(w, w.env) for w in bound]


def main(argv: list[str] | None = None) -> int:
    """Entry point of one node process: `python -m hpc_garage.launchers.mpi RANKS.json [NODE]` (NODE: its
    index, given where each node has its own launch)."""
    argv = sys.argv[1:] if argv is None else argv
    data: dict[str, Any] = json.loads(Path(argv[0]).read_text())
    workers = [WorkerSpec.from_dict(w) for w in data["workers"]]
    if len(argv) > 1:
        node = int(argv[1])
    else:
        node = node_index(node_name(os.environ), data["hosts"], launcher_rank(os.environ))
    vendor = data["gpu_vendor"]  # written by the same version: run and its node processes are one install
    mine = node_workers(workers, node, node_gpus(os.environ, vendor), vendor, data["env"],
                        bind=bool(data.get("bind_cpus")))
    if not mine:
        return 0
    start_worker_forkserver(forkserver_env(data["env"], [w for w, _ in mine]), data["preload"])
    return asyncio.run(_serve_node(data, mine))


async def _serve_node(data: dict[str, Any], mine: list[tuple[WorkerSpec, dict[str, str]]]) -> int:
    from distributed import Nanny

    address = await _scheduler_address(Path(data["scheduler_file"]), float(data["timeout"]))
    security = security_from(data["tls"])
    extra: dict[str, Any] = {"security": security, "protocol": "tls" if security else "tcp",
                             "interface": data["interface"]}
    if directory := local_directory(data["local_directory"]):
        extra["local_directory"] = directory
    nannies = []
    for spec, env in mine:
        options = worker_options(spec, **extra)
        options["env"] = env  # the pinned GPU ids win over the spec's own
        nannies.append(Nanny(address, **options))
    _hold_term(address, security)
    await asyncio.gather(*(n.start() for n in nannies))
    await asyncio.gather(*(n.finished() for n in nannies))
    return 0


def _hold_term(address: str, security: Any) -> None:
    """The batch system's first SIGTERM to this step (Slurm's preemption notice, scancel, qdel) does not end this
    node's workers: `run` is told, and winds the job down in the time left (its trials save their checkpoints).
    A second SIGTERM ends this process as before; `run` ends it anyway once the job is wound down."""
    loop = asyncio.get_running_loop()

    def held() -> None:
        loop.remove_signal_handler(signal.SIGTERM)
        logger.info("signal SIGTERM: the job is ending; `run` is told and winds it down (a second SIGTERM ends "
                    "this node's workers)")
        asyncio.ensure_future(tell_scheduler_of_term(address, security, job_id(os.environ)))

    loop.add_signal_handler(signal.SIGTERM, held)


async def _scheduler_address(path: Path, timeout: float) -> str:
    """Wait for the scheduler (started after this process) to write its address."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
            return str(json.loads(path.read_text())["address"])
        if time.monotonic() > deadline:
            raise UserError(f"no scheduler address in {path} after {timeout:.0f} s; did `hpc-garage run` die?")
        await asyncio.sleep(0.05)


class MpiLauncher(Launcher):
    """The driver side, inside `hpc-garage run` on the job's first node: writes the rank file, starts the node
    processes, and says which of them ended (`lost_nodes`) and starts a lost node's process again."""

    nodes_watched = True

    def __init__(self, layout_: Layout, env: Mapping[str, str]) -> None:
        self.layout = layout_
        self.env = dict(env)
        self.launches: list[RankLaunch] = []
        self.procs: list[asyncio.subprocess.Process] = []  # the running one of each launch, in launches' order
        self.reported: set[int] = set()  # ids of processes whose exit lost_nodes() has told
        self.rank_argv: list[str] = []
        self.stopping = False
        iface = layout_.site.interface
        self.scheduler_host = {"interface": iface} if iface else {"host": None}

    @property  # type: ignore[override]
    def per_node(self) -> bool:
        """Each node has a process of its own, so its loss is seen when that process exits."""
        return bool(self.launches) and all(len(launch.nodes) == 1 for launch in self.launches)

    async def prepare(self, tls: dict[str, str] | None, worker_env: dict[str, str], rundir: RunDir,
                      timeout: float) -> None:
        """Start the node processes now; they wait for the scheduler's address while it starts."""
        ranks_file = rundir.ranks_file
        write_rank_file(ranks_file, self.layout, scheduler_file=rundir.dask_scheduler_file, tls=tls,
                        worker_env=worker_env, timeout=timeout, preload=worker_preload(worker_env))
        batch = for_allocation(self.layout.allocation)
        from hpc_garage.schedulers.container import python_argv  # the site models: not in every node process

        self.rank_argv = [*python_argv(self.layout.site), "-m", "hpc_garage.launchers.mpi", str(ranks_file)]
        self.launches = rank_commands(self.layout, self.rank_argv, in_slurm=bool(batch and batch.launches_ranks),
                                      nodefile=batch.nodefile(self.env) if batch else None)
        for launch in self.launches:
            self.procs.append(await self._start(launch))

    async def _start(self, launch: RankLaunch) -> asyncio.subprocess.Process:
        logger.info(f"starting ranks: {shlex.join(launch.argv)}")
        env = {**self.env, **self.layout.site.env, **launch.env}
        try:
            return await asyncio.create_subprocess_exec(*launch.argv, env=env, start_new_session=True)
        except FileNotFoundError:
            raise UserError(f"{launch.argv[0]}: not found; install MPI or set the site's mpi.launch") from None

    async def start(self, address: str, tls: dict[str, str] | None, worker_env: dict[str, str],
                    rundir: RunDir) -> None:
        """Nothing left to do: the node processes read the address the scheduler wrote."""

    def failure(self) -> str | None:
        for launch, proc in zip(self.launches, self.procs):
            if proc.returncode is not None:
                return f"`{launch.argv[0]}` exited with code {proc.returncode}"
        return None

    def lost_nodes(self) -> list[tuple[int, str]]:
        """(node, why) for each node process that ended since the last call, while the run goes on."""
        if self.stopping or not self.per_node:
            return []
        lost = []
        for launch, proc in zip(self.launches, self.procs):
            if proc.returncode is not None and id(proc) not in self.reported:
                self.reported.add(id(proc))
                code = proc.returncode
                why = f"killed by signal {-code}" if code < 0 else f"exited with code {code}" + (
                    f" (signal {code - 128})" if code > 128 else "")  # srun: 128 + the signal its task died of
                lost.append((launch.nodes[0], f"its process (`{launch.argv[0]}` step) {why}"))
        return lost

    async def restart_node(self, node: int) -> bool:
        """Start `node`'s process again in a new srun step on that node: the same workers, names and GPU pins."""
        if self.stopping or not self.per_node:
            return False
        index = next(i for i, launch in enumerate(self.launches) if launch.nodes == (node,))
        self.procs[index] = await self._start(self.launches[index])
        return True

    def draining(self) -> None:
        self.stopping = True

    async def stop(self) -> None:
        """Workers leave when the scheduler closes; launchers still running after that are ended."""
        self.stopping = True
        steps = ((None, 20.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0))
        await asyncio.gather(*(end_process(proc, steps, group=True) for proc in self.procs))


if __name__ == "__main__":
    run_entry(main)
