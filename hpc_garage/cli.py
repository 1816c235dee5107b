"""The `hpc-garage` command: parse, validate, delegate. Heavy imports happen inside the commands that need them."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from hpc_garage import __version__
from hpc_garage.core.errors import UserError


class _Failure(click.ClickException):
    """A UserError on its way out: one line on stderr, exit 2, no traceback."""

    exit_code = 2

    def show(self, file: Any = None) -> None:
        click.echo(f"hpc-garage: error: {self.message}", err=True)


class _Command(click.Command):
    """A command that refuses an option given twice (`--nodes 2 --nodes 3`, `-t 2h --time 3h`) instead of
    letting the last one win silently, and options that exclude each other (`exclusive`)."""

    def __init__(self, *args: Any, exclusive: tuple[tuple[str, ...], ...] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.exclusive = exclusive

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        _refuse_repeats(self, ctx, args)
        rest = super().parse_args(ctx, args)
        for group in self.exclusive:
            given = [name for name in group if ctx.params.get(name)]
            if len(given) > 1:
                flags = [self._flag(name) for name in given]
                raise UserError(f"{' and '.join(flags)} exclude each other; give one")
        return rest

    def _flag(self, name: str) -> str:
        return next(p.opts[0] for p in self.params if p.name == name)


def _refuse_repeats(command: click.Command, ctx: click.Context, args: list[str]) -> None:
    by_opt = {opt: p for p in command.params if isinstance(p, click.Option) and not (p.multiple or p.count)
              for opt in p.opts + p.secondary_opts}
    seen: dict[str, tuple[str, str | None]] = {}
    i = 0
    while i < len(args):
        word = args[i]
        i += 1
        if word == "--":
            return
        if not word.startswith("-") or word == "-":
            if not ctx.allow_interspersed_args:
                return
            continue
        name, eq, value = word.partition("=") if word.startswith("--") else (word[:2], "", word[2:])
        param = by_opt.get(name)
        if param is None:
            continue
        attached: str | None = (value if eq or value else None)
        if not param.is_flag and attached is None and i < len(args):
            attached, i = args[i], i + 1
        if param.name in seen:
            first, before = seen[param.name]
            shown = f" ({before!r} and {attached!r})" if before is not None or attached is not None else ""
            raise UserError(f"{first} given twice{'' if first == name else f' (as {name})'}{shown}; give it once")
        seen[param.name] = (name, attached)  # type: ignore[index]


class _Group(click.Group):
    command_class = _Command

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except UserError as exc:
            failure = _Failure(str(exc))
            failure.exit_code = exc.exit_code
            raise failure from None


def _memory(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """Memory per node; 0 means what sbatch's --mem=0 means: the node's memory (the site's default)."""
    from hpc_garage.core.units import parse_memory

    try:
        return None if value is None else parse_memory(value) or None
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _walltime(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    from hpc_garage.core.units import parse_walltime

    try:
        return None if value is None else parse_walltime(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _request(options: dict[str, Any]) -> Any:
    """The request flags of a command as one core Request."""
    from hpc_garage.core.request import Request

    return Request(**{k: v for k, v in options.items() if v is not None})


def _host(value: str) -> str:
    """An IP address or a host name: it names a directory of the server's state, so nothing else."""
    import ipaddress
    import re

    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        pass
    if re.fullmatch(r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*",
                    value):
        return value
    raise click.BadParameter(f"{value!r}: give an IP address or a host name, e.g. 127.0.0.1")


def _seconds(value: str) -> float:
    import math

    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or not 0 < seconds <= 7 * 86400:
        raise click.BadParameter(f"{value!r}: give seconds, more than 0 and at most a week, e.g. 180")
    return seconds


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hpc-garage")
def cli() -> None:
    """Run Prefect + Dask sweeps on SLURM and PBS clusters with per-process GPU, CPU and memory resources."""


@cli.command()
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


@cli.command(context_settings={"allow_interspersed_args": False},
             exclusive=(("as_json", "as_script", "worker_script"),))
@click.option("--site", "site_name", envvar="HPC_GARAGE_SITE", required=True, help="Site name or path to a site file.")
@click.option("--nodes", "-N", type=int, help="Nodes to request (default 1).")
@click.option("--gpus-per-node", type=int, help="GPUs per node (default: all of the node's).")
@click.option("--cores-per-node", type=int, help="Cores per node (default: all).")
@click.option("--mem", "memory", callback=_memory, help="Memory per node: 64GiB, 64GB, 64G, or MiB as a bare number; 0: the whole node, as sbatch.")
@click.option("--time", "-t", "walltime", callback=_walltime, help="Walltime: 01:30:00, 1-00:00:00, 90 (minutes), 2h.")
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

        click.echo(show_pools(site, as_json=as_json, **_request(request).asked()))
        return
    from hpc_garage.core.layout import describe, layout
    from hpc_garage.schedulers import allocation_for

    import os

    allocation = allocation_for(site, _request(request))
    layout_ = layout(site, allocation)
    if allocation.source != "request" or os.environ.get("HPC_GARAGE_SYSFS_ROOT"):
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


SHOW_JSON_INDENT_MAX = 1024  # workers above which `show --json` prints compact JSON


@cli.command(context_settings={"ignore_unknown_options": True})
@click.option("--site", "site_name", help="Site name or file (default: $HPC_GARAGE_SITE, else local).")
@click.option("--insecure", is_flag=True, help="Plain tcp instead of TLS with per-job certificates.")
@click.option("--timeout", default="180", show_default=True, callback=lambda ctx, param, value: _seconds(value),
              help="Seconds to wait for every worker to register.")
@click.option("--sweep", help="The sweep this run belongs to (default: named after the site and COMMAND).")
@click.option("--resume", is_flag=True, help="Continue the sweep's latest epoch: finished trials are read back.")
@click.option("--sweep-epoch", type=click.IntRange(min=1), hidden=True)  # job scripts that `submit` writes
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(site_name: str | None, insecure: bool, timeout: float, sweep: str | None, resume: bool,
        sweep_epoch: int | None, command: tuple[str, ...]) -> None:
    """Start a Dask cluster for this job, run COMMAND against it, tear it down.

    Inside a SLURM/PBS job the workers are MPI ranks across the allocation; elsewhere a local cluster shaped
    like one node of the site; on jobqueue sites, worker jobs submitted and cancelled as the work needs. COMMAND finds the cluster through $HPC_GARAGE_SCHEDULER_FILE, and this
    command exits with COMMAND's exit code.
    """
    import os

    from hpc_garage.cluster.run import run as run_cluster, site_for_run

    from hpc_garage.prefect.server import ensure_api

    site = site_for_run(site_name, os.environ)
    sys.exit(run_cluster(site, list(command), insecure=insecure, timeout=timeout, api=lambda host: ensure_api(host=host),
                         sweep=sweep, sweep_epoch=sweep_epoch, resume=resume))


# ------------------------------------------------------------------------------- submitting and following


def _show_script(site_name: str, as_script: bool, command: tuple[str, ...], request: dict[str, Any]) -> None:
    if not as_script:
        raise UserError(f"show takes SCRIPT [ARGS] only with --script (got {' '.join(command)!r})")
    from hpc_garage.schedulers.submission import prepare

    script, *args = command or ("SCRIPT.py",)
    prepared = prepare(site_name, script, args, _request(request), must_exist=bool(command))
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


def _submit_prepared(prepared: Any, dry_run: bool, wait: bool, walltime: int | None = None) -> None:
    """Print the script (--dry-run), or submit and say where the job and its log are; --wait follows it.
    `walltime`: the user's --time, which bounds a driver that runs here (and its worker jobs)."""
    for line in prepared.layout.leftovers:
        click.echo(f"note: unused: {line}", err=True)
    jobqueue = prepared.site.launcher == "jobqueue"
    if dry_run:
        click.echo(prepared.script, nl=False)
        if jobqueue:  # and the worker jobs the driver will submit
            from hpc_garage.launchers.jobqueue.jobs import worker_scripts

            click.echo(worker_scripts(prepared.site), nl=False)
        return
    if jobqueue and prepared.site.jobqueue.driver == "login":  # the driver (scheduler, script) runs here
        from hpc_garage.cluster.run import run as run_cluster
        from hpc_garage.prefect.server import ensure_api

        spec = prepared.spec
        click.echo(f"hpc-garage: site {prepared.site.name} runs its driver on the login node: "
                   f"hpc-garage run -- {spec.python} {spec.script}", err=True)
        sys.exit(run_cluster(prepared.site, [spec.python, spec.script, *spec.args],
                             api=lambda host: ensure_api(host=host), sweep=spec.sweep, sweep_epoch=spec.sweep_epoch,
                             walltime=walltime))
    from hpc_garage.schedulers import submission

    done = submission.submit(prepared)
    click.echo(f"submitted job {done.job_id} (site {prepared.site.name})")
    click.echo(f"log: {done.log}" + (f"  errors: {done.error_log}" if done.error_log else ""))
    if wait:
        _follow(submission, done.job_id, str(prepared.site.path or prepared.site.name))


def _follow(submission: Any, job_id: str, site: str) -> None:
    """`--wait`: follow the job, and the follow-up jobs that carry its sweep on, until the sweep ends."""
    stdout = click.get_text_stream("stdout")
    view = submission.find(job_id, site)
    try:
        line = submission.progress_line(stdout)
        code = submission.wait(view, line, note=line.note)
    except KeyboardInterrupt:
        click.echo(f"\nstopped following job {view.job_id}; it goes on (hpc-garage status/cancel {view.job_id})")
        sys.exit(130)
    if stdout.isatty():
        click.echo()
    sys.exit(code)


@cli.command(context_settings={"allow_interspersed_args": False})
@click.option("--site", "site_name", envvar="HPC_GARAGE_SITE", required=True, help="Site name or path to a site file.")
@click.option("--nodes", "-N", type=int, help="Nodes (default 1).")
@click.option("--gpus-per-node", type=int, help="GPUs per node (default: all of the node's).")
@click.option("--cores-per-node", type=int, help="Cores per node (default: all).")
@click.option("--time", "-t", "walltime", callback=_walltime, help="Walltime: 01:30:00, 1-00:00:00, 90 (minutes), 2h.")
@click.option("--mem", "memory", callback=_memory, help="Memory per node: 64GiB, 64GB, 64G, or MiB as a bare number; 0: the whole node, as sbatch.")
@click.option("--account", "-A", help="Account to charge (default: the site's).")
@click.option("--qos", help="Quality of service (SLURM; default: the site's).")
@click.option("--job-name", "-J", help="Job name: letters, digits, . _ + - (default: the script's name).")
@click.option("--dry-run", is_flag=True, help="Print the job script; submit and create nothing.")
@click.option("--wait", is_flag=True, help="Follow the job (and its follow-up jobs) until the sweep ends; exit with its exit code.")
@click.option("--sweep", help="The sweep this job belongs to (default: named after the site, script and arguments).")
@click.option("--resume", is_flag=True, help="Continue the sweep's latest epoch: finished trials are read back, not run.")
@click.argument("script")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def submit(site_name: str, script: str, args: tuple[str, ...], dry_run: bool, wait: bool, sweep: str | None,
           resume: bool, **request: Any) -> None:
    """Submit SCRIPT [ARGS] as a batch job that starts Dask across its allocation and runs the script.

    The job runs `python -m hpc_garage run --site SITE -- python SCRIPT ARGS` from this directory.
    """
    from hpc_garage.schedulers.submission import prepare

    asked = _request(request)
    _submit_prepared(prepare(site_name, script, args, asked, sweep=sweep, resume=resume), dry_run, wait,
                     asked.walltime)


@cli.command(
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    short_help="Submit with sbatch's options: -N, -p, --gres, -G, -t, --mem, -c, -A, -J, -o, -e ...",
)
@click.argument("argv", nargs=-1, type=click.UNPROCESSED, metavar="[SBATCH OPTIONS] SCRIPT [ARGS]...")
def sbatch(argv: tuple[str, ...]) -> None:
    """Submit like sbatch: the options you know, the same job as `submit`.

    Understood: -N/--nodes, -p/--partition, --gres=gpu[:TYPE]:N, -G/--gpus (total, split over nodes),
    --gpus-per-node, -t/--time, --mem (per node), -c/--cpus-per-task (cores per Dask worker),
    -A/--account, -J/--job-name, -o/--output, -e/--error, -q/--qos, -W/--wait, plus --site NAME and
    --dry-run. The site is --site, or the one SLURM site (default launch) whose queue is the partition. Other sbatch
    options (-C/--constraint, --exclusive, --mail-type, ...) are written into the job script as #SBATCH
    lines; options that contradict the site's worker layout (-n, --ntasks-per-node, --mem-per-cpu,
    --array, ...) are refused with the reason.
    """
    from hpc_garage.schedulers.sbatch_options import parse, site_for
    from hpc_garage.schedulers.submission import prepare

    call = parse(argv)
    site_name = site_for(call)
    prepared = prepare(site_name, call.script, call.args, call.request(), output=call.output, error=call.error,
                       sweep=call.sweep, resume=call.resume)
    _submit_prepared(prepared, call.dry_run, call.wait, call.request().walltime)


@cli.command()
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


@cli.command()
@click.argument("job_id", required=False)
@click.option("--site", "site_name", help="Site of a job hpc-garage has no run directory for.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (one object for JOBID, else a list).")
def status(job_id: str | None, site_name: str | None, as_json: bool) -> None:
    """Show a job, or (without JOBID) every job hpc-garage submitted that has a run directory, newest first."""
    from hpc_garage.schedulers import submission

    if job_id is not None:
        view = submission.lookup(job_id, site_name)
        if as_json:
            click.echo(json.dumps(view.to_dict(sweep=True), indent=2))
            return
        data = view.to_dict(sweep=True)
        click.echo(f"job {job_id} {data['summary']}")
        batch = view.status
        details = {
            "site": data["site"],
            "name": data["name"],
            f"{view.batch.name} state": f"{batch.state}" + (f" ({batch.reason})" if batch.reason else "") if batch else "not in the queue",
            "nodes": batch.nodes if batch else None,
            "lost nodes": _lost_nodes(data["run"]),
            "sweep": _sweep_line(data["sweep"]),
            "sweep trials": submission.sweep_text(data["sweep"]),
            "log": data["log"],
            "run directory": data["run_dir"],
        }
        progress = (data["run"] or {}).get("progress")
        if progress:
            details["trials"] = submission.progress_text(progress)
        for key, value in details.items():
            if value:
                click.echo(f"  {key + ':':<16}{value}")
        for line in submission.progress_links(progress) if progress and not view.finished else ():
            click.echo(f"  {line}")
        return
    roots = None
    if site_name:
        from hpc_garage.sites import load_site

        roots = [submission.run_root(load_site(site_name))]
    views = submission.status_all(roots)
    if as_json:
        click.echo(json.dumps([v.to_dict() for v in views], indent=2))
        return
    if not views:
        click.echo("no jobs: hpc-garage has submitted none that still have a run directory")
        return
    import time

    click.echo(f"{'JOBID':<12} {'SITE':<14} {'NAME':<20} {'SUBMITTED':<17} STATE")
    for v in views:
        d = v.to_dict()
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(d["submitted"])) if d["submitted"] else "-"
        click.echo(f"{v.job_id:<12} {d['site'] or '-':<14} {(d['name'] or '-')[:20]:<20} {when:<17} {d['summary']}")


def _sweep_line(sweep: dict[str, Any] | None) -> str | None:
    """e.g. `lr-scan-2f0c… epoch 1: 14 results kept; jobs 93 (submit), 98 (follow-up)`."""
    if not sweep:
        return None
    jobs = ", ".join(f"{j['job_id']} ({j['how']})" for j in sweep["jobs"])
    return f"{sweep['name']} epoch {sweep['epoch']}: {sweep['results']} results kept; jobs {jobs}"


def _lost_nodes(run: dict[str, Any] | None) -> str | None:
    """state.json's lost nodes (cluster/node_loss.py), e.g. `node2 at 23:41:07 (killed by signal 9; restarted)`."""
    import time

    lost = (run or {}).get("lost_nodes") or []
    return "; ".join(f"{x.get('host')} at {time.strftime('%H:%M:%S', time.localtime(x.get('at', 0)))} ({x.get('why')}"
                     + ("; restarted)" if x.get("restarted") else ")") for x in lost) or None


@cli.command()
@click.argument("job_id")
@click.option("--site", "site_name", help="Site of a job hpc-garage has no run directory for.")
def cancel(job_id: str, site_name: str | None) -> None:
    """Cancel a queued or running job (scancel / qdel), and say what was done."""
    from hpc_garage.schedulers import submission

    click.echo(submission.cancel(submission.find(job_id, site_name)))


@cli.command()
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


@cli.command()
@click.argument("job_id")
@click.option("--site", "site_name", help="Where to look for the job's run directory.")
@click.option("--json", "as_json", is_flag=True, help="Print report.json as it is.")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False), help="Write a per-GPU timeline PNG (needs the plot extra).")
def report(job_id: str, site_name: str | None, as_json: bool, plot_file: str | None) -> None:
    """Print the efficiency report of a job that ended: GPUs and workers allocated, busy and idle, memory, trials."""
    from hpc_garage.cluster.report import load, plot, summary
    from hpc_garage.schedulers import submission

    data = load(submission.find(job_id, site_name), job_id)
    if plot_file:
        plot(data, plot_file)
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    for line in summary(data):
        click.echo(line)
    if plot_file:
        click.echo(f"timeline: {plot_file}")


@cli.command()
@click.argument("job_id")
@click.option("--site", "site_name", help="Where to look for the job's run directory.")
def replay(job_id: str, site_name: str | None) -> None:
    """Send Prefect's API what a job kept while the API did not answer (its events, log lines, the flow run's
    final state), once the API is back; a second replay sends nothing again."""
    from hpc_garage.prefect.replay import replay as replay_kept
    from hpc_garage.schedulers import submission

    for line in replay_kept(job_id, submission.run_dir_of(submission.find(job_id, site_name))):
        click.echo(line)


@cli.group()
def server() -> None:
    """The Prefect server hpc-garage starts and shares with every worker (one per user and host)."""


@server.command("status")
@click.option("--host", default="127.0.0.1", show_default=True, callback=lambda ctx, param, value: _host(value),
              help="Address the server listens on.")
def server_status(host: str) -> None:
    """Say whether the shared Prefect server runs: where, its database, uptime and idle time."""
    from hpc_garage.prefect.server import server_status as status

    click.echo(json.dumps(status(host), indent=2))


@server.command("stop")
@click.option("--host", default="127.0.0.1", show_default=True, callback=lambda ctx, param, value: _host(value),
              help="Address the server listens on.")
def server_stop(host: str) -> None:
    """Stop the shared Prefect server (runs start it again when they need it)."""
    from hpc_garage.prefect.server import stop_server

    click.echo("stopped" if stop_server(host) else "no hpc-garage Prefect server was running there")


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


if __name__ == "__main__":
    sys.exit(main())
