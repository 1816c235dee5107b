"""The commands about a site and a cluster on it: `sites`, `show`, `run`, `doctor`."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from hpc_garage.cli import options
from hpc_garage.core.errors import UserError
from hpc_garage.core.request_options import SHOW
from hpc_garage.variables import SITE_ENV, SYSFS_ROOT_ENV

SHOW_JSON_INDENT_MAX = 1024  # workers above which `show --json` prints compact JSON


@options.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON list.")
def sites(as_json: bool) -> None:
    """List the sites hpc-garage can see, and where each was found."""
    from hpc_garage.sites import find_sites, load_site

    rows = []
    for name, path in find_sites().items():
        try:
            site = load_site(path)
        except UserError as exc:  # one broken file must not hide the others
            rows.append({"name": name, "path": str(path), "error": str(exc)})
            continue
        node = site.node
        rows.append(
            {
                "name": name,
                "scheduler": site.scheduler,
                "launcher": site.launcher,
                "queue": site.queue,
                "node": {"cores": node.cores, "memory": node.memory, "gpus": node.gpus, "gpu_type": node.gpu_type},
                "workers_per": site.workers.per,
                "path": str(path),
            }
        )
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    from hpc_garage.core.units import format_bytes

    for r in rows:
        if "error" in r:
            click.echo(f"{r['name']:<14} BROKEN: {r['error']}")
            continue
        n = r["node"]
        gpus = f", {n['gpus']} GPU" + (f" {n['gpu_type']}" if n["gpu_type"] else "") if n["gpus"] else ""
        shape = f"{n['cores']} cores, {format_bytes(n['memory'])}{gpus}"
        click.echo(f"{r['name']:<14} {r['scheduler']:<6} {r['launcher']:<9} {shape:<36} {r['path']}")


@options.command(context_settings={"allow_interspersed_args": False},
                 exclusive=(("as_json", "as_script", "worker_script"),))
@options.request_flags(SHOW)
@click.option("--json", "as_json", is_flag=True, help="Print exactly one JSON object.")
@click.option("--script", "as_script", is_flag=True, help="Print the job script `submit` would render instead.")
@click.option("--worker-script", is_flag=True, help="Jobqueue sites: print each pool's worker job script.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="[SCRIPT [ARGS]...]")
def show(site_name: str, as_json: bool, as_script: bool, worker_script: bool, command: tuple[str, ...],
         **request: Any) -> None:
    """Show the workers a site and allocation give, and the resource math behind them.

    Inside a job (SLURM or PBS variables set) and without request flags, the job's own allocation is used.
    With --script, print the job script `hpc-garage submit` would render for SCRIPT (a placeholder if none).
    Jobqueue sites show one worker job per pool; --worker-script prints the scripts of those jobs.
    """
    if worker_script:
        _show_worker_scripts(site_name)
        return
    if as_script or command:
        _show_script(site_name, as_script, command, request)
        return
    from hpc_garage.sites import view as siteview

    site = siteview.load(site_name)  # without pydantic when it can: see siteview
    if site.launcher == "jobqueue":
        from hpc_garage.core.pools import show_pools

        click.echo(show_pools(site, as_json=as_json, **options.request_of(request).asked()))
        return
    import os

    from hpc_garage.core.layout import describe, layout
    from hpc_garage.schedulers import allocation_for

    allocation = allocation_for(site, options.request_of(request))
    layout_ = layout(site, allocation)
    if allocation.source != "request" or os.environ.get(SYSFS_ROOT_ENV):
        # this job's own node (or a described one): its workers' cores, as they will be bound here
        from hpc_garage.launchers.topology import bound_layout

        layout_ = bound_layout(layout_, os.environ)
    if as_json:  # indented while a person might read it; compact and ~50x faster for thousands of workers
        stdout = click.get_text_stream("stdout")  # not echo: it would scan 8 MB for ANSI codes
        if layout_.worker_count > SHOW_JSON_INDENT_MAX:
            stdout.writelines(layout_.json_chunks())
        else:
            stdout.write(json.dumps(layout_.to_dict(), indent=2))
        stdout.write("\n")
        return
    click.echo("\n".join(describe(layout_)))


def _show_script(site_name: str, as_script: bool, command: tuple[str, ...], request: dict[str, Any]) -> None:
    if not as_script:
        raise UserError(f"show takes SCRIPT [ARGS] only with --script (got {' '.join(command)!r})")
    from hpc_garage.schedulers.submission import prepare

    script, *args = command or ("SCRIPT.py",)
    prepared = prepare(site_name, script, args, options.request_of(request), must_exist=bool(command))
    click.echo(prepared.script, nl=False)


def _show_worker_scripts(site_name: str) -> None:
    """`show --worker-script`: each pool's worker job script, as it will be submitted."""
    from hpc_garage.launchers.jobqueue.jobs import worker_scripts
    from hpc_garage.sites import load_site

    site = load_site(site_name)
    if site.launcher != "jobqueue":
        raise UserError(f"site {site.name} uses the {site.launcher} launcher, which submits no worker jobs; "
                        "--script shows its job script")
    click.echo(worker_scripts(site), nl=False)


@options.command(context_settings={"ignore_unknown_options": True})
@click.option("--site", "site_name", help=f"Site name or file (default: ${SITE_ENV}, else local).")
@click.option("--insecure", is_flag=True, help="Plain tcp instead of TLS with per-job certificates.")
@click.option("--timeout", default="180", show_default=True, callback=lambda ctx, param, value: options.seconds(value),
              help="Seconds to wait for every worker to register.")
@click.option("--sweep", help="The sweep this run belongs to (default: named after the site and COMMAND).")
@click.option("--resume", is_flag=True, help="Continue the sweep's latest epoch: finished trials are read back.")
@click.option("--sweep-epoch", type=click.IntRange(min=1), hidden=True)  # job scripts that `submit` writes
@click.option("--container", "container", metavar="IMAGE",
              help="Run inside this image (over the site's container.image; docs/how-to/containers.md).")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(site_name: str | None, insecure: bool, timeout: float, sweep: str | None, resume: bool,
        sweep_epoch: int | None, container: str | None, command: tuple[str, ...]) -> None:
    """Start a Dask cluster for this job, run COMMAND against it, tear it down.

    Inside a SLURM/PBS job the workers are MPI ranks across the allocation; elsewhere a local cluster shaped
    like one node of the site; on jobqueue sites, worker jobs submitted and cancelled as the work needs. COMMAND finds the cluster through $HPC_GARAGE_SCHEDULER_FILE, and this
    command exits with COMMAND's exit code.
    """
    import os

    from hpc_garage.cluster.run import site_for_run
    from hpc_garage.files import read_secrets
    from hpc_garage.variables import SECRETS_ENV

    if path := os.environ.get(SECRETS_ENV):  # a deployment's job: its API's secrets, kept out of its script
        os.environ.update(read_secrets(path, SECRETS_ENV))
    site = site_for_run(site_name, os.environ)
    if container:
        from hpc_garage.sites import with_container

        site = with_container(site, container)
    if site.container is not None:  # `run` goes on inside the image (schedulers/container.py says why)
        from hpc_garage.schedulers.container import enter

        enter(site, sys.argv[1:])
    sys.exit(run_here(site, list(command), insecure=insecure, timeout=timeout, sweep=sweep, sweep_epoch=sweep_epoch,
                      resume=resume))


def run_here(site: Any, command: list[str], **settings: Any) -> int:
    """`hpc-garage run` in this process (also a jobqueue driver that runs on the login node): the Prefect API
    from hpc-garage's managed server unless one is set, and what workers and the scheduler import first."""
    from hpc_garage.cluster.run import run as run_cluster
    from hpc_garage.prefect.server import ensure_api

    return run_cluster(site, command, api=lambda host: ensure_api(host=host), preload=_prefect_preload(), **settings)


def _prefect_preload() -> Any:
    """What `run`'s workers and scheduler import first: Prefect's task path where Prefect is installed, or
    $HPC_GARAGE_WORKER_PRELOAD (prefect/preload.py names them; launchers/ only carry names)."""
    import os

    from hpc_garage.launchers.common import Preload
    from hpc_garage.prefect.preload import scheduler_preload, worker_preload

    return Preload(tuple(worker_preload(os.environ)), tuple(scheduler_preload(os.environ)))


@options.command()
@click.option("--site", "site_name", envvar=SITE_ENV, help=f"Site name or file (default: ${SITE_ENV}, else local).")
@click.option("--job", is_flag=True, help="Also submit one short job of one node that checks from inside it.")
def doctor(site_name: str | None, job: bool) -> None:
    """Check a site before its first real job: one line per check, `ok` or the problem and its fix.

    Without a job: the batch commands and the partition or queue, dask-mpi's MPI plugin under srun, the
    site's python, the interface, the run and results directories, the Prefect server, the GPU library.
    With --job (only once those pass): workers register, each sees its own GPUs, MPI initialises (dask-mpi),
    the results directory is shared with the compute node, the job's Python has the same versions.
    Exit code: 0 every check passed, 1 a check failed, 2 bad input (an unknown site).
    """
    from hpc_garage.doctor import doctor as run_doctor

    sys.exit(run_doctor(site_name or "local", job=job, echo=click.echo, say=lambda text: click.echo(text, err=True)))
