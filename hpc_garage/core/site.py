"""Site configs: what one partition's nodes have and how hpc-garage lays workers out on them.

A site is a YAML file validated by pydantic. Every mistake becomes one line that names the file, the key,
the bad value and the fix, because a site file is usually written once, by hand, from the README.
Finding and reading the files lives in `sitefiles`, and `siteview` loads plain sites for `show` without
pydantic; both keep to these models (tests/test_siteview.py).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from hpc_garage.core import site_values as _values
from hpc_garage.core.errors import SiteError
from hpc_garage.core.site_values import NAME_PATTERN

Bytes = Annotated[int, BeforeValidator(_values.memory), Field(ge=0)]
Seconds = Annotated[int, BeforeValidator(_values.walltime), Field(gt=0)]
SecondsOrZero = Annotated[int, BeforeValidator(_values.walltime_or_zero), Field(ge=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NodeShape(_Strict):
    """What one node of the partition has. `auto` (cores, memory) means this machine: for `local` sites."""

    cores: Annotated[int, BeforeValidator(_values.cores), Field(gt=0)]
    memory: Annotated[int, BeforeValidator(_values.node_memory), Field(gt=0)]
    gpus: int = Field(0, ge=0)
    gpu_type: str | None = None
    gpu_vendor: Literal["nvidia", "amd"] = "nvidia"


class WorkerLayout(_Strict):
    """How a node's cores, memory and GPUs are cut into Dask worker processes."""

    per: Literal["gpu", "node", "process"] = "node"
    processes: int = Field(1, gt=0)  # workers per node, for per: process
    threads: int | None = Field(None, gt=0)  # Dask threads per worker; default: its CPU share
    reserve_memory: Bytes = 0  # per node, left to the OS, the scheduler and the batch system


class Limits(_Strict):
    """What the centre allows; checked before anything is submitted."""

    max_nodes: int | None = Field(None, gt=0)
    max_walltime: Seconds | None = None
    max_gpus_per_node: int | None = Field(None, ge=0)


class MpiSettings(_Strict):
    """How the mpi launcher starts its node processes (one per node) inside an allocation.

    `srun` is the SLURM way; `mpiexec` runs over the job's node list (PBS, or SLURM without PMI support).
    `flavor` says whose mpiexec it is, because OpenMPI and MPICH/Hydra spell "ranks per node" differently.
    The node processes use no MPI themselves, so srun needs no `--mpi` plugin (`srun_args` adds options).
    """

    launch: Literal["auto", "srun", "mpiexec"] = "auto"
    srun_args: list[str] = Field(default_factory=list)
    mpiexec: str = "mpiexec"
    flavor: Literal["openmpi", "mpich"] = "openmpi"
    mpiexec_args: list[str] = Field(default_factory=list)


class JobqueueSettings(_Strict):
    """How the jobqueue launcher shapes and scales worker jobs: one job is one node, or one GPU slice of one.

    Scaling is fixed (`jobs`) or adaptive (`minimum_jobs`..`maximum_jobs`); nothing given means one fixed job.
    `max_jobs_in_queue` caps queued + running worker jobs whatever the demand: centres that allow a handful
    ban accounts that submit hundreds.
    """

    jobs: int | None = Field(None, ge=0)  # fixed number of worker jobs
    minimum_jobs: int | None = Field(None, ge=0)  # adaptive: never fewer ...
    maximum_jobs: int | None = Field(None, gt=0)  # ... and never more
    max_jobs_in_queue: int = Field(4, gt=0)  # queued + running worker jobs of a run (of a pool, per pool)
    gpus_per_job: int | None = Field(None, ge=0)  # default: every GPU of the node
    cores_per_job: int | None = Field(None, gt=0)  # default: the GPUs' share of the node, or all of it
    memory_per_job: Bytes | None = None  # default: the GPUs' share of the node, or all of it
    idle_timeout: Seconds = 60  # adaptive: a worker job idle this long is cancelled
    lifetime_margin: Seconds | None = None  # workers retire this long before the walltime (default 5%, >= 60 s)
    lifetime_stagger: SecondsOrZero | None = None  # spread of the retirements (default 5% of the walltime)
    death_timeout: Seconds = 60  # a worker that cannot reach the scheduler this long exits, ending its job
    driver: Literal["job", "login"] = "job"  # where `submit` runs the driver (`hpc-garage run`)
    driver_cores: int = Field(1, gt=0)
    driver_memory: Bytes = 2 * 2**30
    driver_directives: list[str] = Field(default_factory=list)  # extra #SBATCH/#PBS lines of the driver job
    untagged: bool | None = None  # written per pool as `untagged:`: may tasks without resource tags run here?

    @model_validator(mode="after")
    def _scaling(self) -> JobqueueSettings:
        adaptive = self.minimum_jobs is not None or self.maximum_jobs is not None
        if self.jobs is not None and adaptive:
            raise ValueError("jobqueue: give either jobs (fixed) or minimum_jobs/maximum_jobs (adaptive), not both")
        if adaptive and self.minimum_jobs is not None and self.maximum_jobs is not None \
                and self.minimum_jobs > self.maximum_jobs:
            raise ValueError(f"jobqueue.minimum_jobs ({self.minimum_jobs}) exceeds maximum_jobs ({self.maximum_jobs})")
        for key in ("jobs", "minimum_jobs", "maximum_jobs"):
            value = getattr(self, key)
            if value is not None and value > self.max_jobs_in_queue:
                raise ValueError(f"jobqueue.{key} ({value}) exceeds max_jobs_in_queue ({self.max_jobs_in_queue}); "
                                 "lower it, or raise max_jobs_in_queue if the centre allows that many jobs")
        return self

    @property
    def adaptive(self) -> bool:
        return self.jobs is None and (self.minimum_jobs is not None or self.maximum_jobs is not None)

    @property
    def bounds(self) -> tuple[int, int]:
        """(fewest, most) worker jobs: equal for fixed scaling."""
        if not self.adaptive:
            jobs = 1 if self.jobs is None else self.jobs
            return jobs, jobs
        return self.minimum_jobs or 0, self.maximum_jobs or self.max_jobs_in_queue


class Pool(_Strict):
    """One pool of a heterogeneous jobqueue site: what differs from the site (mappings merge key by key)."""

    description: str = ""
    queue: str | None = None
    account: str | None = None
    qos: str | None = None
    walltime: Any = None
    node: dict[str, Any] | None = None
    workers: dict[str, Any] | None = None
    limits: dict[str, Any] | None = None
    directives: list[str] | None = None
    setup: list[str] | None = None
    env: dict[str, str] | None = None
    jobqueue: dict[str, Any] | None = None
    untagged: bool | None = None  # may tasks without resource tags run here (default: pools without GPUs)


class Site(_Strict):
    """One partition of one cluster, as hpc-garage sees it."""

    name: str = Field(pattern=NAME_PATTERN)
    description: str = ""
    scheduler: Literal["slurm", "pbs", "local"]
    launcher: Literal["mpi", "jobqueue"] = "mpi"
    queue: str | None = None
    account: str | None = None
    qos: str | None = None
    walltime: Seconds = 3600
    node: NodeShape
    workers: WorkerLayout = WorkerLayout()
    limits: Limits = Limits()
    interface: str | None = None
    local_directory: str | None = None
    run_directory: str = "~/.hpc-garage/runs"
    setup: list[str] = Field(default_factory=list)
    directives: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)  # exported to the rank launcher and every worker
    python: str | None = None  # interpreter inside jobs; default: the one that runs hpc-garage submit
    mpi: MpiSettings = MpiSettings()
    jobqueue: JobqueueSettings = JobqueueSettings()  # launcher: jobqueue only
    pools: dict[Annotated[str, Field(pattern=NAME_PATTERN)], Pool] = Field(default_factory=dict)
    path: Path | None = Field(None, exclude=True)  # where the file was found; not a YAML key
    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)  # the keys as written: pools merge onto these
    _pool_sites: dict[str, Site] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> Site:
        if self.workers.per == "gpu" and self.node.gpus == 0:
            raise ValueError("workers.per is 'gpu' but node.gpus is 0; set node.gpus or use per: node")
        if self.workers.reserve_memory >= self.node.memory:
            raise ValueError("workers.reserve_memory is not smaller than node.memory; lower it")
        if self.limits.max_gpus_per_node is not None and self.limits.max_gpus_per_node > self.node.gpus:
            raise ValueError(
                f"limits.max_gpus_per_node ({self.limits.max_gpus_per_node}) exceeds node.gpus ({self.node.gpus})"
            )
        if self.limits.max_walltime is not None and self.walltime > self.limits.max_walltime:
            raise ValueError("walltime exceeds limits.max_walltime; shorten walltime")
        if self.pools and self.launcher != "jobqueue":
            raise ValueError("pools are for launcher: jobqueue; set launcher: jobqueue or remove pools")
        if self.launcher == "jobqueue":
            self._check_jobqueue()
        return self

    def _check_jobqueue(self) -> None:
        jq = self.jobqueue
        if self.scheduler == "local":
            raise ValueError("launcher: jobqueue submits worker jobs; use scheduler: slurm or pbs")
        if jq.gpus_per_job is not None and jq.gpus_per_job > self.node.gpus:
            raise ValueError(f"jobqueue.gpus_per_job ({jq.gpus_per_job}) exceeds node.gpus ({self.node.gpus})")
        if jq.gpus_per_job == 0 and self.workers.per == "gpu":
            raise ValueError("jobqueue.gpus_per_job is 0 but workers.per is 'gpu'; give jobs GPUs or use per: node")
        if jq.cores_per_job is not None and jq.cores_per_job > self.node.cores:
            raise ValueError(f"jobqueue.cores_per_job ({jq.cores_per_job}) exceeds node.cores ({self.node.cores})")
        if jq.memory_per_job is not None and jq.memory_per_job > self.node.memory:
            raise ValueError("jobqueue.memory_per_job exceeds node.memory; ask for less")
        margin, stagger = self.lifetime_margin, self.lifetime_stagger
        if margin + 2 * stagger >= self.walltime:
            raise ValueError(f"jobqueue.lifetime_margin + 2 × lifetime_stagger ({margin + 2 * stagger} s) leaves "
                             f"workers no time in a {self.walltime} s walltime; lower them or raise walltime")

    @property
    def lifetime_margin(self) -> int:
        """Seconds before the walltime by which every worker has retired (jobqueue)."""
        given = self.jobqueue.lifetime_margin
        return given if given is not None else max(60, self.walltime // 20)

    @property
    def lifetime_stagger(self) -> int:
        """Seconds by which worker lifetimes spread, so a job's workers do not all leave at once (jobqueue)."""
        given = self.jobqueue.lifetime_stagger
        return given if given is not None else self.walltime // 20

    @model_validator(mode="wrap")
    @classmethod
    def _pools_merged(cls, data: Any, handler: Any) -> Site:
        """Keep the keys as written and build one full Site per pool, so every error shows up at load time."""
        site = handler(data)
        if isinstance(data, dict):
            site._raw = {k: v for k, v in data.items() if k != "path"}
            site._pool_sites = {name: site._merged_pool(name, pool) for name, pool in site._raw_pools().items()}
            if site.launcher == "jobqueue" and not site.untagged_pools():
                raise ValueError("no pool takes tasks without resource tags (untagged: false everywhere); "
                                 "set untagged: true on one pool")
        return site

    def _raw_pools(self) -> dict[str, dict[str, Any]]:
        pools = self._raw.get("pools") or {}
        return {name: dict(pool or {}) for name, pool in pools.items()} if isinstance(pools, dict) else {}

    def _merged_pool(self, name: str, pool: dict[str, Any]) -> Site:
        merged = {k: v for k, v in self._raw.items() if k != "pools"}
        merged["name"] = f"{self.name}.{name}"
        for key, value in pool.items():
            if key == "untagged":
                merged["jobqueue"] = {**(merged.get("jobqueue") or {}), "untagged": value}
            elif key == "jobqueue" and isinstance(value, dict):
                inherited = dict(merged.get("jobqueue") or {})
                if SCALING_KEYS & value.keys():  # a pool's own scaling replaces the site's, as a whole
                    inherited = {k: v for k, v in inherited.items() if k not in SCALING_KEYS}
                merged["jobqueue"] = {**inherited, **value}
            elif isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **value}
            else:
                merged[key] = value
        try:
            site = Site.model_validate({**merged, "path": self.path})
        except ValidationError as exc:
            raise ValueError(f"pools.{name}: {describe_validation_error(exc, Site)}") from None
        return site

    def pool_sites(self) -> dict[str, Site]:
        """One full Site per pool of workers, so `layout()` works unchanged per pool.

        A site without `pools:` is its own single pool, named after the site.
        """
        return dict(self._pool_sites) if self._pool_sites else {self.name: self}

    def untagged_pools(self) -> set[str]:
        """The pools where tasks without resource tags may run.

        A pool says so with `untagged:`; by default pools without GPUs take them, and GPU pools only where
        the site has no other kind, so a plain task never takes a GPU worker's slot unless the site allows it.
        """
        sites = self.pool_sites()
        explicit = {name: s.jobqueue.untagged for name, s in sites.items()}
        gpu_free = {name for name, s in sites.items() if not _job_gpus(s)}
        default = gpu_free or set(sites)
        return {name for name in sites if explicit[name] or (explicit[name] is None and name in default)}

    @property
    def raw(self) -> dict[str, Any]:
        """The site's keys as written (YAML values, not parsed): what a worker job rebuilds the site from."""
        return dict(self._raw)

    @property
    def gpu_env_vars(self) -> tuple[str, ...]:
        """Variables that pin a process to its GPUs on this site's hardware."""
        return ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES") if self.node.gpu_vendor == "amd" else (
            "CUDA_VISIBLE_DEVICES",
        )


SCALING_KEYS = {"jobs", "minimum_jobs", "maximum_jobs"}


def _job_gpus(site: Site) -> int:
    gpus = site.jobqueue.gpus_per_job
    return site.node.gpus if gpus is None else gpus


# ------------------------------------------------------------------------------------------- validating


def parse_site_dict(data: dict[str, Any], origin: str = "<site>") -> Site:
    """Validate a site given as a mapping (tests, and sites built in code)."""
    try:
        return Site.model_validate(data)
    except ValidationError as exc:
        raise SiteError(f"{origin}: {describe_validation_error(exc, Site)}") from None


# --------------------------------------------------------------------------------------------- messages


def describe_validation_error(exc: ValidationError, model: type[BaseModel]) -> str:
    """pydantic's errors as one line: `node.gpus: -1 is not allowed: must be >= 0`; unknown keys get did-you-mean."""
    parts = []
    for err in exc.errors(include_url=False):
        loc = [str(x) for x in err["loc"] if x != "path"]
        key = ".".join(loc) or "(top level)"
        kind, value = err["type"], err.get("input")
        if kind == "extra_forbidden":
            known = _fields_at(model, loc[:-1])
            close = difflib.get_close_matches(loc[-1], known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys here: {', '.join(known)}"
            parts.append(f"unknown key {key!r}; {hint}")
        elif kind == "missing":
            parts.append(f"missing key {key!r}; add it")
        elif kind == "literal_error":
            allowed = err.get("ctx", {}).get("expected", "")
            parts.append(f"{key}: {value!r} is not allowed; use one of {allowed}")
        elif kind in _FIXES:
            parts.append(f"{key}: {value!r} {_FIXES[kind].format(**err.get('ctx', {}))}")
        else:
            message = err["msg"].removeprefix("Value error, ")
            # our own validators already quote the value; pydantic's messages do not
            shown = "" if kind == "value_error" or isinstance(value, dict) else f"{value!r}: "
            parts.append(f"{key}: {shown}{message}" if loc else message)
    return "; ".join(parts)


_FIXES = {
    "greater_than_equal": "is too small; use a number >= {ge}",
    "greater_than": "is too small; use a number > {gt}",
    "less_than_equal": "is too large; use a number <= {le}",
    "int_parsing": "is not a whole number; write e.g. 4",
    "int_type": "is not a whole number; write e.g. 4",
    "int_from_float": "is not a whole number; write e.g. 4",
    "string_type": "is not text; quote it",
    "list_type": "is not a list; write one item per line, each starting with '- '",
    "dict_type": "is not a mapping; write `key: value` lines indented under it",
    "model_type": "is not a mapping; write `key: value` lines indented under it",
    "model_attributes_type": "is not a mapping; write `key: value` lines indented under it",
    "string_pattern_mismatch": "has characters that are not allowed; use letters, digits, '.', '_' and '-'",
}


def _fields_at(model: type[BaseModel], loc: list[str]) -> list[str]:
    skip = False
    for name in loc:
        if skip:  # the key of a `dict[str, Model]` (a pool's name)
            skip = False
            continue
        field = model.model_fields.get(name)
        annotation = getattr(field, "annotation", None)
        args = getattr(annotation, "__args__", ())
        if getattr(annotation, "__origin__", None) is dict and args and isinstance(args[-1], type) \
                and issubclass(args[-1], BaseModel):
            annotation, skip = args[-1], True
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return [n for n in model.model_fields if n != "path"]
