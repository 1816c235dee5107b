"""hpc-garage: Prefect + Dask experiment sweeps on SLURM and PBS, with per-process resources.

The package import is kept light on purpose: the CLI's `--help`, `sites` and `show` must not pay for
prefect, distributed or dask_jobqueue. Heavy pieces live in submodules imported where they are needed.
"""

__version__ = "0.1.0"


def resources(gpu: float = 0, cpu: float = 0, memory: str | int | float = 0, process: float = 0) -> list[str]:
    """Prefect task tags that ask Dask for resources: `@task(tags=hpc_garage.resources(gpu=1))`."""
    from hpc_garage.prefect.tags import resource_tags

    return resource_tags(gpu=gpu, cpu=cpu, memory=memory, process=process)


def task_runner(**kwargs):  # noqa: ANN201 - returns a prefect-dask DaskTaskRunner
    """The Prefect task runner for this job's Dask cluster (see `hpc_garage.prefect.task_runner`)."""
    from hpc_garage.prefect.task_runner import task_runner as _task_runner

    return _task_runner(**kwargs)
