"""The `hpc-garage` command: parse, validate, delegate. Heavy imports happen inside the commands that need them.

Where each command lives (a new one goes in the module of its group, and into `COMMANDS` below):
- `cli/cluster.py`  sites, show, run, doctor: a site, what it gives, running on it
- `cli/jobs.py`     submit, sbatch, resume, status, cancel, logs, report, replay: batch jobs
- `cli/server.py`   worker, and the `server` group (status, stop, auth): Prefect's side
- `cli/options.py`  what commands share: `options.command` (refuses an option given twice, `exclusive`
                    options), option values (memory, walltime, seconds, host), flags → Request
- `cli/status_text.py`  how a terminal shows jobs: `status` lines and table, where to look while a job runs
                    (Prefect UI, dashboard, `ssh -L` lines), `--wait`'s line (the data: schedulers/submission)
- here              the group, its own options (`--version`), and one line and exit 2 for every refusal
"""

from __future__ import annotations

import sys
from typing import Any

import click

from hpc_garage._version import __version__
from hpc_garage.cli import cluster, jobs, options, server
from hpc_garage.core.errors import UserError


class _Failure(click.ClickException):
    """A UserError on its way out: one line on stderr, exit 2, no traceback."""

    exit_code = 2

    def show(self, file: Any = None) -> None:
        click.echo(f"hpc-garage: error: {self.message}", err=True)


class _Group(click.Group):
    command_class = options.Command

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except UserError as exc:
            failure = _Failure(str(exc))
            failure.exit_code = exc.exit_code
            raise failure from None


def _show_versions(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from hpc_garage.compat import installed_versions  # installed metadata only: nothing heavy is imported

    click.echo(f"hpc-garage {__version__}")
    for line in installed_versions():
        click.echo(line)
    ctx.exit()


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_show_versions,
              help="Show hpc-garage's version, and those of Prefect, prefect-dask, distributed and dask-jobqueue "
                   "against the ranges hpc-garage was verified on; then exit.")
def cli() -> None:
    """Run Prefect + Dask sweeps on SLURM and PBS clusters with per-process GPU, CPU and memory resources."""


COMMANDS = (
    cluster.sites, cluster.show, cluster.run, cluster.doctor,
    jobs.submit, jobs.sbatch, jobs.resume, jobs.status, jobs.cancel, jobs.logs, jobs.report, jobs.replay,
    server.worker, server.server,
)
for _command in COMMANDS:
    cli.add_command(_command)
del _command


def main(argv: list[str] | None = None) -> None:
    """Every refusal, click's own usage errors included, is one line on stderr and exit 2."""
    try:
        code = cli.main(args=argv, prog_name="hpc-garage", standalone_mode=False)
    except click.UsageError as exc:
        hint = f" (`hpc-garage {exc.ctx.command_path.split(' ', 1)[1]} --help`)" \
            if exc.ctx is not None and " " in exc.ctx.command_path else " (`hpc-garage --help`)"
        click.echo(f"hpc-garage: error: {' '.join(exc.format_message().split())}{hint}", err=True)
        sys.exit(2)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo("hpc-garage: interrupted", err=True)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)
