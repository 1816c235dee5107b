"""The mpi launcher: one MPI rank per WorkerSpec across the allocation, started by srun or mpiexec.

`hpc-garage run` (on the job's first node) runs the scheduler itself, so no rank and no GPU is spent on it,
then starts the ranks with `rank_command()`. Each rank finds its node and node-local rank, pins itself to
its WorkerSpec's GPUs as its *own node* shows them, and only then imports distributed and starts its worker
through dask-mpi's `execute` with that spec's threads, memory limit and resources.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import shlex
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_garage.errors import UserError
from hpc_garage.launchers.common import Launcher
from hpc_garage.layout import Plan, WorkerSpec, pin_gpus


@dataclass(frozen=True)
class RankLaunch:
    """How many ranks, on how many nodes, and the command that starts them."""

    argv: list[str]
    env: dict[str, str]


def rank_command(plan_: Plan, rank_argv: list[str], *, in_slurm: bool, nodefile: str | None) -> RankLaunch:
    """The launch command for the plan's ranks: pure, so each launcher's spelling is easy to test."""
    site, mpi = plan_.site, plan_.site.mpi
    nodes = len(plan_.allocation.nodes)
    per_node = max(sum(1 for w in plan_.workers if w.node == i) for i in range(nodes))
    total = per_node * nodes
    launch = mpi.launch if mpi.launch != "auto" else ("srun" if in_slurm else "mpiexec")
    env: dict[str, str] = {}
    if launch == "srun":
        cores = min(w.resources["CPU"] for w in plan_.workers)
        argv = ["srun", f"--nodes={nodes}", f"--ntasks={total}", f"--ntasks-per-node={per_node}",
                f"--cpus-per-task={int(cores)}", "--kill-on-bad-exit=1",
                *mpi.srun_args, *rank_argv]
        return RankLaunch(argv, env)
    if mpi.flavor == "openmpi":
        argv = [mpi.mpiexec, "-n", str(total), "--map-by", f"ppr:{per_node}:node", "--bind-to", "none"]
        argv += ["--hostfile", nodefile] if nodefile else []
        if os.geteuid() == 0:  # OpenMPI refuses root without both of these
            env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    else:  # MPICH / Hydra, Cray PALS, Intel MPI
        argv = [mpi.mpiexec, "-n", str(total), "-ppn", str(per_node)]
        argv += ["-f", nodefile] if nodefile else []
    return RankLaunch([*argv, *mpi.mpiexec_args, *rank_argv], env)


def write_rank_plan(path: Path, plan_: Plan, *, address: str, tls: dict[str, str] | None,
                    worker_env: dict[str, str]) -> None:
    """Everything a rank needs, in one private file (a command line would show it to `ps`)."""
    from hpc_garage.handoff import write_private

    data = {
        "address": address,
        "tls": tls,
        "env": worker_env,
        "interface": plan_.site.interface,
        "local_directory": plan_.site.local_directory,  # expanded on each node: $TMPDIR differs there
        "gpu_env_vars": list(plan_.site.gpu_env_vars),
        "hosts": [n.host for n in plan_.allocation.nodes],
        "workers": [w.to_dict() for w in plan_.workers],
    }
    write_private(path, json.dumps(data))


def node_name(env: Mapping[str, str]) -> str:
    """This rank's node as the batch system names it (several slurmd on one host differ only here)."""
    return env.get("SLURMD_NODENAME") or socket.gethostname()


def node_index(name: str, hosts: list[str | None], seen_order: list[str]) -> int:
    """Match a rank's node to the allocation's host list (short names match FQDNs)."""
    short = name.split(".")[0]
    for i, host in enumerate(hosts):
        if host and (host == name or host.split(".")[0] == short):
            return i
    return seen_order.index(name)  # hosts unknown by name: ranks come node by node


def node_gpus(env: Mapping[str, str]) -> list[str]:
    raw = env.get("CUDA_VISIBLE_DEVICES", "")
    return [x for x in raw.split(",") if x.strip() and x != "NoDevFiles"]


def choose_spec(rank_nodes: list[str], rank: int, hosts: list[str | None], workers: list[WorkerSpec]) -> WorkerSpec | None:
    """The WorkerSpec of `rank`, given every rank's node name; None for a rank with nothing to do."""
    me = rank_nodes[rank]
    order = list(dict.fromkeys(rank_nodes))
    index = node_index(me, hosts, order)
    local_rank = rank_nodes[:rank].count(me)
    mine = [w for w in workers if w.node == index]
    return mine[local_rank] if local_rank < len(mine) else None


def main(argv: list[str] | None = None) -> int:
    """Entry point of one rank: `python -m hpc_garage.launchers.mpi RANKS.json`."""
    argv = sys.argv[1:] if argv is None else argv
    data: dict[str, Any] = json.loads(Path(argv[0]).read_text())
    workers = [WorkerSpec(**{**w, "gpu_slots": tuple(w["gpu_slots"])}) for w in data["workers"]]
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    rank_nodes = comm.allgather(node_name(os.environ))
    spec = choose_spec(rank_nodes, rank, data["hosts"], workers)
    active = comm.Split(color=1 if spec else 0, key=rank)
    if spec is None:
        return 0
    pinned = pin_gpus(spec, node_gpus(os.environ), tuple(data["gpu_env_vars"]))
    env = {**data["env"], **spec.env, **pinned}
    os.environ.update(env)  # before distributed (or anything that may load CUDA) is imported

    import dask_mpi
    from distributed.security import Security

    security = Security(require_encryption=True, **data["tls"]) if data["tls"] else None
    options: dict[str, Any] = {"name": spec.name, "resources": spec.resources, "env": env,
                               "security": security}
    dask_mpi.execute(
        scheduler=False,
        scheduler_address=data["address"],
        client_rank=0,
        exclusive_workers=False,
        interface=data["interface"],
        protocol="tls" if security else "tcp",
        nthreads=spec.nthreads,
        memory_limit=spec.memory_limit,
        local_directory=_expand(data["local_directory"]),
        worker_class="distributed.Nanny",
        worker_options=options,
        comm=active,
    )
    return 0


def _expand(path: str | None) -> str | None:
    expanded = os.path.expanduser(os.path.expandvars(path)) if path else None
    return None if expanded is None or "$" in expanded else expanded


class MpiLauncher(Launcher):
    """The driver side, inside `hpc-garage run` on the job's first node: writes the rank plan, starts ranks."""

    def __init__(self, plan_: Plan, env: Mapping[str, str]) -> None:
        self.plan = plan_
        self.env = dict(env)
        self.proc: asyncio.subprocess.Process | None = None
        self.launch: RankLaunch | None = None
        iface = plan_.site.interface
        self.scheduler_host = {"interface": iface} if iface else {"host": None}

    async def start(self, address: str, tls: dict[str, str] | None, worker_env: dict[str, str],
                    rundir: Any) -> None:
        ranks_file = rundir.path / "ranks.json"
        write_rank_plan(ranks_file, self.plan, address=address, tls=tls, worker_env=worker_env)
        nodefile = self.env.get("PBS_NODEFILE") if self.plan.allocation.source == "pbs" else None
        python = self.plan.site.python or sys.executable
        self.launch = rank_command(self.plan, [python, "-m", "hpc_garage.launchers.mpi", str(ranks_file)],
                                   in_slurm=self.plan.allocation.source == "slurm", nodefile=nodefile)
        print(f"hpc-garage: starting ranks: {shlex.join(self.launch.argv)}", file=sys.stderr, flush=True)
        try:
            self.proc = await asyncio.create_subprocess_exec(*self.launch.argv, env={**self.env, **self.plan.site.env, **self.launch.env},
                                                             start_new_session=True)
        except FileNotFoundError:
            raise UserError(f"{self.launch.argv[0]}: not found; install MPI or set the site's mpi.launch") from None

    def failure(self) -> str | None:
        if self.proc is not None and self.proc.returncode is not None and self.launch is not None:
            return f"`{self.launch.argv[0]}` exited with code {self.proc.returncode}"
        return None

    async def stop(self) -> None:
        """Workers leave when the scheduler closes; a launcher still running after that is ended."""
        if self.proc is None or self.proc.returncode is not None:
            return
        for sig, wait in ((None, 20.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            if sig is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, sig)
            try:
                await asyncio.wait_for(self.proc.wait(), wait)
                return
            except asyncio.TimeoutError:
                continue


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as exc:
        print(f"hpc-garage: error: {exc}", file=sys.stderr)
        sys.exit(2)
