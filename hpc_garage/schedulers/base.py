"""What every batch system adapter shares: reading GPU ids, running its commands, failing in one line."""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from hpc_garage.core.errors import AllocationError, UserError
from hpc_garage.core.gpus import EMPTY_WORDS, PRIMARY, job_gpus, vendor_of
from hpc_garage.schedulers.job_env import JOB_ID, checked_job_id

if TYPE_CHECKING:
    from hpc_garage.core.allocation import Allocation
    from hpc_garage.schedulers.jobscript import JobSpec
    from hpc_garage.core.site import Site


WIND_DOWN_SIGNAL = "URG"  # `hpc-garage cancel` to `run` (cluster/wind_down.py): ignored by default by every
# other process, so where the batch system signals the job's whole session (PBS) only `run` acts on it


class BatchSystem:
    """One batch system: how to read a job's allocation, and (in subclasses) request, submit, query, cancel.

    As in Nextflow's AbstractGridExecutor, the mechanism (schedulers/submission/) owns a job's whole life and
    each system overrides a handful of small things. The rest of hpc-garage asks a system what it can do
    (the capabilities below), never its name: a new one is one subclass, one template and `register`.
    """

    name: ClassVar[str]
    job_id_variable: ClassVar[str] = ""  # SLURM_JOB_ID, PBS_JOBID

    # ---- what it can do: what the rest of the code asks instead of comparing names
    takes_jobs: ClassVar[bool] = True  # a queue to submit to (`local`: none; jobs run on this machine)
    launches_ranks: ClassVar[bool] = False  # its own launcher (srun) starts a job's ranks on its nodes
    signals_before_end: ClassVar[bool] = False  # sends the job a signal before its walltime (`warning_signal`)
    names_worker_logs: ClassVar[bool] = False  # a worker job's log is RunDir.worker_log (`%x-%j.out`), not its own name
    jobqueue_job: ClassVar[str] = ""  # dask-jobqueue's "module:Job" and "module:Cluster" for worker jobs, if any
    jobqueue_cluster: ClassVar[str] = ""

    def jobqueue_classes(self) -> tuple[str, str]:
        """dask-jobqueue's job and cluster classes ("module:Class") for `launcher: jobqueue`; refused in one
        line where this batch system has none (the launcher never guesses another system's)."""
        if not (self.jobqueue_job and self.jobqueue_cluster):
            raise self._no_worker_jobs()
        return self.jobqueue_job, self.jobqueue_cluster

    def _no_worker_jobs(self) -> UserError:
        return UserError(f"launcher jobqueue needs a batch system dask-jobqueue submits to (slurm, pbs), "
                         f"not {self.name}; use launcher: mpi")

    def job_id(self, env: Mapping[str, str]) -> str | None:
        """The id of the job this environment belongs to; one that could not be a job id (`../x`) is refused,
        since it names the job's run directory."""
        return checked_job_id(self.job_id_variable, env.get(self.job_id_variable) if self.job_id_variable else None)

    def allocation_from_env(self, env: Mapping[str, str], site: Site) -> Allocation:
        raise NotImplementedError

    def nodefile(self, env: Mapping[str, str]) -> str | None:
        """A file listing the job's hosts, for an `mpiexec --hostfile` (PBS), or None."""
        return None

    def worker_job_options(self, job: WorkerJob) -> dict[str, Any]:
        """dask-jobqueue's batch-specific keyword arguments for one worker job of this shape."""
        raise self._no_worker_jobs()

    def run(self, argv: Sequence[str], *, input: str | None = None, timeout: float = 60,
            env: Mapping[str, str] | None = None) -> str:
        """Run one of the batch system's commands; its failure becomes one line naming the command."""
        try:
            done = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=timeout,
                                  env=None if env is None else dict(env))
        except FileNotFoundError:
            raise UserError(f"{argv[0]}: command not found; is the {self.name} client installed and on PATH?") from None
        except subprocess.TimeoutExpired:
            raise UserError(f"`{shlex.join(argv)}` did not answer within {timeout:.0f} s; try again") from None
        if done.returncode != 0:
            said = " ".join((done.stderr or done.stdout).split()) or f"exit code {done.returncode}"
            raise UserError(f"{argv[0]} failed: {said}")
        return done.stdout

    # ---- taking jobs: each batch system says only what differs; the mechanism is hpc_garage.schedulers.submission

    template: ClassVar[str] = ""  # job-script template: a file in jobscripts/, or an absolute path (a plugin's)
    directive_prefix: ClassVar[str] = ""  # "#SBATCH", "#PBS"
    submit_command: ClassVar[str] = ""  # "sbatch", "qsub"

    def template_values(self, spec: JobSpec) -> dict[str, str]:
        """The template's placeholders, and `directives`: the optional options, each without the prefix."""
        raise UserError(f"the {self.name} batch system takes no jobs; run the script directly with `hpc-garage run`")

    def default_output(self, run_root: Path, job_name: str) -> str:
        """Where the job's stdout+stderr go unless the user says: a file whose directory exists at submit time."""
        raise NotImplementedError

    def follow_up_output(self, output: str, run_root: Path, job_name: str) -> str:
        """The output path of a job submitted again from a recorded one (`output`): the same where the batch
        system puts the job id in it (%j)."""
        return output

    def log_path(self, pattern: str, job_id: str, job_name: str) -> str:
        """The file a recorded output pattern names for this job (SLURM expands %j; PBS writes it as is)."""
        return pattern

    def submit_argv(self, script: Path, spec: JobSpec) -> list[str]:
        raise NotImplementedError

    def parse_job_id(self, output: str) -> str:
        return parse_job_id(output, self.submit_command)

    def status(self, job_id: str) -> JobStatus | None:
        """The job, or None once the batch system no longer knows it."""
        raise NotImplementedError

    def statuses(self, job_ids: Sequence[str]) -> dict[str, JobStatus]:
        """Several jobs; the ones the batch system no longer knows are missing from the answer."""
        return {job_id: s for job_id in job_ids if (s := self.status(job_id)) is not None}

    def jobs_named(self, name: str) -> list[str]:
        """The user's queued or running jobs of this name (a job whose submitter died before it noted the id)."""
        raise NotImplementedError

    def cancel_argv(self, job_id: str) -> list[str]:
        raise NotImplementedError

    def wind_down_argv(self, job_id: str) -> list[str] | None:
        """Send WIND_DOWN_SIGNAL to the job's batch shell (`run`: the job script execs it), so that `cancel`
        gives the running trials their checkpoint grace first; None where this batch system cannot."""
        return None

    # ---- the job's clock: `run` winds a sweep down before the batch system ends the job

    def time_left(self, job_id: str) -> tuple[float, float] | None:
        """(seconds left, time limit in seconds) of a running job, as the batch system sees it now; None
        where it has no limit or will not say."""
        return None

    def follow_up_argv(self, script: Path, after_job_id: str | None, output: str) -> list[str]:
        """Submit a saved `script` again, to start once job `after_job_id` has ended however it ended (None: now)."""
        raise NotImplementedError

    def restart_count(self, env: Mapping[str, str]) -> int:
        """How often the batch system has requeued and restarted this job (0: its first start)."""
        return 0

    def run_unless_gone(self, argv: Sequence[str], gone: Sequence[str]) -> str | None:
        """`run`, but None when the failure says the job is unknown (it left the queue, or never was)."""
        try:
            return self.run(argv)
        except UserError as exc:
            if any(phrase.lower() in str(exc).lower() for phrase in gone):
                return None
            raise

    # ---- before the first job (`hpc-garage doctor`): what a site needs of this batch system, asked here

    commands: ClassVar[tuple[str, ...]] = ()  # the client commands hpc-garage runs on the login node
    queue_word: ClassVar[str] = "queue"  # how this batch system calls a site's `queue` ("partition" on SLURM)
    queues_command: ClassVar[str] = ""  # the command `queues` reads, for messages

    def missing_commands(self) -> list[str]:
        """The client commands that are not on PATH here."""
        import shutil

        return [command for command in self.commands if shutil.which(command) is None]

    def queues(self) -> tuple[list[str], str | None]:
        """The queues this batch system has, and its default one where it says."""
        raise NotImplementedError

    def check_queue(self, queue: str | None, where: str) -> Preflight:
        """Whether the site's `queue` (None: the default one) exists; `where` names the site file for the fix."""
        names, default = self.queues()
        if queue is None:
            return Preflight(f"none named: jobs go to the default {self.queue_word}"
                             + (f" ({default})" if default else ""))
        if queue in names:
            return Preflight(f"{queue} exists")
        return Preflight(f"{queue} does not exist here (`{self.queues_command}` lists {', '.join(names) or 'none'})",
                         f"set queue to one of them in {where}")

    def rank_launch(self, site: Site, where: str) -> Preflight | None:
        """For `mpi: {launch: dask-mpi}` started by this batch system's own launcher: whether its ranks can
        initialise MPI, with the fix where they cannot; None where it does not apply."""
        return None


class Preflight(NamedTuple):
    """One finding of a check before the first job: what was found, and the fix (None: nothing to fix)."""

    found: str
    fix: str | None = None


def visible_gpus(env: Mapping[str, str], vendor: str, count_var: str | None = None, *also: str,
                 count: tuple[str, int] | None = None, fallback: tuple[str, tuple[str, ...]] | None = None,
                 expected: tuple[str, int] | None = None) -> tuple[tuple[str, ...], list[str]]:
    """The GPU ids this job's processes can use, as the vendor's runtime reads them (`core.gpus.job_gpus`:
    CUDA_VISIBLE_DEVICES; ROCR_VISIBLE_DEVICES, then HIP's stage; ZE_AFFINITY_MASK), checked, never guessed.

    The list is what the job sees (cgroup-relative ints, or UUIDs); the batch system's own variables only
    cross-check it: `count_var` (SLURM_GPUS_ON_NODE) or `count` (a name and a number, e.g. from qstat) give
    how many GPUs the node has, each of `also` (SLURM_STEP_GPUS, global ids) lists as many. `fallback` (a name
    and its ids, e.g. Torque's PBS_GPUFILE) is used only where no vendor variable lists GPUs. `expected` (what
    the site says, and how many) turns a job without GPUs on a GPU site into an error. Every contradiction is
    one line naming the variable and its value. Returns the ids and notes about what was assumed.
    """
    listed = job_gpus(vendor, env)
    notes = list(listed.notes)
    counted = count
    if count_var and env.get(count_var, "").strip():
        counted = (f"{count_var}={env[count_var]}", _int(env, count_var))
    others = [(var, [x for x in env[var].split(",") if x.strip()]) for var in also if env.get(var, "").strip()]
    ids, source = listed.ids, listed.named()
    if not listed.given and fallback is not None and fallback[1]:
        ids, source = fallback[1], fallback[0]
    if ids:
        if counted is not None and counted[1] != len(ids):
            raise AllocationError(f"{source} lists {len(ids)} GPUs but {counted[0]}; the job's GPU list "
                                  "contradicts its allocation; unset the one you changed by hand")
        for var, other in others:
            if len(other) != len(ids):
                raise AllocationError(f"{source} lists {len(ids)} GPUs but {var}={env[var]} lists {len(other)}; "
                                      "unset the one you changed by hand")
        return ids, notes
    granted = counted[0] if counted and counted[1] > 0 else next((f"{var}={env[var]}" for var, _ in others), None)
    primary = PRIMARY[vendor_of(vendor)]
    if granted:
        said = (f"{listed.named()} lists none" if listed.given else
                f"no {primary} lists them{_other_vendor(env, vendor)}")
        raise AllocationError(f"the job has GPUs ({granted}) but {said}; hpc-garage never guesses GPU ids: run "
                              f"inside the job's own environment, or fix {primary}")
    if expected is not None and expected[1] > 0:
        had = listed.named() if listed.given else f"no {primary}{_other_vendor(env, vendor)}"
        raise AllocationError(f"{expected[0]} but this job has no GPUs ({had}); request GPUs (--gpus-per-node, "
                              "--gres=gpu:N) or use a site without GPUs (node.gpus: 0)")
    return (), notes


def _other_vendor(env: Mapping[str, str], vendor: str) -> str:
    """A hint where another vendor's variable lists GPUs: the site may name the wrong vendor."""
    for other, variable in PRIMARY.items():
        if other != vendor_of(vendor) and env.get(variable, "").strip() not in EMPTY_WORDS:
            return f" ({variable}={env[variable]} is set: is the site's node.gpu_vendor {other}?)"
    return ""


def site_gpus(site: Site) -> tuple[str, int]:
    """How many GPUs the site says a job of it has on each node, in words for messages, and the number."""
    gpus_per_job = site.jobqueue.gpus_per_job if site.launcher == "jobqueue" else None
    if gpus_per_job is not None:
        return f"site {site.name} gives each worker job {gpus_per_job} GPUs (jobqueue.gpus_per_job)", gpus_per_job
    return f"site {site.name} says its nodes have {site.node.gpus} GPUs (node.gpus)", site.node.gpus


def _int(env: Mapping[str, str], var: str) -> int:
    value = env.get(var, "")
    try:
        return int(value.strip())
    except ValueError:
        raise AllocationError(f"{var}={value!r} is not a whole number; check the job's environment") from None


def require(env: Mapping[str, str], var: str, why: str) -> str:
    value = env.get(var, "").strip()
    if not value:
        raise AllocationError(f"{var} is not set, so {why}; run inside the job, or pass request flags")
    return value


@dataclass(frozen=True)
class WorkerJob:
    """What one jobqueue worker job asks its batch system for; values already checked as directive text."""

    pool: str
    cores: int
    memory: int  # bytes
    gpus: int
    gpu_type: str | None
    queue: str | None
    account: str | None
    qos: str | None
    log_dir: str
    directives: tuple[str, ...]  # the site's own, without the prefix


JOB_VARIABLE_PREFIXES = ("SLURM_", "PBS_", "SBATCH_")
KEPT_JOB_VARIABLES = ("SLURM_CONF",)  # where the cluster's configuration is: a submission needs it
NODE_VARIABLES = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL",
                  "ZE_AFFINITY_MASK", "SLURMD_NODENAME")


def submit_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment to submit a new job from: this one, without its own job's variables and GPUs.

    sbatch exports the submitting environment into the job; a driver that is itself a batch job would
    otherwise hand its job's values and its GPU list to the jobs it submits.
    """
    return {k: v for k, v in env.items()
            if not (k.startswith(JOB_VARIABLE_PREFIXES) and k not in KEPT_JOB_VARIABLES) and k not in NODE_VARIABLES}


# ------------------------------------------------------------------------------------- jobs: submit, query


@dataclass(frozen=True)
class JobStatus:
    """A job as its batch system reports it, in the batch system's own words plus one common phase."""

    job_id: str
    state: str  # the batch system's word: PENDING, RUNNING, COMPLETED, TIMEOUT, Q, R, C, F ...
    phase: str  # pending | running | finished
    exit_code: int | None = None  # once finished, when the batch system knows it
    reason: str | None = None  # why it waits, or how it ended
    name: str | None = None  # the job name, to tell a recycled job id from ours
    nodes: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_job_id(output: str, command: str) -> str:
    """The id a submit command printed on its last line (`12`, `12;cluster`, `12.server`)."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    job_id = lines[-1].split(";")[0] if lines else ""
    if not JOB_ID.fullmatch(job_id):
        said = " ".join(output.split()) or "nothing"
        raise UserError(f"{command} printed {said!r} instead of a job id; was the job submitted? check the queue")
    return job_id




def process_memory_limit() -> int | None:
    """The memory limit the batch system put on this job's processes (cgroup, else RLIMIT_AS), if any.

    Where a job's environment does not say how much memory it was granted, its enforced limit does; only
    where neither does is the site's node.memory assumed (and said).
    """
    import resource

    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:
            return int(text)
    limits = [resource.getrlimit(r)[0] for r in (resource.RLIMIT_AS, resource.RLIMIT_RSS)]  # Slurm sets RSS
    finite = [x for x in limits if x != resource.RLIM_INFINITY and x > 0]
    return min(finite) if finite else None


def fallback_memory(site_memory: int, site_name: str, why: str,
                    limit: Callable[[], int | None] | None = None) -> tuple[int, str]:
    """Memory per node when the job's variables do not say: its enforced limit, else the site's node."""
    enforced = (limit or process_memory_limit)()
    if enforced:
        return min(enforced, site_memory), f"{why}; using the job's enforced memory limit"
    return site_memory, f"{why}; assuming site {site_name}'s node.memory"
