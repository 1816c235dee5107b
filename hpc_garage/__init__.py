"""hpc-garage: Prefect + Dask experiment sweeps on SLURM and PBS, with per-process resources.

The public, stable API is what `__all__` names (docs/reference/api.md says the same, and a test holds the two
equal); every other module and name is internal and may change in any release.

The package import is kept light on purpose: the CLI's `--help`, `sites` and `show` must not pay for
prefect, distributed or dask_jobqueue. Heavy pieces live in submodules imported where they are needed, and
the public names defined elsewhere are loaded on first use (`__getattr__`).
"""

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import TYPE_CHECKING, Any

from hpc_garage._version import __version__  # noqa: F401 (hpc_garage.__version__)

if TYPE_CHECKING:  # what __getattr__ loads on first use, spelled out for type checkers and the API reference
    from hpc_garage.cluster.handoff import Handoff, handoff_from_env
    from hpc_garage.compat import CompatError
    from hpc_garage.core.errors import SiteError, UserError

__all__ = ["CompatError", "Handoff", "SiteError", "UserError", "handoff_from_env", "resources", "search",
           "task_runner"]

# public name -> the internal module that defines it (loaded on first use)
_LAZY = {"Handoff": "hpc_garage.cluster.handoff", "handoff_from_env": "hpc_garage.cluster.handoff",
         "UserError": "hpc_garage.core.errors", "SiteError": "hpc_garage.core.errors",
         "CompatError": "hpc_garage.compat"}
# modules the README once documented that moved -> (where they are now, the public spelling to use instead);
# they keep working with a DeprecationWarning for at least one minor release
MOVED = {"hpc_garage.handoff": ("hpc_garage.cluster.handoff", "hpc_garage.handoff_from_env()"),
         "hpc_garage.site": ("hpc_garage.core.site", "a site file (internal: no public replacement)")}


def resources(gpu: float = 0, cpu: float = 0, memory: str | int | float = 0, process: float = 0) -> list[str]:
    """Prefect task tags that ask Dask for resources: `@task(tags=hpc_garage.resources(gpu=1))`."""
    from hpc_garage.prefect.tags import resource_tags

    return resource_tags(gpu=gpu, cpu=cpu, memory=memory, process=process)


def task_runner(**kwargs):  # noqa: ANN201 - returns a prefect-dask DaskTaskRunner
    """The Prefect task runner for this job's Dask cluster: `@flow(task_runner=hpc_garage.task_runner())`.

    Under `hpc-garage run` it connects to the cluster `run` started ($HPC_GARAGE_SCHEDULER_FILE, with the job's
    TLS credentials); anywhere else it starts a local cluster shaped like one node of a site (`site=...`, else
    $HPC_GARAGE_SITE, else `local`). `pruner=` ("median", "percentile", "asha", "hyperband" or an Optuna pruner;
    `pip install 'hpc-garage[tune]'`) stops trials early from what they report (`hpc_garage.trial.report`),
    by `metric=` (required with a pruner) and `mode=` ("min", the default, or "max"). Other keyword arguments
    are prefect-dask's `DaskTaskRunner`'s. The flow
    and every worker use one Prefect API: the one Prefect's settings name, else hpc-garage's own server, started
    if need be (one that cannot start is a `UserError` naming why, at once).
    """
    from hpc_garage.prefect.task_runner import task_runner as _task_runner

    return _task_runner(**kwargs)


def search(task: Any, space: Any, trials: int, metric: str, mode: str = "min", sampler: Any = "tpe",
           budget: Any = None, **kwargs: Any) -> Any:
    """Run an Optuna study's trials on every worker that can run `task`, from inside a flow whose task runner is
    `hpc_garage.task_runner(...)`: `study = hpc_garage.search(train, space={"lr": ("log", 1e-5, 1e-1),
    "depth": ("int", 2, 8), "act": ["relu", "gelu"]}, trials=200, metric="loss", budget="20 GPUh")`.

    `space` maps each of the task's parameters to ("float"|"log"|"int"|"logint", low, high), a list of
    choices, or an optuna.distributions object. The task returns the metric (a number, or a dict holding it)
    and may report it (`trial.report`) for the task runner's pruner. `sampler` is "tpe" (TPE with the constant
    liar: parallel trials do not all sample one point), "random", "qmc" or any Optuna sampler. It stops at
    `trials` trials or `budget` ("20 GPUh", "90 GPUmin", "600 GPUs"; GPU-seconds of the trials), whichever
    comes first, after `max_failures=5` failed trials, or before a trial that could not reach its first report
    before the job's wind-down (the follow-up job continues). The study lives in the sweep's results
    (`search.journal`): a follow-up job or `hpc-garage resume` continues it. Also `fixed=` (the task's other
    arguments, the same for every trial), `seed=` (the sampler's) and `name=` (the study's, "search"). Returns an object with `.best` (number, params, value), `.study` (Optuna's),
    `.stopped` (why), `.results` (this job's trials). Needs `pip install 'hpc-garage[tune]'`.
    """
    from hpc_garage.tuning.search import search as _search

    return _search(task, space, trials, metric, mode, sampler, budget, **kwargs)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hpc_garage' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Moved(types.ModuleType):
    """A moved module under its old name: each attribute is the new module's, with a DeprecationWarning."""

    def __getattr__(self, name: str) -> Any:
        target, instead = MOVED[self.__name__]
        value = getattr(importlib.import_module(target), name)
        if not name.startswith("__"):
            warnings.warn(f"{self.__name__}.{name} is deprecated: it moved to {target}.{name}; use {instead}",
                          DeprecationWarning, stacklevel=2)
        return value


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old names in MOVED; last on sys.meta_path, so it is asked only about modules no file has."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _Moved(spec.name, f"moved to {MOVED[spec.name][0]}")

    def exec_module(self, module: types.ModuleType) -> None:
        pass


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedFinder())
