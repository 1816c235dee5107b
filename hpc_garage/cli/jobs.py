"""The commands about batch jobs: `submit`, `sbatch`, `resume`, `status`, `cancel`, `logs`, `report`, `replay`.
They parse and delegate to `schedulers/submission`; what `status` prints is written in `cli/status_text.py`."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from hpc_garage.cli import options


def _submit_prepared(prepared: Any, dry_run: bool, wait: bool, walltime: int | None = None) -> None:
    """Print the script (--dry-run), or submit and say where the job and its log are; --wait follows it.
    `walltime`: the user's --time, which bounds a driver that runs here (and its worker jobs)."""
    for line in prepared.layout.leftovers:
        click.echo(f"note: unused: {line}", err=True)
    from hpc_garage.core.scheduler_limit import past_one_scheduler

    if past := past_one_scheduler(prepared.layout.worker_count):  # warned, not refused: see the module
        click.echo(f"warning: {past}", err=True)
    jobqueue = prepared.site.launcher == "jobqueue"
    if dry_run:
        click.echo(prepared.script, nl=False)
        if jobqueue:  # and the worker jobs the driver will submit
            from hpc_garage.launchers.jobqueue.jobs import worker_scripts

            click.echo(worker_scripts(prepared.site), nl=False)
        return
    if jobqueue and prepared.site.jobqueue.driver == "login":  # the driver (scheduler, script) runs here
        from hpc_garage.cli.cluster import run_here

        spec = prepared.spec
        click.echo(f"hpc-garage: site {prepared.site.name} runs its driver on the login node: "
                   f"hpc-garage run -- {spec.python} {spec.script}", err=True)
        sys.exit(run_here(prepared.site, [spec.python, spec.script, *spec.args], sweep=spec.sweep,
                          sweep_epoch=spec.sweep_epoch, walltime=walltime))
    from hpc_garage.schedulers import submission

    done = submission.submit(prepared)
    click.echo(f"submitted job {done.job_id} (site {prepared.site.name})")
    click.echo(f"log: {done.log}" + (f"  errors: {done.error_log}" if done.error_log else ""))
    if wait:
        _follow(submission, done.job_id, str(prepared.site.path or prepared.site.name))


def _follow(submission: Any, job_id: str, site: str) -> None:
    """`--wait`: follow the job, and the follow-up jobs that carry its sweep on, until the sweep ends."""
    from hpc_garage.cli.status_text import progress_line, progress_links

    stdout = click.get_text_stream("stdout")
    view = submission.find(job_id, site)
    try:
        line = progress_line(stdout)
        code = submission.wait(view, line, note=line.note, links=progress_links)
    except KeyboardInterrupt:
        click.echo(f"\nstopped following job {view.job_id}; it goes on (hpc-garage status/cancel {view.job_id})")
        sys.exit(130)
    if stdout.isatty():
        click.echo()
    sys.exit(code)


@options.command(context_settings={"allow_interspersed_args": False})
@options.request_flags()
@click.option("--dry-run", is_flag=True, help="Print the job script; submit and create nothing.")
@click.option("--wait", is_flag=True, help="Follow the job (and its follow-up jobs) until the sweep ends; exit with its exit code.")
@click.argument("script")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def submit(site_name: str, script: str, args: tuple[str, ...], dry_run: bool, wait: bool, sweep: str | None,
           resume: bool, **request: Any) -> None:
    """Submit SCRIPT [ARGS] as a batch job that starts Dask across its allocation and runs the script.

    The job runs `python -m hpc_garage run --site SITE -- python SCRIPT ARGS` from this directory.
    """
    from hpc_garage.schedulers.submission import prepare

    asked = options.request_of(request)
    _submit_prepared(prepare(site_name, script, args, asked, sweep=sweep, resume=resume), dry_run, wait,
                     asked.walltime)


@options.command(
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    short_help="Submit with sbatch's options: -N, -p, --gres, -G, -t, --mem, -c, -A, -J, -o, -e ...",
)
@click.argument("argv", nargs=-1, type=click.UNPROCESSED, metavar="[SBATCH OPTIONS] SCRIPT [ARGS]...")
def sbatch(argv: tuple[str, ...]) -> None:
    """Submit like sbatch: the options you know, the same job as `submit`.

    Understood: REQUEST_OPTIONS, each as `submit` reads it (--mem per node); and sbatch's -p/--partition,
    --gres=gpu[:TYPE]:N, -G/--gpus (total, split over nodes), -c/--cpus-per-task (cores per Dask worker),
    -o/--output, -e/--error, -W/--wait, plus --dry-run. The site is --site, or the one SLURM site (default
    launch) whose queue is the partition. Other sbatch options (-C/--constraint, --exclusive, --mail-type, ...)
    are written into the job script as #SBATCH lines; options that contradict the site's worker layout (-n,
    --ntasks-per-node, --mem-per-cpu, --array, ...) are refused with the reason.
    """
    from hpc_garage.schedulers.sbatch_options import parse, site_for
    from hpc_garage.schedulers.submission import prepare

    call = parse(argv)
    site_name = site_for(call)
    prepared = prepare(site_name, call.script, call.args, call.request(), output=call.output, error=call.error,
                       sweep=call.sweep, resume=call.resume)
    _submit_prepared(prepared, call.dry_run, call.wait, call.request().walltime)


def _sbatch_spellings() -> str:
    """The request options' sbatch spellings, from their table (core/request_options.py), for sbatch's help."""
    from hpc_garage.core.request_options import OPTIONS

    return ", ".join("/".join(o.sbatch) for o in OPTIONS if o.sbatch)


sbatch.help = (sbatch.help or "").replace("REQUEST_OPTIONS", _sbatch_spellings())


@options.command()
@click.argument("target", metavar="SWEEP|JOBID")
@click.option("--site", "site_name", help="Site whose results directory holds the sweep (default: every visible site's).")
@click.option("--wait", is_flag=True, help="Follow the job (and its follow-up jobs) until the sweep ends.")
def resume(target: str, site_name: str | None, wait: bool) -> None:
    """Continue a sweep: submit its job script again; finished trials are read back, not run."""
    from hpc_garage.schedulers import submission

    book, done = submission.resume(target, site_name)
    click.echo(f"resumed sweep {book.name} as job {done.job_id} (site {done.record['site']})")
    click.echo(f"log: {done.log}" + (f"  errors: {done.error_log}" if done.error_log else ""))
    if wait:
        _follow(submission, done.job_id, done.record["site_file"])


@options.command()
@click.argument("job_id", required=False)
@click.option("--site", "site_name", help="Site of a job hpc-garage has no run directory for.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (one object for JOBID, else a list).")
def status(job_id: str | None, site_name: str | None, as_json: bool) -> None:
    """Show a job, or (without JOBID) every job hpc-garage submitted that has a run directory, newest first, and
    every `hpc-garage run` outside a batch job (a login node's: id local-DATE-TIME-PID, running while its process
    lives)."""
    from hpc_garage.cli.status_text import job_lines, jobs_table
    from hpc_garage.schedulers import submission

    if job_id is not None:
        view = submission.lookup(job_id, site_name)
        if as_json:
            click.echo(json.dumps(view.to_dict(sweep=True), indent=2))
            return
        click.echo("\n".join(job_lines(view)))
        return
    roots = None
    if site_name:
        from hpc_garage.rundir import RunRoot
        from hpc_garage.sites import load_site

        roots = [RunRoot.of_site(load_site(site_name))]
    views = submission.status_all(roots)
    if as_json:
        click.echo(json.dumps([v.to_dict() for v in views], indent=2))
        return
    click.echo("\n".join(jobs_table(views)))


@options.command()
@click.argument("job_id")
@click.option("--site", "site_name", help="Site of a job hpc-garage has no run directory for.")
@click.option("--now", is_flag=True, help="Cancel at once: no checkpoint grace for the running trials.")
def cancel(job_id: str, site_name: str | None, now: bool) -> None:
    """Cancel a queued or running job (scancel / qdel; a login node's run: SIGTERM), and say what was done.

    A running sweep's trials first see `hpc_garage.trial.should_stop()` and get the site's checkpoint_grace
    to save; no follow-up job is submitted, and `hpc-garage resume JOB_ID` continues from the checkpoints.
    """
    from hpc_garage.schedulers import submission

    click.echo(submission.cancel(submission.find(job_id, site_name), click.echo, now=now))


@options.command()
@click.argument("job_id")
@click.option("--follow", "-f", is_flag=True, help="Keep printing as the log grows, until the job ends.")
@click.option("--site", "site_name", help="Where to look for the job's run directory.")
def logs(job_id: str, follow: bool, site_name: str | None) -> None:
    """Print a job's log (its stdout and stderr, or both files when they were split with -e)."""
    from hpc_garage.schedulers import submission

    try:
        submission.logs(submission.find(job_id, site_name), click.get_binary_stream("stdout"), follow=follow)
    except KeyboardInterrupt:
        sys.exit(130)


@options.command()
@click.argument("job_id")
@click.option("--site", "site_name", help="Where to look for the job's run directory.")
@click.option("--json", "as_json", is_flag=True, help="Print report.json as it is.")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False),
              help="Write a per-GPU timeline PNG, with each reporting trial's curve below it and a search's best "
                   "value against GPU-hours (needs the plot extra).")
def report(job_id: str, site_name: str | None, as_json: bool, plot_file: str | None) -> None:
    """Print the efficiency report of a job that ended: GPUs and workers allocated, busy and idle, memory, trials;
    where trials reported metrics, the best trial, those pruned and the GPU-seconds pruning saved (an estimate)."""
    from hpc_garage.cluster.report import load, summary, trial_curves
    from hpc_garage.cluster.report_plot import plot
    from hpc_garage.schedulers import submission

    view = submission.find(job_id, site_name)
    data = load(view, job_id)
    if plot_file:
        plot(data, plot_file, trial_curves(view, data))
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    for line in summary(data):
        click.echo(line)
    if plot_file:
        click.echo(f"timeline: {plot_file}")


@options.command()
@click.argument("job_id")
@click.option("--site", "site_name", help="Where to look for the job's run directory.")
def replay(job_id: str, site_name: str | None) -> None:
    """Send Prefect's API what a job kept while the API did not answer (its events, log lines, the flow run's
    final state), once the API is back; a second replay sends nothing again."""
    from hpc_garage.prefect.replay import replay as replay_kept
    from hpc_garage.schedulers import submission

    for line in replay_kept(job_id, submission.run_dir_of(submission.find(job_id, site_name))):
        click.echo(line)
