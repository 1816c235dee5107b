"""The commands about Prefect's side: `worker` (the work pool's flow runs as batch jobs) and the `server` group
(the managed Prefect server: `status`, `stop`, `auth`)."""

from __future__ import annotations

import json
import sys

import click

from hpc_garage.cli import options
from hpc_garage.variables import SITE_ENV


@options.command()
@click.option("--pool", "-p", required=True, help="The work pool to take flow runs from (created, type hpc-garage, if missing).")
@click.option("--site", "site_name", envvar=SITE_ENV,
              help=f"The run form's default site, where this creates the pool (default: ${SITE_ENV}).")
@click.option("--name", "-n", help="This worker's name in the UI (default: random).")
@click.option("--limit", "-l", type=click.IntRange(min=1), help="Most flow runs (jobs) submitted and followed at once.")
@click.option("--run-once", is_flag=True, help="Submit what is due, look at the jobs once, exit (cron, scrontab).")
@click.option("--host", default="127.0.0.1", show_default=True, callback=lambda ctx, param, value: options.host(value),
              help="Address hpc-garage's Prefect server listens on, where PREFECT_API_URL is not set.")
def worker(pool: str, site_name: str | None, name: str | None, limit: int | None, run_once: bool, host: str) -> None:
    """Turn the pool's flow runs (Run button, schedules, `prefect deployment run`) into batch jobs: what
    `prefect worker start --pool POOL` does, on hpc-garage's Prefect server unless PREFECT_API_URL is set.
    SIGINT or SIGTERM (Ctrl-C, `kill`) stops it within seconds; its jobs go on, and a worker started again
    follows them."""
    import os

    from hpc_garage import log
    from hpc_garage.prefect import pool_signals
    from hpc_garage.prefect.server import ensure_api

    log.setup()
    pool_signals.stop_on_signals()  # from the start: ignored SIGINT (`&` in a script) included
    try:
        os.environ.update(ensure_api(host=host))  # before Prefect is imported: it reads its settings then
        from hpc_garage.work_pool import serve

        code = serve(pool, site=site_name, name=name, limit=limit, run_once=run_once, host=host,
                     printer=click.echo)
    except pool_signals.Stopped as stopped:
        code = stopped.exit_code
    sys.exit(code)


@click.group()
def server() -> None:
    """The Prefect server hpc-garage starts and shares with every worker (one per user and host)."""


@server.command("status")
@click.option("--host", default="127.0.0.1", show_default=True, callback=lambda ctx, param, value: options.host(value),
              help="Address the server listens on.")
def server_status(host: str) -> None:
    """Say whether the shared Prefect server runs: where, its database, uptime and idle time, and its UI: the
    address, the `ssh -L` line from a laptop, and how to read the auth string its login page asks for."""
    from hpc_garage.prefect.server import server_status as status

    click.echo(json.dumps(status(host), indent=2))


@server.command("stop")
@click.option("--host", default="127.0.0.1", show_default=True, callback=lambda ctx, param, value: options.host(value),
              help="Address the server listens on.")
@click.option("--force", is_flag=True, help="Stop it even while runs or flows use it (they lose their API).")
def server_stop(host: str, force: bool) -> None:
    """Stop the shared Prefect server (runs start it again when they need it). While a run or flow uses it,
    nothing is stopped and the users are named, unless --force."""
    from hpc_garage.prefect.server import stop_server

    click.echo("stopped" if stop_server(host, force=force) else "no hpc-garage Prefect server was running there")


@server.command("auth")
@click.option("--host", default="127.0.0.1", show_default=True, callback=lambda ctx, param, value: options.host(value),
              help="Address the server listens on.")
@click.option("--machine", help="The machine the server runs on (a job's node: `hpc-garage status JOB` names it); "
              "default: this one.")
def server_auth(host: str, machine: str | None) -> None:
    """Print the shared Prefect server's auth string: what its UI's login page asks for. Keep it private:
    it is the server's only password (it changes when the server restarts)."""
    from hpc_garage.prefect.server import auth_string

    click.echo(auth_string(host, machine))
