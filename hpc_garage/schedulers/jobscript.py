"""The job script: rendered by one function from plain parameters, through a template per batch system.

A job script is inert text until the batch system runs it, and what reaches it from a command line (job
name, paths, arguments, account) must stay inert. So directive values are held to a plain character set
(sbatch, PBS Pro and the Torque `qsub` wrapper each split directive lines by their own rules, and the
wrapper even passes some of them through a shell), and every word of the body that is not the site's own
shell code (`setup`) is shlex-quoted. Templates are `string.Template` files in `jobscripts/`.
"""

from __future__ import annotations

import re
import shlex
import string
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from functools import cache
from typing import Any

from hpc_garage._version import __version__
from hpc_garage.core.allocation import Allocation
from hpc_garage.core.errors import UserError
from hpc_garage.core.request import Request
from hpc_garage.core.layout import Layout, layout
from hpc_garage.core.site import Site
from hpc_garage.schedulers.directive_values import CONTROL, directive, path_value, plain  # noqa: F401 (API)
from hpc_garage.sites.files import packaged_dir

_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")


@dataclass(frozen=True)
class JobSpec:
    """Everything a job script says, resolved and checked: the plain parameters `render` works from."""

    scheduler: str  # slurm | pbs
    site: str  # what `run --site` gets inside the job: the site file's absolute path (or its name)
    site_name: str
    job_name: str
    nodes: int
    tasks_per_node: int  # Dask workers per node, from the layout
    cpus_per_task: int  # cores per worker: tasks × cpus claims every core the workers use
    gpus_per_node: int
    gpu_type: str | None
    memory: int  # bytes per node
    walltime: int  # seconds
    queue: str | None
    account: str | None
    qos: str | None
    output: str  # stdout (+ stderr unless `error`) as the batch system takes it: may hold %j on SLURM
    error: str | None
    directives: tuple[str, ...]  # the site's, then the user's pass-through options, without the prefix
    setup: tuple[str, ...]  # the site's shell lines, verbatim
    workdir: str
    python: str
    script: str  # absolute
    args: tuple[str, ...]
    ranks: str = ""  # `mpi: {launch: dask-mpi}`: the line `run` starts the worker ranks with, shown as a comment
    sweep: str = ""  # the sweep this job works on (core/sweep.py), and its epoch
    sweep_epoch: int = 0
    warning_signal: str | None = None  # the site's SIG@SECONDS: the batch system warns the job before its end
    requeue: bool = False  # the site's `requeue: auto`: the job may be requeued (preemption) and continued
    container: str = ""  # `--container IMAGE`: handed to `run`, over the site's container.image
    container_python: str = ""  # the interpreter inside the image, which runs COMMAND (empty: no container)
    container_line: str = ""  # the line `run` re-executes itself with inside the image, shown as a comment

    @property
    def sweep_args(self) -> list[str]:
        return ["--sweep", self.sweep, "--sweep-epoch", str(self.sweep_epoch)] if self.sweep else []

    @property
    def command(self) -> list[str]:
        """What the job runs: `run` wrapping the user's script, with the same interpreter for both."""
        return [self.python, "-m", "hpc_garage", "run", "--site", self.site, *self.sweep_args, "--", self.python,
                self.script, *self.args]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def render(spec: JobSpec) -> str:
    """The job script for this spec. Pure: same spec, same text."""
    from hpc_garage.schedulers import get

    batch = get(spec.scheduler)
    values: dict[str, Any] = batch.template_values(spec)
    directives = [directive(d, "a directive") for d in values.pop("directives", [])]
    body = _fill(
        "body.sh",
        version=__version__,
        site_name=spec.site_name,
        workdir=shlex.quote(spec.workdir),
        setup="\n".join(_no_nul(line, "a setup line of the site") for line in spec.setup),
        python=shlex.quote(spec.python),
        site=shlex.quote(spec.site),
        sweep="".join(f" {shlex.quote(word)}" for word in spec.sweep_args),
        command=shlex.join([spec.script, *(_no_nul(a, "an argument") for a in spec.args)]),
        ranks=_ranks_comment(spec.ranks),
        container=f" --container {shlex.quote(spec.container)}" if spec.container else "",
        inner=shlex.quote(spec.container_python) if spec.container_python else '"$PY"',
        container_note=_container_comment(spec.container_line),
    )
    directive_lines = "\n".join(f"{batch.directive_prefix} {d}" for d in directives)
    return _fill(batch.template, **values, directives=directive_lines, body=body.rstrip("\n"))


def job_spec(
    site: Site,
    request: Request = Request(),
    *,
    script: str,
    args: Sequence[str] = (),
    output: str,
    workdir: str,
    python: str,
    error: str | None = None,
) -> tuple[JobSpec, Layout]:
    """Check a request against the site (limits, layout) and resolve it into a JobSpec, with its layout.

    `request.cores_per_worker` is sbatch's `-c` (a task is a worker): the node's cores become c × workers
    per node. A jobqueue site's job is its driver (see `driver_job_spec`).
    """
    command = {"script": script, "args": args, "output": output, "error": error, "workdir": workdir,
               "python": python}
    if site.launcher == "jobqueue":
        from hpc_garage.core.pools import refuse_request

        refuse_request(site, {k: v for k, v in request.asked().items() if k in Request.SHAPE})
        return driver_job_spec(site, request, **command)
    if request.cores_per_worker is not None:
        if request.cores_per_node is not None:
            raise UserError("give either --cores-per-node or -c/--cpus-per-task (cores per worker), not both")
        request = replace(request, cores_per_node=_cores_for(site, request))
    allocation = Allocation.from_request(site, request)
    if site.node.gpus and not allocation.nodes[0].gpus:  # the job would refuse itself: a GPU site without GPUs
        raise UserError(f"--gpus-per-node 0: site {site.name}'s nodes have {site.node.gpus} GPUs, and inside the "
                        "job a GPU site without GPUs is an error; ask for GPUs, or use a CPU site")
    layout_ = layout(site, allocation)
    first = [w for w in layout_.workers if w.node == 0]
    site_gpu_type = site.node.gpu_type
    if request.gpu_type and site_gpu_type and request.gpu_type != site_gpu_type:
        raise UserError(f"GPU type {request.gpu_type!r}: site {site.name} has {site_gpu_type!r} GPUs; drop the type "
                        "or use another site")
    spec = _spec(  # checked now, before anything is created or submitted
        site, request,
        nodes=len(allocation.nodes),
        tasks_per_node=len(first),
        cpus_per_task=int(first[0].resources["CPU"]),
        gpus_per_node=len(allocation.nodes[0].gpus),
        gpu_type=request.gpu_type or site_gpu_type,
        memory=allocation.nodes[0].memory,
        walltime=allocation.walltime,
        directives=(*site.directives, *request.extra_directives),
        ranks=shlex.join(dask_mpi_ranks(layout_, [python, "-m", "hpc_garage.launchers.dask_mpi", "RUN_DIR/ranks.json"],
                                        in_slurm=site.scheduler == "slurm",
                                        nodefile="$PBS_NODEFILE" if site.scheduler == "pbs" else None))
        if site.mpi.launch == "dask-mpi" else "",
        **command,
    )
    return spec, layout_


def dask_mpi_ranks(layout_: Layout, rank_argv: Sequence[str], *, in_slurm: bool, nodefile: str | None) -> list[str]:
    """`mpi: {launch: dask-mpi}`: the command that starts one MPI rank per worker, the same count on every
    node in node order (srun, or the site's mpiexec in its OpenMPI or MPICH spelling), each running
    `rank_argv`. Pure: `run` starts it (launchers/dask_mpi.py) and the job script shows it.

    A node with fewer workers than the busiest one still gets that many ranks; the spare ones only join
    dask-mpi's barrier and exit (srun and mpiexec place the same count per node).
    """
    mpi = layout_.site.mpi
    nodes = len(layout_.allocation.nodes)
    counts = [0] * nodes
    cores = None
    for w in layout_.workers:
        counts[w.node] += 1
        cpu = int(w.resources.get("CPU", w.nthreads))
        cores = cpu if cores is None else min(cores, cpu)
    per_node = max(1, *counts)
    ranks = str(nodes * per_node)
    via = mpi.via if mpi.via != "auto" else ("srun" if in_slurm else "mpiexec")
    if via == "srun":
        return ["srun", f"--nodes={nodes}", f"--ntasks={ranks}", f"--ntasks-per-node={per_node}",
                f"--cpus-per-task={max(1, cores or 1)}", "--kill-on-bad-exit=1", *mpi.srun_args, *rank_argv]
    if mpi.flavor == "openmpi":
        argv = [mpi.mpiexec, "-n", ranks, "--map-by", f"ppr:{per_node}:node", "--bind-to", "none"]
        argv += ["--hostfile", nodefile] if nodefile else []
    else:  # MPICH / Hydra, Cray PALS, Intel MPI
        argv = [mpi.mpiexec, "-n", ranks, "-ppn", str(per_node)]
        argv += ["-f", nodefile] if nodefile else []
    return [*argv, *mpi.mpiexec_args, *rank_argv]


def _inert_comment(line: str, says: str) -> str:
    """A line `run` will execute, shown in the job script as a comment (the caller has refused control
    characters in it, so it stays one inert line); nothing where there is no such line."""
    return f"# {says}:\n#   {line}" if line else ""


def _ranks_comment(line: str) -> str:
    """The dask-mpi launch line, with $PBS_NODEFILE as a script would write it."""
    if CONTROL.search(line):
        raise UserError(f"the site's mpi options make the rank launch line {line!r} hold a newline or control "
                        "character; fix mpi.srun_args / mpiexec_args")
    return _inert_comment(line.replace("'$PBS_NODEFILE'", '"$PBS_NODEFILE"'),
                          "`run` starts one dask-mpi rank per worker (RUN_DIR: the run directory of this job)")


def _container_comment(line: str) -> str:
    """The line `run` enters the site's image with."""
    if CONTROL.search(line):
        raise UserError(f"the site's container settings make the runtime line {line!r} hold a newline or control "
                        "character; fix container.image / binds / env")
    return _inert_comment(line, "`run` re-executes itself inside the site's image (the scheduler needs the "
                                "image's modules), then runs COMMAND there")


def driver_job_spec(site: Site, request: Request, *, script: str, args: Sequence[str], output: str,
                    error: str | None, workdir: str, python: str) -> tuple[JobSpec, Layout]:
    """The driver job of a jobqueue site: one small task that runs `hpc-garage run` (the scheduler and the
    script), which submits the worker jobs. Its layout is the first pool's worker job, for the notes."""
    from hpc_garage.core.pools import job_shapes

    jq = site.jobqueue
    driver = Request(nodes=1, gpus_per_node=0, cores_per_node=jq.driver_cores, memory=jq.driver_memory,
                     walltime=request.walltime)
    allocation = Allocation.from_request(site, driver)
    spec = _spec(
        site, request,
        nodes=1,
        tasks_per_node=1,
        cpus_per_task=jq.driver_cores,
        gpus_per_node=0,
        gpu_type=None,
        memory=jq.driver_memory,
        walltime=allocation.walltime,
        directives=(*jq.driver_directives, *request.extra_directives),
        script=script, args=args, output=output, error=error, workdir=workdir, python=python,
    )
    return spec, next(iter(job_shapes(site).values())).layout


def _spec(
    site: Site,
    request: Request,
    *,
    nodes: int,
    tasks_per_node: int,
    cpus_per_task: int,
    gpus_per_node: int,
    gpu_type: str | None,
    memory: int,
    walltime: int | None,
    directives: tuple[str, ...],
    script: str,
    args: Sequence[str],
    output: str,
    error: str | None,
    workdir: str,
    python: str,
    ranks: str = "",
) -> JobSpec:
    """The checked JobSpec of a job of `site` with this shape (the mpi job's or the jobqueue driver's): what
    both share (job name, the site's defaults, directives, setup, the command) is resolved here, once, and
    every value is checked by rendering it before anything is created or submitted."""
    spec = JobSpec(
        scheduler=site.scheduler,
        site=str(site.path.resolve()) if site.path else site.name,
        site_name=site.name,
        job_name=job_name_for(request.job_name, script),
        nodes=nodes,
        tasks_per_node=tasks_per_node,
        cpus_per_task=cpus_per_task,
        gpus_per_node=gpus_per_node,
        gpu_type=gpu_type,
        memory=memory,
        walltime=walltime or site.walltime,
        warning_signal=site.warning_signal,
        requeue=site.requeue == "auto",
        queue=request.queue or site.queue,
        account=request.account or site.account,
        qos=request.qos or site.qos,
        output=output,
        error=error,
        directives=directives,
        setup=tuple(site.setup),
        workdir=workdir,
        python=python,
        script=script,
        args=tuple(args),
        ranks=ranks,
        **_container_fields(site, request, workdir),
    )
    render(spec)
    return spec


def _container_fields(site: Site, request: Request, workdir: str) -> dict[str, str]:
    """The job's container, as `run` will enter it (the runtime this machine has, where the site says auto)."""
    if site.container is None:
        return {}
    from hpc_garage.schedulers.container import entry_line

    return {"container": request.container or "", "container_python": site.container.python,
            "container_line": entry_line(site, workdir)}


def _cores_for(site: Site, request: Request) -> int:
    per_worker = int(request.cores_per_worker or 0)
    if per_worker < 1:
        raise UserError(f"-c {per_worker}: ask for at least 1 core per worker")
    probe = layout(site, Allocation.from_request(site, replace(request, cores_per_node=None)))  # workers per node do not depend on cores
    per_node = sum(1 for w in probe.workers if w.node == 0)
    if per_worker * per_node > site.node.cores:
        raise UserError(
            f"-c {per_worker}: site {site.name} puts {per_node} workers on a node, {per_node} × {per_worker} = "
            f"{per_worker * per_node} cores, but a node has {site.node.cores}; ask for at most -c {site.node.cores // per_node}"
        )
    return per_worker * per_node


# --------------------------------------------------------------------------------------------- checking


def job_name_for(name: str | None, script: str) -> str:
    """The user's name if it is plain; else the script's stem made plain (an explicit bad name is refused)."""
    if name is not None:
        if not _JOB_NAME.fullmatch(name):
            raise UserError(
                f"job name {name!r}: use 1 to 64 letters, digits and . _ + - (starting with a letter or digit)"
            )
        return name
    stem = re.sub(r"[^A-Za-z0-9._+-]", "_", script.rsplit("/", 1)[-1].removesuffix(".py")).lstrip("._+-")
    return stem[:64] or "hpc-garage"


def _no_nul(text: str, what: str) -> str:
    if "\0" in text:
        raise UserError(f"{what} {text!r} holds a NUL byte, which no command line can carry")
    return text


@cache
def _template(name: str) -> string.Template:
    path = packaged_dir("jobscripts") / name
    try:
        return string.Template(path.read_text())
    except OSError as exc:
        raise UserError(f"job-script template {path} cannot be read ({exc.strerror}); reinstall hpc-garage") from None


def _fill(name: str, **values: str) -> str:
    """Substitute; a placeholder alone on its line with an empty value takes the line with it."""
    text = _template(name).template
    for key, value in values.items():
        if value == "":
            text = text.replace(f"${{{key}}}\n", "")
    return string.Template(text).substitute(values)
