"""The request options, one row each: `submit`'s and `show`'s flags, `hpc-garage sbatch`'s spellings, the
`hpc-garage` work pool's job variables (the Prefect UI's run form) and the reference pages are all built from
this table. A new option is one row here (its help text written here alone) and, where it shapes the job, one
field of `Request` (core/request.py) and the code that uses it.

Standard library only: the CLI builds its click options from it at import, and the Prefect side builds its
pydantic fields from it when a worker starts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hpc_garage.core.units import parse_memory, parse_walltime

KINDS = ("count", "memory", "walltime", "text", "flag", "directives")  # how a value is read (`RequestOption.read`)


@dataclass(frozen=True)
class RequestOption:
    """One option a user asks a job for, on the command line or in a flow run's job variables."""

    name: str  # the job variable, as a deployment's job_variables spell it
    kind: str  # one of KINDS
    help: str  # the one help text: --help, the run form, the reference pages
    flags: tuple[str, ...] = ()  # submit's spellings, the long one first; none: a job variable only
    sbatch: tuple[str, ...] = ()  # `hpc-garage sbatch`'s spellings of the same option
    field: str | None = None  # the Request field it fills; None: not part of the request (the site, the sweep)
    title: str | None = None  # the run form's label, where the name's words read badly ("Gpus Per Node")
    minimum: int | None = None  # a count's least value (the run form refuses less)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"request option {self.name}: kind {self.kind!r} is not one of {', '.join(KINDS)}")

    @property
    def default(self) -> Any:
        """What not giving it means: a flag off, no directives; otherwise unset, i.e. the site's (help says)."""
        return {"flag": False, "directives": []}.get(self.kind)

    @property
    def flag(self) -> str | None:
        """The long flag, as messages name it."""
        return self.flags[0] if self.flags else None

    def read(self, value: Any) -> Any:
        """A value as a job variable carries it (JSON: a number may come as text) → what the request holds;
        None for an unset or empty value. ValueError, in words, for one that cannot be read."""
        if value is None or value == "":
            return None
        also = f" (submit's {self.flag})" if self.flag else ""
        if self.kind == "count":
            if isinstance(value, str) and value.strip().isdigit():
                return int(value)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"give a whole number{also}")
            return value
        if self.kind == "memory":
            return parse_memory(value) or None  # 0: the whole node, the site's default (as sbatch's --mem=0)
        if self.kind == "walltime":
            return parse_walltime(value)
        if self.kind == "flag":
            if not isinstance(value, bool):
                raise ValueError(f"give true or false{also}")
            return value
        if self.kind == "directives":
            if isinstance(value, str) or not isinstance(value, Sequence) \
                    or not all(isinstance(o, str) and o.strip() for o in value):
                raise ValueError("give a list of batch-system options as the job script's directives spell them, "
                                 'e.g. ["--constraint=a100"]')
            return tuple(o.strip() for o in value)
        if not isinstance(value, str):
            raise ValueError(f"give text{also}")
        return value


OPTIONS: tuple[RequestOption, ...] = (
    RequestOption("site", "text", "Site name or path to a site file (`hpc-garage sites` lists them).",
                  ("--site",), ("--site",)),
    RequestOption("nodes", "count", "Nodes (default 1).", ("--nodes", "-N"), ("-N", "--nodes"), "nodes",
                  minimum=1),
    RequestOption("gpus_per_node", "count", "GPUs per node (default: all of the node's).", ("--gpus-per-node",),
                  ("--gpus-per-node",), "gpus_per_node", "GPUs per node", minimum=0),
    RequestOption("cores_per_node", "count", "Cores per node (default: all).", ("--cores-per-node",), (),
                  "cores_per_node", minimum=1),
    RequestOption("mem", "memory", "Memory per node: 64GiB, 64GB, 64G, or MiB as a bare number; 0: the whole node, "
                  "as sbatch, and the default.", ("--mem",), ("--mem",), "memory", "Memory per node"),
    RequestOption("time", "walltime", "Walltime: 01:30:00, 1-00:00:00, 90 (minutes), 2h (default: the site's).",
                  ("--time", "-t"), ("-t", "--time"), "walltime", "Walltime"),
    RequestOption("account", "text", "Account to charge (default: the site's).", ("--account", "-A"),
                  ("-A", "--account"), "account"),
    RequestOption("qos", "text", "Quality of service (SLURM; default: the site's).", ("--qos",), ("-q", "--qos"),
                  "qos", "QOS"),
    RequestOption("job_name", "text", "Job name: letters, digits, . _ + - (default: the script's name; a flow run's "
                  "job is this name or prefect, then the flow run's short id).", ("--job-name", "-J"),
                  ("-J", "--job-name"), "job_name"),
    RequestOption("sweep", "text", "The sweep this job belongs to (default: named after the site, script and "
                  "arguments; a flow run's: after the flow and the deployment, each run a fresh epoch of it).",
                  ("--sweep",), ("--sweep",)),
    RequestOption("resume", "flag", "Continue the sweep's latest epoch: finished trials are read back, not run.",
                  ("--resume",), ("--resume",)),
    RequestOption("container", "text", "Run the job's Python inside this image (a path or a reference, as the "
                  "site's container runtime spells it; default: the site's container.image, if any).",
                  ("--container",), ("--container",), "container", "Container image"),
    RequestOption("scheduler_options", "directives", "Other batch-system options, as the job script's directives "
                  "spell them, e.g. --constraint=a100 (`hpc-garage sbatch` takes them as options).", (), (),
                  "extra_directives", "Scheduler options"),
)
BY_NAME = {option.name: option for option in OPTIONS}
SHAPE = ("site", "nodes", "gpus_per_node", "cores_per_node", "mem", "time")  # what `show` takes: a layout's inputs
SHOW = (*SHAPE, "container")  # `show`'s request flags: the layout's inputs, and the image `--script` shows
