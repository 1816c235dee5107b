"""SLURM: read a job's allocation from its environment; render its directives, submit, query, cancel."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_garage.core.allocation import Allocation, NodeAllocation
from hpc_garage.core.errors import AllocationError, UserError
from hpc_garage.schedulers.base import (WIND_DOWN_SIGNAL, BatchSystem, JobStatus, Preflight, WorkerJob, _int,
                                        fallback_memory, require, site_gpus, visible_gpus)
from hpc_garage.core.units import format_walltime, mib, parse_walltime
from hpc_garage.schedulers.hostlist import expand_counts, expand_hostlist

if TYPE_CHECKING:
    from hpc_garage.schedulers.jobscript import JobSpec
    from hpc_garage.core.site import Site

MIB = 2**20


class Slurm(BatchSystem):
    name = "slurm"
    job_id_variable = "SLURM_JOB_ID"
    launches_ranks = True  # srun
    signals_before_end = True  # --signal=B:SIG@seconds
    names_worker_logs = True  # --output=<log_dir>/%x-%j.out (worker_job_options)
    jobqueue_job = "dask_jobqueue.slurm:SLURMJob"
    jobqueue_cluster = "dask_jobqueue:SLURMCluster"

    def allocation_from_env(self, env: Mapping[str, str], site: Site) -> Allocation:
        job_id = require(env, "SLURM_JOB_ID", "this is not a SLURM job")
        job_id = self.job_id(env) or job_id  # checked: it names the run directory
        nodelist = env.get("SLURM_JOB_NODELIST") or require(env, "SLURM_NODELIST", "the job's nodes are unknown")
        hosts = expand_hostlist(nodelist)
        count_var = "SLURM_JOB_NUM_NODES" if env.get("SLURM_JOB_NUM_NODES") else "SLURM_NNODES"
        if env.get(count_var) and _int(env, count_var) != len(hosts):
            raise AllocationError(
                f"{count_var}={env[count_var]} but SLURM_JOB_NODELIST={nodelist} names {len(hosts)} nodes; "
                "the job's environment is inconsistent (was it copied from another job?)"
            )
        cores = _cores_per_node(env, len(hosts))
        # inside an srun task SLURM_JOB_GPUS is the batch node's list, copied; the task's own is SLURM_STEP_GPUS
        listed = "SLURM_STEP_GPUS" if env.get("SLURM_STEP_GPUS", "").strip() else "SLURM_JOB_GPUS"
        gpus, notes = visible_gpus(env, site.node.gpu_vendor, "SLURM_GPUS_ON_NODE", listed, expected=site_gpus(site))
        if len(hosts) > 1 and gpus:
            notes.append("GPU ids of nodes after the first are read by each worker on its own node")
        nodes = []
        for host, ncores in zip(hosts, cores):
            memory, note = _memory_per_node(env, ncores, len(gpus), site)
            nodes.append(NodeAllocation(host=host, cores=ncores, memory=memory, gpus=gpus))
        notes += [note] if note else []
        start, end = env.get("SLURM_JOB_START_TIME"), env.get("SLURM_JOB_END_TIME")
        walltime = int(end) - int(start) if start and end and start.isdigit() and end.isdigit() else None
        return Allocation(
            nodes=tuple(nodes),
            source=self.name,
            job_id=job_id,
            walltime=walltime,
            end_time=float(end) if end and end.isdigit() else None,
            notes=tuple(notes),
        )

    # ---- taking jobs: what SLURM spells differently (the mechanism is hpc_garage.schedulers.submission)

    template = "slurm.sh"
    directive_prefix = "#SBATCH"
    submit_command = "sbatch"

    def template_values(self, spec: JobSpec) -> dict[str, Any]:
        from hpc_garage.schedulers.directive_values import path_value, plain

        optional = []
        if spec.queue:
            optional.append(f"--partition={plain(spec.queue, 'partition')}")
        if spec.account:
            optional.append(f"--account={plain(spec.account, '--account')}")
        if spec.qos:
            optional.append(f"--qos={plain(spec.qos, '--qos')}")
        if spec.gpus_per_node:
            kind = f"gpu:{plain(spec.gpu_type, 'GPU type')}" if spec.gpu_type else "gpu"
            optional.append(f"--gres={kind}:{spec.gpus_per_node}")
        if spec.error:
            optional.append(f"--error={path_value(spec.error, '--error', quote=True)}")
        if spec.warning_signal:  # B: to the batch shell, which is `run` (exec): it winds the sweep down
            optional.append(f"--signal=B:{plain(spec.warning_signal, 'warning_signal')}")
        if spec.requeue:
            optional.append("--requeue")
        return {
            "job_name": spec.job_name,
            "nodes": str(spec.nodes),
            "tasks_per_node": str(spec.tasks_per_node),
            "cpus_per_task": str(spec.cpus_per_task),
            "memory": f"{max(1, mib(spec.memory))}M",
            "walltime": format_walltime(spec.walltime),
            "output": path_value(spec.output, "--output", quote=True),
            "directives": optional + list(spec.directives),
        }

    def default_output(self, run_root: Path, job_name: str) -> str:
        return str(run_root / "%j.out")

    def log_path(self, pattern: str, job_id: str, job_name: str) -> str:
        """sbatch's filename patterns that a batch job can use: %j %x %u %A %a %%."""
        import getpass

        def expand(m: re.Match[str]) -> str:
            key = m.group(1)
            width = int(key[:-1] or 0) if key != "%" else 0
            value = {"%": "%", "j": job_id, "A": job_id, "x": job_name, "u": getpass.getuser(), "a": "4294967294"}[key[-1]]
            return value.zfill(width) if value.isdigit() else value

        return _PATTERN.sub(expand, pattern)

    def submit_argv(self, script: Path, spec: JobSpec) -> list[str]:
        return ["sbatch", "--parsable", str(script)]

    def status(self, job_id: str) -> JobStatus | None:
        out = self.run_unless_gone(["scontrol", "show", "job", "-o", job_id], _GONE)
        fields = parse_scontrol_job(out.splitlines()[0]) if out and out.strip() else {}
        if "JobState" not in fields:
            return None
        state = fields["JobState"]
        phase = _phase(state)
        return JobStatus(
            job_id=job_id,
            state=state,
            phase=phase,
            exit_code=_exit_code(state, fields.get("ExitCode")) if phase == "finished" else None,
            reason=None if fields.get("Reason") in (None, "None") else fields["Reason"],
            name=fields.get("JobName"),
            nodes=fields.get("NodeList") or None,
        )

    def statuses(self, job_ids: Sequence[str]) -> dict[str, JobStatus]:
        """One squeue for all; exit codes (which squeue does not show) only for the finished, from scontrol."""
        if not job_ids:
            return {}
        argv = ["squeue", "-h", "-t", "all", "-j", ",".join(job_ids), "-o", "%i|%T|%j|%r|%N"]
        out = self.run_unless_gone(argv, _GONE) or ""
        found: dict[str, JobStatus] = {}
        for line in out.splitlines():
            job_id, state, name, reason, nodes = (line.split("|") + [""] * 5)[:5]
            if job_id not in job_ids:
                continue
            if _phase(state) == "finished":
                if (full := self.status(job_id)) is not None:
                    found[job_id] = full
                continue
            found[job_id] = JobStatus(
                job_id=job_id, state=state, phase=_phase(state), reason=None if reason == "None" else reason,
                name=name, nodes=nodes or None,
            )
        return found

    def cancel_argv(self, job_id: str) -> list[str]:
        return ["scancel", job_id]

    def wind_down_argv(self, job_id: str) -> list[str] | None:
        return ["scancel", "--batch", f"--signal={WIND_DOWN_SIGNAL}", job_id]  # the batch shell only

    def jobs_named(self, name: str) -> list[str]:
        """The user's queued or running jobs of this name, oldest first."""
        import getpass

        out = self.run_unless_gone(["squeue", "-h", "-u", getpass.getuser(), "-n", name, "-o", "%i"], _GONE) or ""
        return sorted((line.strip() for line in out.splitlines() if line.strip()), key=lambda j: (len(j), j))

    def time_left(self, job_id: str) -> tuple[float, float] | None:
        """From squeue's %L (time left) and %l (limit): relative, so no clock or time zone is involved.
        (SLURM_JOB_END_TIME exists from Slurm 23.02; squeue answers on every version.)"""
        out = self.run_unless_gone(["squeue", "-h", "-j", job_id, "-o", "%L|%l"], _GONE) or ""
        left, _, limit = out.strip().partition("|")
        try:
            return 0.0 if set(left) <= set("0:-") else float(parse_walltime(left)), float(parse_walltime(limit))
        except (UserError, ValueError):
            return None  # UNLIMITED, NOT_SET, INVALID: no end to wind down for

    def follow_up_argv(self, script: Path, after_job_id: str | None, output: str) -> list[str]:
        after = [f"--dependency=afterany:{after_job_id}"] if after_job_id else []
        return ["sbatch", "--parsable", *after, str(script)]

    def restart_count(self, env: Mapping[str, str]) -> int:
        value = env.get("SLURM_RESTART_COUNT", "0")
        return int(value) if value.isdigit() else 0

    def worker_job_options(self, job: WorkerJob) -> dict[str, Any]:
        from hpc_garage.schedulers.directive_values import plain

        lines = [f"--output={job.log_dir}/%x-%j.out"]
        if job.gpus:
            kind = f"gpu:{plain(job.gpu_type, 'GPU type')}" if job.gpu_type else "gpu"
            lines.append(f"--gres={kind}:{job.gpus}")
        if job.qos:
            lines.append(f"--qos={plain(job.qos, 'qos')}")
        return {"queue": job.queue, "account": job.account, "job_cpu": job.cores,
                "job_mem": f"{max(1, mib(job.memory))}M", "job_extra_directives": lines + list(job.directives)}

    # ---- before the first job (`hpc-garage doctor`)

    commands = ("sbatch", "squeue", "scancel", "scontrol")
    queue_word = "partition"
    queues_command = "scontrol show partition"

    def queues(self) -> tuple[list[str], str | None]:
        return parse_partitions(self.run(["scontrol", "show", "partition", "-o"]))

    def rank_launch(self, site: Site, where: str) -> Preflight | None:
        """srun starts dask-mpi's ranks with the MPI plugin of `--mpi=` in `mpi.srun_args`, else the cluster's
        MpiDefault; with none, OpenMPI's ranks find no PMI and fail in MPI_Init, each with a page of text."""
        if site.mpi.launch != "dask-mpi" or site.mpi.via == "mpiexec":
            return None
        config = parse_config(self.run(["scontrol", "show", "config"]))
        offered = parse_mpi_types(self.run(["srun", "--mpi=list"]))
        return srun_mpi(site.mpi.srun_args, config.get("MpiDefault"), offered, where)


def srun_mpi(srun_args: Sequence[str], mpi_default: str | None, offered: Sequence[str], where: str) -> Preflight:
    """Whether srun gives dask-mpi's ranks a PMI: the plugin `srun_args` name, else MpiDefault (pure)."""
    given = _mpi_arg(srun_args)
    usable = [t for t in offered if t != "none"]
    best = next((t for t in ("pmix", "pmi2") if t in usable), usable[0] if usable else None)
    listed = f"`srun --mpi=list` offers {', '.join(offered) or 'nothing'}"
    if given is not None:
        if given == "none":
            return Preflight("mpi.srun_args sets --mpi=none: srun gives dask-mpi's ranks no PMI, so MPI cannot "
                             "initialise", f"use --mpi={best} in mpi.srun_args of {where} ({listed})" if best
                             else f"set mpi.via: mpiexec in {where} ({listed})")
        if offered and given not in offered:
            return Preflight(f"mpi.srun_args sets --mpi={given}, which this SLURM does not offer ({listed})",
                             f"use --mpi={best} in mpi.srun_args of {where}" if best
                             else f"set mpi.via: mpiexec in {where}")
        return Preflight(f"srun starts the ranks with --mpi={given} (mpi.srun_args)")
    if mpi_default and mpi_default.lower() not in ("none", "(null)"):
        return Preflight(f"srun starts the ranks with the cluster's MpiDefault={mpi_default}")
    said = f"'s MpiDefault is {mpi_default}" if mpi_default else " sets no MpiDefault"
    problem = (f"mpi.srun_args has no --mpi= and this SLURM{said}: srun starts dask-mpi's ranks without "
               "PMI, so MPI cannot initialise")
    if best is None:
        return Preflight(problem, f"set mpi.via: mpiexec in {where} ({listed})")
    return Preflight(problem, f"add `srun_args: [--mpi={best}]` under mpi: in {where} ({listed})")


def _mpi_arg(args: Sequence[str]) -> str | None:
    """The plugin `--mpi=X` (or `--mpi X`) names in srun's arguments; the last one wins, as in srun."""
    found = None
    for i, arg in enumerate(args):
        if arg.startswith("--mpi="):
            found = arg.split("=", 1)[1]
        elif arg == "--mpi" and i + 1 < len(args):
            found = args[i + 1]
    return found


def parse_partitions(text: str) -> tuple[list[str], str | None]:
    """`scontrol show partition -o`: the partition names, and the default one (Default=YES)."""
    names, default = [], None
    for line in text.splitlines():
        if m := re.search(r"(?:^|\s)PartitionName=(\S+)", line):
            names.append(m.group(1))
            if re.search(r"(?:^|\s)Default=YES\b", line):
                default = m.group(1)
    return names, default


def parse_config(text: str) -> dict[str, str]:
    """`scontrol show config`: `Key = value` lines as a dict."""
    return {m.group(1): m.group(2).strip() for line in text.splitlines()
            if (m := re.match(r"^(\w+)\s+= ?(.*)$", line))}


def parse_mpi_types(text: str) -> list[str]:
    """`srun --mpi=list`: the MPI plugin types (Slurm 23+ lists them tab-indented under a heading, older
    ones as `srun: X` lines; versioned pmix plugins follow on a line of their own)."""
    types: list[str] = []
    for line in text.splitlines():
        line = line.strip().removeprefix("srun:").strip()
        if not line:
            continue
        if "versions available:" in line:
            types += [t.strip() for t in line.split(":", 1)[1].replace(",", " ").split()]
        elif not line.endswith(("...", ":")) and " " not in line:
            types.append(line)
    return list(dict.fromkeys(types))


def _cores_per_node(env: Mapping[str, str], nhosts: int) -> list[int]:
    if spec := env.get("SLURM_JOB_CPUS_PER_NODE"):
        cores = expand_counts(spec, "SLURM_JOB_CPUS_PER_NODE")
        if len(cores) != nhosts:
            raise AllocationError(
                f"SLURM_JOB_CPUS_PER_NODE={spec} describes {len(cores)} nodes but the job has {nhosts}; "
                "the job's environment is inconsistent"
            )
        return cores
    if env.get("SLURM_CPUS_ON_NODE"):
        return [_int(env, "SLURM_CPUS_ON_NODE")] * nhosts
    raise AllocationError("neither SLURM_JOB_CPUS_PER_NODE nor SLURM_CPUS_ON_NODE is set; the job's cores are unknown")


def _memory_per_node(env: Mapping[str, str], cores: int, gpus: int, site: Site) -> tuple[int, str | None]:
    """Slurm exports exactly one of these (in MB), by how the job asked for memory."""
    if env.get("SLURM_MEM_PER_NODE"):
        return _int(env, "SLURM_MEM_PER_NODE") * MIB, None
    if env.get("SLURM_MEM_PER_CPU"):
        return _int(env, "SLURM_MEM_PER_CPU") * MIB * cores, None
    if env.get("SLURM_MEM_PER_GPU"):
        if not gpus:
            raise AllocationError("SLURM_MEM_PER_GPU is set but the job has no GPUs; the job's environment is inconsistent")
        return _int(env, "SLURM_MEM_PER_GPU") * MIB * gpus, None
    return fallback_memory(site.node.memory, site.name, "no SLURM_MEM_PER_NODE/_CPU/_GPU in the job's environment")


# ------------------------------------------------------------------------------- taking jobs: what differs

_FINISHED = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY",
    "REVOKED", "SPECIAL_EXIT",
}
_PENDING = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SUSPENDED", "STOPPED"}
_GONE = ("Invalid job id",)  # scontrol/squeue/scancel, once a job has aged out of the controller (MinJobAge)
_PATTERN = re.compile(r"%(%|\d*[jxuAa])")


def _phase(state: str) -> str:
    base = state.split()[0].rstrip("+") if state else ""
    return "finished" if base in _FINISHED else "pending" if base in _PENDING else "running"


def _exit_code(state: str, exit_code: str | None) -> int | None:
    """`ExitCode=3:0` is exit 3; `0:15` is signal 15 (128 + 15, as a shell says); a job that ended
    without success but with exit 0 (TIMEOUT, CANCELLED before start, NODE_FAIL) counts as 1."""
    if not exit_code or ":" not in exit_code:
        return None
    code, _, signal = exit_code.partition(":")
    if not (code.isdigit() and signal.isdigit()):
        return None
    value = int(code) or (128 + int(signal) if int(signal) else 0)
    return value if value or state == "COMPLETED" else 1


def parse_scontrol_job(text: str) -> dict[str, str]:
    """One `scontrol show job -o` line, for the keys whose values hold no spaces."""
    return dict(re.findall(r"(?:^|\s)(JobId|JobName|JobState|Reason|ExitCode|NodeList)=(\S*)", text))
