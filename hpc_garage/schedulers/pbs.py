"""PBS Pro / OpenPBS / Torque: read a job's allocation from its environment and `qstat -f`; submit, query, cancel."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_garage.core.allocation import Allocation, NodeAllocation
from hpc_garage.core.errors import AllocationError, UserError
from hpc_garage.schedulers.base import (WIND_DOWN_SIGNAL, BatchSystem, JobStatus, WorkerJob, _int, fallback_memory,
                                        require, site_gpus, visible_gpus)
from hpc_garage.core.units import format_walltime, parse_memory, parse_walltime

if TYPE_CHECKING:
    from hpc_garage.schedulers.jobscript import JobSpec
    from hpc_garage.core.site import Site


def _qstat_f(job_id: str) -> str:
    """`qstat -f JOBID`, or "" where it cannot be had (memory and walltime then come from the site)."""
    try:
        done = subprocess.run(["qstat", "-f", job_id], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout if done.returncode == 0 else ""


class Pbs(BatchSystem):
    name = "pbs"
    job_id_variable = "PBS_JOBID"
    jobqueue_job = "dask_jobqueue.pbs:PBSJob"
    jobqueue_cluster = "dask_jobqueue:PBSCluster"

    def allocation_from_env(
        self,
        env: Mapping[str, str],
        site: Site,
        *,
        read_text: Callable[[str], str] = lambda p: Path(p).read_text(),
        qstat_f: Callable[[str], str] = _qstat_f,
    ) -> Allocation:
        job_id = require(env, "PBS_JOBID", "this is not a PBS job")
        job_id = self.job_id(env) or job_id  # checked: it names the run directory
        nodefile = require(env, "PBS_NODEFILE", "the job's hosts are unknown")
        try:
            lines = [ln.strip() for ln in read_text(nodefile).splitlines() if ln.strip()]
        except OSError as exc:
            raise AllocationError(f"PBS_NODEFILE={nodefile}: cannot read it ({exc.strerror})") from None
        hosts = list(dict.fromkeys(lines))  # one line per rank; unique hosts in order
        if not hosts:
            raise AllocationError(f"PBS_NODEFILE={nodefile} is empty; the job's hosts are unknown")
        if env.get("PBS_NUM_NODES") and _int(env, "PBS_NUM_NODES") != len(hosts):
            raise AllocationError(
                f"PBS_NUM_NODES={env['PBS_NUM_NODES']} but PBS_NODEFILE lists {len(hosts)} hosts; inconsistent job"
            )
        info = parse_qstat_f(qstat_f(job_id))
        cores = _cores(env, info, len(hosts))
        gpufile = None
        if env.get("PBS_GPUFILE"):  # Torque: read only where no vendor variable lists the GPUs
            gpufile = (f"PBS_GPUFILE={env['PBS_GPUFILE']}", _gpus_from_gpufile(read_text(env["PBS_GPUFILE"]), hosts[0],
                                                                               env["PBS_GPUFILE"]))
        gpus, notes = visible_gpus(env, site.node.gpu_vendor, count=_gpus_per_node(info, len(hosts)), fallback=gpufile,
                                   expected=site_gpus(site))
        memory = _memory_per_node(info, len(hosts))
        if memory is None:
            memory, note = fallback_memory(site.node.memory, site.name, "no memory in qstat -f")
            notes.append(note)
        walltime = parse_walltime(info["Resource_List.walltime"]) if info.get("Resource_List.walltime") else None
        if len(hosts) > 1 and gpus:
            notes.append("GPU ids of nodes after the first are read by each worker on its own node")
        node_list = tuple(NodeAllocation(host=h, cores=cores, memory=memory, gpus=gpus) for h in hosts)
        return Allocation(nodes=node_list, source=self.name, job_id=job_id, walltime=walltime, notes=tuple(notes))


    # ---- taking jobs: what PBS spells differently (the mechanism is hpc_garage.schedulers.submission)

    template = "pbs.sh"
    directive_prefix = "#PBS"
    submit_command = "qsub"

    def template_values(self, spec: JobSpec) -> dict[str, Any]:
        from hpc_garage.schedulers.directive_values import path_value, plain

        if spec.qos:
            raise UserError(f"--qos {spec.qos}: PBS has no QOS; drop it, or add the site's equivalent to its directives")
        if spec.error:
            raise UserError("a separate --error file is not supported on PBS sites; stdout and stderr share the log")
        # One chunk per node. `mpiprocs` makes PBS_NODEFILE list each node once per worker, which is what
        # mpiexec reads; `mem` comes last because Slurm's #PBS emulation reads `mem=` to the end of the line.
        # PBS Pro has no standard GPU-model resource: a site that has one adds it to its directives.
        chunk = f"ncpus={spec.tasks_per_node * spec.cpus_per_task}:mpiprocs={spec.tasks_per_node}"
        chunk += f":ngpus={spec.gpus_per_node}" if spec.gpus_per_node else ""
        optional = []
        if spec.queue:
            optional.append(f"-q {plain(spec.queue, 'queue')}")
        if spec.account:
            optional.append(f"-A {plain(spec.account, '--account')}")
        if spec.nodes > 1:
            optional.append("-l place=scatter")
        if spec.requeue:
            optional.append("-r y")
        return {
            "job_name": spec.job_name,
            "select": f"{spec.nodes}:{chunk}:mem={pbs_memory(spec.memory)}",
            "walltime": format_walltime(spec.walltime),
            "output": path_value(spec.output, "the log path", quote=False),
            "directives": optional + list(spec.directives),
        }

    def default_output(self, run_root: Path, job_name: str) -> str:
        """PBS names no job id in an output path, so the log gets a unique name of its own."""
        import secrets
        import time

        return str(run_root / f"{job_name}.{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}.out")

    def follow_up_output(self, output: str, run_root: Path, job_name: str) -> str:
        """PBS logs carry no job id: a default one (in the run root) gets a new name, or the jobs would share it."""
        return self.default_output(run_root, job_name) if Path(output).parent == run_root else output

    def submit_argv(self, script: Path, spec: JobSpec) -> list[str]:
        # -j/-o repeat the script's own directives: Slurm's qsub wrapper overrides them otherwise
        # (it forces `-o <script>.o<id>`), and it passes its arguments through a shell, hence plain paths.
        return ["qsub", "-j", "oe", "-o", spec.output, str(script)]

    def status(self, job_id: str) -> JobStatus | None:
        out = self.run_unless_gone(["qstat", "-f", job_id], _GONE)
        if out is None:  # PBS Pro keeps finished jobs in its history, behind -x
            try:
                out = self.run(["qstat", "-fx", job_id])
            except UserError:
                return None
        jobs = parse_qstat_jobs(out)
        info = jobs.get(job_id) or next(iter(jobs.values()), None)
        if not info or "job_state" not in info:
            return None
        state = info["job_state"]
        phase = "finished" if state in "CFX" else "pending" if state in "QHWTM" else "running"
        return JobStatus(
            job_id=job_id,
            state=state,
            phase=phase,
            exit_code=_pbs_exit(info.get("Exit_status")) if phase == "finished" else None,
            reason=info.get("comment"),
            name=info.get("Job_Name"),
            nodes=info.get("exec_host"),
        )

    def cancel_argv(self, job_id: str) -> list[str]:
        return ["qdel", job_id]

    def wind_down_argv(self, job_id: str) -> list[str] | None:
        return ["qsig", "-s", f"SIG{WIND_DOWN_SIGNAL}", job_id]  # the job's session: only `run` heeds it

    def jobs_named(self, name: str) -> list[str]:
        """The user's queued or running jobs of this name, oldest first."""
        import getpass

        out = self.run_unless_gone(["qselect", "-u", getpass.getuser(), "-N", name], _GONE) or ""
        return [line.strip() for line in out.splitlines() if line.strip()]

    def time_left(self, job_id: str, qstat_f: Callable[[str], str] = _qstat_f) -> tuple[float, float] | None:
        """The walltime limit less the walltime used, from `qstat -f`."""
        info = parse_qstat_f(qstat_f(job_id))
        used = info.get("resources_used.walltime", "")
        try:
            limit = parse_walltime(info["Resource_List.walltime"])
            used_seconds = 0 if set(used) <= set("0:") else parse_walltime(used)
        except (KeyError, UserError, ValueError):
            return None
        return float(max(0, limit - used_seconds)), float(limit)

    def follow_up_argv(self, script: Path, after_job_id: str | None, output: str) -> list[str]:
        after = ["-W", f"depend=afterany:{after_job_id}"] if after_job_id else []
        return ["qsub", *after, "-j", "oe", "-o", output, str(script)]

    def nodefile(self, env: Mapping[str, str]) -> str | None:
        return env.get("PBS_NODEFILE") or None

    def worker_job_options(self, job: WorkerJob) -> dict[str, Any]:
        if job.qos:
            raise UserError(f"pool {job.pool}: PBS has no QOS; drop qos, or add the site's equivalent to directives")
        select = f"select=1:ncpus={job.cores}" + (f":ngpus={job.gpus}" if job.gpus else "")
        select += f":mem={pbs_memory(job.memory)}"  # last: Slurm's #PBS reader takes mem= to the line's end
        return {"queue": job.queue, "account": job.account, "resource_spec": select,
                "job_extra_directives": ["-j oe", f"-o {job.log_dir}/", *job.directives]}

    # ---- before the first job (`hpc-garage doctor`)

    commands = ("qsub", "qstat", "qdel")
    queues_command = "qstat -Q"

    def queues(self) -> tuple[list[str], str | None]:
        return parse_qstat_queues(self.run(["qstat", "-Q"])), None


def parse_qstat_queues(text: str) -> list[str]:
    """`qstat -Q`: the queue names, one a row under the header's dashed line (PBS Pro, Torque, Slurm's wrapper)."""
    lines = text.splitlines()
    start = next((i + 1 for i, line in enumerate(lines) if line.strip().startswith("---")), len(lines))
    return [line.split()[0] for line in lines[start:] if line.strip()]


def _cores(env: Mapping[str, str], info: Mapping[str, str], nhosts: int) -> int:
    for var in ("NCPUS", "PBS_NUM_PPN"):
        if env.get(var):
            return _int(env, var)
    if m := re.search(r"ncpus=(\d+)", info.get("Resource_List.select", "")):
        return int(m.group(1))
    if info.get("Resource_List.ncpus", "").isdigit():
        return int(info["Resource_List.ncpus"]) // nhosts
    raise AllocationError(
        "neither NCPUS (PBS Pro) nor PBS_NUM_PPN (Torque) is set and qstat -f shows no ncpus; "
        "the job's cores are unknown"
    )


def _gpus_from_gpufile(text: str, host: str, path: str = "PBS_GPUFILE") -> tuple[str, ...]:
    """Torque's PBS_GPUFILE: one `host-gpuN` line per GPU; a GPU listed twice is an error (two workers on it)."""
    ids: list[str] = []
    for line in text.split():
        name, _, gpu = line.rpartition("-gpu")
        if name == host and gpu.isdigit():
            if gpu in ids:
                raise AllocationError(f"PBS_GPUFILE={path} lists {host}-gpu{gpu} twice: two workers would share it; "
                                      "check the job's GPU file")
            ids.append(gpu)
    return tuple(ids)


def _gpus_per_node(info: Mapping[str, str], nhosts: int) -> tuple[str, int] | None:
    """The GPUs per node qstat -f says the job has (`ngpus` of a one-kind select, or the total over nodes)."""
    select = info.get("Resource_List.select", "")
    if "+" not in select and (m := re.search(r"ngpus=(\d+)", select)):
        return f"qstat -f Resource_List.select={select}", int(m.group(1))
    total = info.get("Resource_List.ngpus", "")
    if not select and total.isdigit() and int(total) % nhosts == 0:
        return f"qstat -f Resource_List.ngpus={total} over {nhosts} nodes", int(total) // nhosts
    return None


def parse_qstat_f(text: str) -> dict[str, str]:
    """`qstat -f` as a dict; continuation lines (tab-indented) are joined to their key."""
    info: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        if m := re.match(r"^\s+([\w.]+) = (.*)$", line):  # PBS Pro indents keys by 4 spaces, Torque by a tab
            key = m.group(1)
            info[key] = m.group(2).strip()
        elif key and line.startswith("\t"):
            info[key] += line.strip()
    return info


def _memory_per_node(info: Mapping[str, str], nhosts: int) -> int | None:
    """PBS Pro gives the job's total `Resource_List.mem`, and the chunk's `mem=` in `select`."""
    select = info.get("Resource_List.select", "")
    if m := re.search(r"mem=([\w.]+)", select):
        chunks = [int(c.split(":")[0]) if c.split(":")[0].isdigit() else 1 for c in select.split("+")]
        per_chunk = parse_memory(m.group(1))
        return per_chunk * sum(chunks) // nhosts
    if total := info.get("Resource_List.mem"):
        return parse_memory(total) // nhosts
    return None


# ------------------------------------------------------------------------------- taking jobs: what differs

# A job qstat no longer shows: PBS Pro/Torque say so; Slurm's wrapper just exits non-zero with no output.
_GONE = ("Unknown Job Id", "Job has finished", "exit code")


def parse_qstat_jobs(text: str) -> dict[str, dict[str, str]]:
    """`qstat -f` with any number of jobs: `Job Id: X` blocks of `key = value` lines (indented by four
    spaces in PBS Pro, a tab in Slurm's wrapper), continuation lines joined to their key."""
    jobs: dict[str, dict[str, str]] = {}
    info: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        if m := re.match(r"^Job Id:\s*(\S+)", line):
            info = jobs.setdefault(m.group(1), {})
            key = None
        elif m := re.match(r"^(?: {4}|\t)([\w.]+) = (.*)$", line):
            key = m.group(1)
            info[key] = m.group(2).strip()
        elif key and line.startswith("\t"):
            info[key] += line.strip()
    return jobs


def _pbs_exit(value: str | None) -> int | None:
    """PBS's Exit_status: the script's code; 256 + N when signal N killed it; < 0 when PBS itself failed it."""
    try:
        code = int(value) if value is not None else None
    except ValueError:
        return None
    if code is None:
        return None
    return 1 if code < 0 else 128 + code - 256 if code > 256 else code


def pbs_memory(size: int) -> str:
    """`mem=` as PBS writes it: whole gb where it divides, else mb (both binary, as in PBS)."""
    return f"{size // 2**30}gb" if size % 2**30 == 0 else f"{max(1, size // 2**20)}mb"
