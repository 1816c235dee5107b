"""Worker jobs of the jobqueue launcher: rendered and submitted through dask-jobqueue, not rewritten.

Per pool, a dask-jobqueue `SLURMCluster`/`PBSCluster` (so its own job classes, `job_script()`,
`sbatch`/`qsub`, `scancel`/`qdel`, and SpecCluster's `<job>-<k>` worker naming) renders and submits the
jobs. What dask-jobqueue leaves out is added around it:
- the job's command is `python -m hpc_garage.launchers.jobqueue.worker`, which reads the job's *real*
  allocation and starts one Nanny per WorkerSpec of the layout, each pinned to its own GPU (see that module);
- the job header gets the GPUs, the exact memory and its log file, spelled by the batch system's module in
  `hpc_garage.schedulers` (`worker_job_options`);
- sbatch/qsub run in a clean environment, out of the terminal's process group, and every job id they give is
  recorded (`Submissions`) even when whoever awaited the submission was cancelled; what is left at the end
  goes in one scancel/qdel (`cancel_jobs`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_garage.core.pools import JobShape, job_shapes
from hpc_garage.core.site import Site
from hpc_garage.core.units import format_walltime
from hpc_garage.rundir import RunRoot

WORKER_MODULE = "hpc_garage.launchers.jobqueue.worker"


def submit_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment `sbatch`/`qsub` run in: the driver's, without its own job's variables and GPUs."""
    from hpc_garage.schedulers.base import submit_env as scrubbed

    return scrubbed(os.environ if env is None else env)


def job_kwargs(shape: JobShape, *, plan_file: str, log_dir: str, job_name: str,
               python: str | None = None) -> dict[str, Any]:
    """dask-jobqueue's keyword arguments for one pool's worker jobs. Every value that reaches the job
    script is checked as the submit path checks it (dask-jobqueue writes its values unquoted)."""
    from hpc_garage.schedulers.jobscript import directive, plain

    site, jq = shape.site, shape.site.jobqueue
    from hpc_garage.schedulers.container import python_argv

    argv = [python] if python else python_argv(site)  # inside the site's image, where it has one
    common: dict[str, Any] = {
        "cores": shape.cores,
        "memory": shape.memory,
        "processes": shape.workers_per_job,
        "worker_threads": shape.layout.workers[0].nthreads,
        "worker_memory_limit": shape.layout.workers[0].memory_limit,
        "job_name": plain(job_name, "worker job name"),
        "walltime": format_walltime(shape.walltime),
        "python": shlex.join(argv),
        "worker_command": WORKER_MODULE,
        "worker_extra_args": ["--hpc-garage-worker-file", shlex.quote(plan_file)],
        "death_timeout": jq.death_timeout,
        "job_script_prologue": list(site.setup),
        "job_directives_skip": [],
        "shebang": "#!/usr/bin/env bash",
        "log_directory": None,  # dask-jobqueue would create it while rendering; the log directive is ours
        "interface": None,  # the worker reads the site's interface itself
        "local_directory": None,  # expanded inside the job, where $TMPDIR means something
    }
    from hpc_garage.schedulers import get
    from hpc_garage.schedulers.base import WorkerJob

    job = WorkerJob(
        pool=shape.pool, cores=shape.cores, memory=shape.memory, gpus=shape.gpus, gpu_type=site.node.gpu_type,
        queue=plain(site.queue, "queue") if site.queue else None,
        account=plain(site.account, "account") if site.account else None, qos=site.qos,
        log_dir=plain(log_dir, "the run directory (worker job logs go there)"),
        directives=tuple(directive(d, "a directive of the site") for d in site.directives),
    )
    return common | get(site.scheduler).worker_job_options(job)


def _classes(scheduler: str) -> tuple[type, type]:
    """dask-jobqueue's job and cluster classes for this batch system, with the few changes the launcher needs."""
    from hpc_garage.compat import attached_spec_cluster, hooked_job
    from hpc_garage.schedulers import get

    job_name, cluster_name = get(scheduler).jobqueue_classes()  # refused in one line where it has none
    previous = signal.getsignal(signal.SIGINT)
    base_job, base_cluster = _loaded(job_name), _loaded(cluster_name)
    if threading.current_thread() is threading.main_thread() and previous is not None:
        # dask_jobqueue.runner sets SIGINT to `sys.exit()` when imported (0.9.0): Ctrl-C would then skip
        # `run`'s teardown, leaving worker jobs in the queue. Put back whatever handled it before.
        signal.signal(signal.SIGINT, previous)

    class PoolJob(hooked_job(base_job)):  # type: ignore[misc]
        submissions: Submissions | None = None  # set by the launcher: every job id this run was given

        def __init__(self, *args: Any, worker_threads: int | None = None, worker_memory_limit: int | None = None,
                     **kwargs: Any) -> None:
            # the command line then shows each worker's threads and memory limit as the layout gives them
            self._layout = (worker_threads, worker_memory_limit)
            super().__init__(*args, **kwargs)

        @property
        def worker_process_threads(self) -> int:
            return self._layout[0] or super().worker_process_threads

        @property
        def worker_process_memory(self) -> str:
            from dask.utils import format_bytes

            limit = self._layout[1]
            return format_bytes(limit).replace(" ", "") if limit else super().worker_process_memory

        @staticmethod
        def call_options() -> dict[str, Any]:
            # a clean environment (see submit_env), and out of the terminal's process group: a Ctrl-C meant
            # for `run` must not kill the sbatch or scancel under way
            return {"env": submit_env(), "start_new_session": True}

        def submitted(self, submission: asyncio.Future[str], parse: Any) -> None:
            # its job id is recorded even if whoever awaits it is cancelled: a job submitted by an
            # interrupted start-up is still one to cancel
            if self.submissions is not None:
                self.submissions.track(submission, parse)

    class PoolCluster(attached_spec_cluster(base_cluster)):  # type: ignore[misc]
        """One pool's jobs, attached to `run`'s scheduler; the launcher (not SpecCluster) replaces ended jobs."""

        job_cls = PoolJob

    return PoolJob, PoolCluster


def _loaded(name: str) -> type:
    """The class a batch system names as "module:Class" (dask-jobqueue's, which schedulers/ never imports)."""
    import importlib

    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


class Submissions:
    """Every job id sbatch/qsub gave this run, and the submissions still under way."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.inflight: set[asyncio.Future[str]] = set()

    def track(self, submission: asyncio.Future[str], parse: Any) -> None:
        self.inflight.add(submission)

        def done(f: asyncio.Future[str]) -> None:
            self.inflight.discard(f)
            if not f.cancelled() and f.exception() is None:
                with contextlib.suppress(ValueError):
                    self.ids.append(str(parse(f.result())))

        submission.add_done_callback(done)

    async def settle(self, timeout: float = 60) -> None:
        """Wait for submissions under way, so their ids are known before cancelling."""
        if self.inflight:
            await asyncio.wait(list(self.inflight), timeout=timeout)


def cancel_jobs(scheduler: str, ids: list[str]) -> None:
    """One `scancel`/`qdel` for all of `ids`, in the clean environment sbatch/qsub had; best effort (what
    it cannot cancel ends at its walltime, or after `death_timeout` without a scheduler)."""
    from hpc_garage.schedulers import get

    if not ids:
        return
    batch = get(scheduler)
    argv = [*batch.cancel_argv(ids[0])[:-1], *ids]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(argv, capture_output=True, timeout=60, env=submit_env(), start_new_session=True)


def worker_job_name(pool: str, run_id: str) -> str:
    """The batch system's name for a pool's worker jobs: one name per pool and run, within 64 characters."""
    return f"hpcg-{pool}-{run_id}"[:64]


def worker_scripts(site: Site, *, run_root: Path | None = None) -> str:
    """The worker job script of every pool, as it will be submitted (run-specific values as placeholders)."""
    from distributed.security import Security

    rundir = (RunRoot(run_root) if run_root else RunRoot.of_site(site)).run_dir("RUN_ID")
    tls = rundir.credential_paths()
    security = Security(require_encryption=True, tls_ca_file=tls["tls_ca_file"],
                        tls_worker_cert=tls["tls_worker_cert"], tls_worker_key=tls["tls_worker_key"])
    parts = []
    for pool, shape in job_shapes(site).items():
        job_cls, _ = _classes(shape.site.scheduler)
        kwargs = job_kwargs(shape, plan_file=str(rundir.worker_file(pool)), log_dir=str(rundir.worker_logs),
                            job_name=worker_job_name(pool, "RUN_ID"))
        job = job_cls(scheduler="tls://SCHEDULER:PORT", name=f"{pool}-0", security=security,
                      protocol="tls://", **kwargs)
        fewest, most = shape.site.jobqueue.bounds
        scaling = f"{fewest}..{most} jobs, adaptive" if shape.site.jobqueue.adaptive else f"{fewest} job(s)"
        parts.append(f"# ---- worker job of pool {pool} ({scaling}; {shape.workers_per_job} workers per job) ----\n"
                     + job.job_script())
    return "\n".join(parts)


def worker_job_file(site: Site, pool: str, *, address: str, tls: dict[str, str] | None,
                    worker_env: dict[str, str], end_time: float | None = None) -> dict[str, Any]:
    """What a worker job of `pool` reads at start-up: the site as written, the scheduler, TLS, environment,
    and when the run ends (epoch seconds; its workers are gone before then)."""
    pool_site = site.pool_sites()[pool]
    return {"site": site.raw, "pool": pool, "address": address, "tls": tls,
            "env": {**worker_env, **pool_site.env}, "end_time": end_time}
