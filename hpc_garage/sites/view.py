"""A site loaded without pydantic, for `show` and `sites`: importing pydantic and building the site models
costs ~150 ms, more than the whole rest of `hpc-garage show` (issue 5: show within 3x `import click`).

`load(name)` checks the site file against plain tables of the same fields. It vouches only for values of
the plain kinds a hand-written file holds (ints, strings, lists of strings, the documented units) that pass
every check; for anything else (an error, a type pydantic would coerce, a jobqueue site, pools) it returns the
pydantic `Site` from `hpc_garage.site.parse_site_file`, so every error message, and every accepted value,
is pydantic's. tests/test_siteview.py holds the tables to the models: same fields, order and defaults, and
for generated files the view's values equal the model's whenever the view accepts.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_garage.core import site_values
from hpc_garage.sites import files as sitefiles

if TYPE_CHECKING:
    from hpc_garage.core.site import Site


class _Unsure(Exception):
    """A value the fast path does not vouch for: pydantic decides."""


Check = Callable[[Any], Any]
REQUIRED = object()


def _integer(minimum: int, optional: bool = False, before: Callable[[Any], Any] | None = None) -> Check:
    def check(value: Any) -> Any:
        if optional and value is None:
            return None
        if before is not None:
            try:
                value = before(value)
            except Exception:  # pydantic reports it
                raise _Unsure from None
        if type(value) is int and value >= minimum:
            return value
        raise _Unsure

    return check


def _text(optional: bool = False, pattern: str | None = None) -> Check:
    def check(value: Any) -> Any:
        if optional and value is None:
            return None
        if type(value) is str and (pattern is None or re.fullmatch(pattern, value)):
            return value
        raise _Unsure

    return check


def _choice(*allowed: str) -> Check:
    def check(value: Any) -> Any:
        if type(value) is str and value in allowed:
            return value
        raise _Unsure

    return check


def _texts(value: Any) -> list[str]:
    if type(value) is list and all(type(x) is str for x in value):
        return list(value)
    raise _Unsure


def _mapping(value: Any) -> dict[str, str]:
    if type(value) is dict and all(type(k) is str and type(v) is str for k, v in value.items()):
        return dict(value)
    raise _Unsure


# The fields of each model in hpc_garage.core.site, in its order: (name, default, check). Defaults are never checked,
# as in pydantic; a mutable default is copied per site.
NODE = [
    ("cores", REQUIRED, _integer(1, before=site_values.cores)),
    ("memory", REQUIRED, _integer(1, before=site_values.node_memory)),
    ("gpus", 0, _integer(0)),
    ("gpu_type", None, _text(optional=True)),
    ("gpu_vendor", "nvidia", _choice("nvidia", "amd")),
]
WORKERS = [
    ("per", "node", _choice("gpu", "node", "process")),
    ("processes", 1, _integer(1)),
    ("threads", None, _integer(1, optional=True)),
    ("reserve_memory", 0, _integer(0, before=site_values.memory)),
]
LIMITS = [
    ("max_nodes", None, _integer(1, optional=True)),
    ("max_walltime", None, _integer(1, optional=True, before=site_values.walltime)),
    ("max_gpus_per_node", None, _integer(0, optional=True)),
]
MPI = [
    ("launch", "auto", _choice("auto", "srun", "mpiexec")),
    ("srun_args", [], _texts),
    ("mpiexec", "mpiexec", _text()),
    ("flavor", "openmpi", _choice("openmpi", "mpich")),
    ("mpiexec_args", [], _texts),
]
# jobqueue settings matter only to jobqueue sites, which pydantic loads: others carry the defaults
JOBQUEUE_DEFAULTS: dict[str, Any] = {
    "jobs": None, "minimum_jobs": None, "maximum_jobs": None, "max_jobs_in_queue": 4, "gpus_per_job": None,
    "cores_per_job": None, "memory_per_job": None, "idle_timeout": 60, "lifetime_margin": None,
    "lifetime_stagger": None, "death_timeout": 60, "driver": "job", "driver_cores": 1, "driver_memory": 2 * 2**30,
    "driver_directives": [], "untagged": None,
}
SECTIONS: dict[str, list[tuple[str, Any, Check]]] = {"node": NODE, "workers": WORKERS, "limits": LIMITS, "mpi": MPI}
SITE = [
    ("name", REQUIRED, _text(pattern=site_values.NAME_PATTERN[1:-1])),
    ("description", "", _text()),
    ("scheduler", REQUIRED, _choice("slurm", "pbs", "local")),
    ("launcher", "mpi", _choice("mpi")),  # jobqueue: pydantic
    ("queue", None, _text(optional=True)),
    ("account", None, _text(optional=True)),
    ("qos", None, _text(optional=True)),
    ("walltime", 3600, _integer(1, before=site_values.walltime)),
    ("node", REQUIRED, None),
    ("workers", {}, None),
    ("limits", {}, None),
    ("interface", None, _text(optional=True)),
    ("local_directory", None, _text(optional=True)),
    ("run_directory", "~/.hpc-garage/runs", _text()),
    ("setup", [], _texts),
    ("directives", [], _texts),
    ("env", {}, _mapping),
    ("python", None, _text(optional=True)),
    ("mpi", {}, None),
    ("jobqueue", REQUIRED, None),  # never given here: a site with `jobqueue:` goes to pydantic
    ("pools", REQUIRED, None),  # likewise
]


class Section:
    """One nested model's values (node, workers, limits, mpi, jobqueue), as attributes."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    def model_dump(self, mode: str = "python") -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in self.__dict__.items()}


class SiteView:
    """A site the fast path vouched for: the same attributes and `model_dump` as the pydantic `Site`."""

    def __init__(self, values: dict[str, Any], raw: dict[str, Any], path: Path | None) -> None:
        self.__dict__.update(values)
        self.path, self._raw = path, raw

    def model_dump(self, mode: str = "python") -> dict[str, Any]:
        """What `Site.model_dump` gives (`path` excluded); every value is already a JSON type."""
        return {name: self._dump(getattr(self, name)) for name, _, _ in SITE}

    @staticmethod
    def _dump(value: Any) -> Any:
        if isinstance(value, Section):
            return value.model_dump()
        return dict(value) if isinstance(value, dict) else list(value) if isinstance(value, list) else value

    @property
    def raw(self) -> dict[str, Any]:
        return dict(self._raw)

    @property
    def gpu_env_vars(self) -> tuple[str, ...]:
        """Variables that pin a process to its GPUs on this site's hardware (as `Site.gpu_env_vars`)."""
        return ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES") if self.node.gpu_vendor == "amd" else (
            "CUDA_VISIBLE_DEVICES",
        )

    def full(self) -> Site:
        """The pydantic Site, for code that needs more than the view has (job environments, pools, scripts)."""
        from hpc_garage.core.site import Site

        return Site.model_validate({**self._raw, "path": self.path})


def load(name_or_path: str | Path) -> SiteView | Site:
    """The site NAME (or the file PATH): a SiteView when the fast path vouches for it, else pydantic's Site."""
    path = sitefiles.site_file(name_or_path)
    data = sitefiles.read_site_file(path)
    try:
        return view(data, path)
    except _Unsure:
        from hpc_garage.sites import parse_site_file

        return parse_site_file(path)


def full(site: SiteView | Site) -> Site:
    """The pydantic Site of either."""
    return site.full() if isinstance(site, SiteView) else site


def view(data: dict[str, Any], path: Path | None = None) -> SiteView:
    """The checked site, or _Unsure: for anything but plain values that pass every check of the models."""
    raw = {k: v for k, v in data.items() if k != "path"}
    values = _fields(SITE, raw, nested=True)
    node, workers, limits = values["node"], values["workers"], values["limits"]
    # Site._consistent's checks: a site failing one goes to pydantic, which words the error
    if workers.per == "gpu" and node.gpus == 0 or workers.reserve_memory >= node.memory:
        raise _Unsure
    if limits.max_gpus_per_node is not None and limits.max_gpus_per_node > node.gpus:
        raise _Unsure
    if limits.max_walltime is not None and values["walltime"] > limits.max_walltime:
        raise _Unsure
    return SiteView(values, raw, path)


def _fields(table: list[tuple[str, Any, Check | None]], data: Any, nested: bool = False) -> dict[str, Any]:
    if type(data) is not dict or not data.keys() <= {name for name, _, check in table if check or name in SECTIONS}:
        raise _Unsure  # not a mapping, or an unknown key (or jobqueue:, pools:)
    values: dict[str, Any] = {}
    for name, default, check in table:
        if nested and name == "jobqueue":
            values[name] = Section(dict(JOBQUEUE_DEFAULTS, driver_directives=[]))
        elif nested and name == "pools":
            values[name] = {}
        elif name in SECTIONS:
            values[name] = Section(_fields(SECTIONS[name], data.get(name, default)))
        elif name in data:
            values[name] = check(data[name])  # type: ignore[misc]
        elif default is REQUIRED:
            raise _Unsure
        else:
            values[name] = list(default) if isinstance(default, list) else dict(default) if isinstance(
                default, dict) else default
    return values
