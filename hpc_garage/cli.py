"""The `hpc-garage` command: parse, validate, delegate. Heavy imports happen inside the commands that need them."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from hpc_garage import __version__
from hpc_garage.errors import UserError


class _Failure(click.ClickException):
    """A UserError on its way out: one line on stderr, exit 2, no traceback."""

    exit_code = 2

    def show(self, file: Any = None) -> None:
        click.echo(f"hpc-garage: error: {self.message}", err=True)


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except UserError as exc:
            failure = _Failure(str(exc))
            failure.exit_code = exc.exit_code
            raise failure from None


def _memory(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    from hpc_garage.units import parse_memory

    try:
        return None if value is None else parse_memory(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _walltime(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    from hpc_garage.units import parse_walltime

    try:
        return None if value is None else parse_walltime(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hpc-garage")
def cli() -> None:
    """Run Prefect + Dask sweeps on SLURM and PBS clusters with per-process GPU, CPU and memory resources."""


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON list.")
def sites(as_json: bool) -> None:
    """List the sites hpc-garage can see, and where each was found."""
    from hpc_garage.site import find_sites, load_site

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
    from hpc_garage.units import format_bytes

    for r in rows:
        if "error" in r:
            click.echo(f"{r['name']:<14} BROKEN: {r['error']}")
            continue
        n = r["node"]
        gpus = f", {n['gpus']} GPU" + (f" {n['gpu_type']}" if n["gpu_type"] else "") if n["gpus"] else ""
        shape = f"{n['cores']} cores, {format_bytes(n['memory'])}{gpus}"
        click.echo(f"{r['name']:<14} {r['scheduler']:<6} {r['launcher']:<9} {shape:<36} {r['path']}")


@cli.command()
@click.option("--site", "site_name", envvar="HPC_GARAGE_SITE", required=True, help="Site name or path to a site file.")
@click.option("--nodes", "-N", type=int, help="Nodes to request (default 1).")
@click.option("--gpus-per-node", type=int, help="GPUs per node (default: all of the node's).")
@click.option("--cores-per-node", type=int, help="Cores per node (default: all).")
@click.option("--mem", callback=_memory, help="Memory per node: 64GiB, 64GB, 64G, or MiB as a bare number.")
@click.option("--time", "-t", "walltime", callback=_walltime, help="Walltime: 01:30:00, 1-00:00:00, 90 (minutes), 2h.")
@click.option("--json", "as_json", is_flag=True, help="Print exactly one JSON object.")
def show(site_name: str, as_json: bool, **request: Any) -> None:
    """Show the workers a site and allocation give, and the resource math behind them.

    Inside a job (SLURM or PBS variables set) and without request flags, the job's own allocation is used.
    """
    from hpc_garage.planning import plan_for

    plan_ = plan_for(site_name, **request)
    if as_json:
        click.echo(json.dumps(plan_.to_dict(), indent=2))
        return
    from hpc_garage.layout import describe

    click.echo("\n".join(describe(plan_)))


@cli.command(context_settings={"ignore_unknown_options": True})
@click.option("--site", "site_name", help="Site name or file (default: $HPC_GARAGE_SITE, else local).")
@click.option("--insecure", is_flag=True, help="Plain tcp instead of TLS with per-job certificates.")
@click.option("--timeout", default=180.0, show_default=True, help="Seconds to wait for every worker to register.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(site_name: str | None, insecure: bool, timeout: float, command: tuple[str, ...]) -> None:
    """Start a Dask cluster for this job, run COMMAND against it, tear it down.

    Inside a SLURM/PBS job the workers are MPI ranks across the allocation; elsewhere a local cluster shaped
    like one node of the site. COMMAND finds the cluster through $HPC_GARAGE_SCHEDULER_FILE, and this
    command exits with COMMAND's exit code.
    """
    import os

    from hpc_garage.runner import run as run_cluster, site_for_run

    site = site_for_run(site_name, os.environ)
    sys.exit(run_cluster(site, list(command), insecure=insecure, timeout=timeout))


def main(argv: list[str] | None = None) -> None:
    cli.main(args=argv, prog_name="hpc-garage")


if __name__ == "__main__":
    sys.exit(main())
