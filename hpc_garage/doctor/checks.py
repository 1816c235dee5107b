"""The doctor's checks on the login node, before any job, and the one report they and the job's checks share.

Each check gives one `Check`: ok, a failure with its fix, or a note (informative: it never fails the doctor).
A check that cannot even ask (a command that fails, a file it cannot read) is a failure in one line too,
never a traceback. Every batch-system spelling is asked of `schedulers` (BatchSystem.check_queue,
rank_launch, missing_commands); the Prefect server of `prefect.server`.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from hpc_garage.core.errors import UserError
from hpc_garage.doctor.probe import VERSIONS_CODE, gpu_library, versions

if TYPE_CHECKING:
    from hpc_garage.core.site import Site
    from hpc_garage.schedulers.base import BatchSystem, Preflight

logger = logging.getLogger(__name__)

Status = Literal["ok", "fail", "note"]
LABELS = {"ok": "ok  ", "fail": "FAIL", "note": "note"}


@dataclass(frozen=True)
class Check:
    """One line of the doctor's report."""

    name: str
    found: str
    fix: str | None = None
    status: Status = "ok"

    @classmethod
    def of(cls, name: str, finding: Preflight) -> Check:
        return cls(name, finding.found, finding.fix, "fail" if finding.fix else "ok")

    @classmethod
    def fail(cls, name: str, found: str, fix: str | None = None) -> Check:
        return cls(name, found, fix, "fail")

    @classmethod
    def note(cls, name: str, found: str) -> Check:
        return cls(name, found, None, "note")

    @property
    def failed(self) -> bool:
        return self.status == "fail"

    def line(self) -> str:
        fix = f"; fix: {self.fix}" if self.fix else ""
        return f"{LABELS[self.status]}  {self.name}: {self.found}{fix}"


def site_file(site: Site) -> str:
    """The site's file, for fixes (`add ... in FILE`)."""
    return os.path.abspath(site.path) if site.path else f"site {site.name}'s file"


def guarded(name: str, check: Callable[[], Check | None]) -> Check | None:
    """Run one check; one that cannot ask (a command failed, a file cannot be read) is a failure line."""
    try:
        return check()
    except UserError as exc:
        return Check.fail(name, str(exc))
    except Exception as exc:  # noqa: BLE001 - the doctor reports every check; one crash must not hide the rest
        logger.debug("check %s crashed", name, exc_info=True)
        return Check.fail(name, f"the check itself failed ({type(exc).__name__}: {exc})")


# ------------------------------------------------------------------------------------------- the checks


def preflight(site: Site, *, batch: BatchSystem | None = None, env: Mapping[str, str] | None = None,
              api: Callable[[], Check] | None = None) -> Iterator[Check]:
    """Every check that needs no job, in the order a new site's mistakes are usually found; lazily, so that
    each line shows as soon as it is known (the Prefect server may take seconds to start). A check that does
    not apply (no interface named, no dask-mpi) gives no line."""
    here = os.environ if env is None else env
    for name, check in _steps(site, batch, here, api):
        if (found := guarded(name, check)) is not None:
            yield found


Step = Callable[[], "Check | None"]


def _steps(site: Site, batch: BatchSystem | None, env: Mapping[str, str],
           api: Callable[[], Check] | None) -> Iterator[tuple[str, Step]]:
    from hpc_garage.schedulers import get

    system = batch if batch is not None else get(site.scheduler)
    if system.takes_jobs:
        yield "batch commands", lambda: batch_commands(system)
        if not system.missing_commands():  # else the line above says what to fix first
            for pool, pool_site in _pools(site):
                yield f"{system.queue_word}{pool}", _queue(system, f"{system.queue_word}{pool}", pool_site, site)
            yield "dask-mpi ranks", lambda: _rank_launch(system, site)
    yield "python", lambda: site_python(site, env)
    yield "interface", lambda: interface(site)
    yield "run directory", lambda: run_directory(site)
    yield "results directory", lambda: results_directory(site)
    yield "prefect server", api or (lambda: prefect_server(env))
    if any(s.node.gpus for _, s in _pools(site)):
        yield "gpu library", lambda: gpu_libraries(site)


def _queue(batch: BatchSystem, name: str, pool: Site, site: Site) -> Step:
    return lambda: Check.of(name, batch.check_queue(pool.queue, site_file(site)))


def _pools(site: Site) -> list[tuple[str, Site]]:
    """(` (pool P)` or "", the pool's site): a jobqueue site's pools may each have their own queue."""
    pools = site.pool_sites()
    if len(pools) == 1:
        return [("", site)]
    return [(f" (pool {name.rsplit('.', 1)[-1]})", s) for name, s in pools.items()]


def batch_commands(batch: BatchSystem) -> Check:
    missing = batch.missing_commands()
    if missing:
        return Check.fail("batch commands", f"{', '.join(missing)} not found on PATH",
                          f"load the {batch.name} client (`module load {batch.name}`?) or run doctor where "
                          f"{missing[0]} works")
    return Check("batch commands", ", ".join(batch.commands))


def _rank_launch(batch: BatchSystem, site: Site) -> Check | None:
    finding = batch.rank_launch(site, site_file(site))
    return None if finding is None else Check.of("dask-mpi ranks", finding)


def site_python(site: Site, env: Mapping[str, str],
                run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run) -> Check:
    """The job's interpreter, started as the job starts it (after the site's setup lines), has hpc-garage,
    Prefect and distributed at this one's versions: the job runs `run`, COMMAND and the workers with it."""
    from hpc_garage.schedulers.base import submit_env

    python = os.path.expanduser(site.python) if site.python else sys.executable
    script = "\n".join(["#!/bin/bash", *site.setup, f"exec {shlex.quote(python)} -c {shlex.quote(VERSIONS_CODE)}"])
    where = python + (" (after the site's setup lines)" if site.setup else "")
    with tempfile.TemporaryDirectory(prefix="hpc-garage-doctor-") as folder:  # a script, as in the job: $0 works
        path = Path(folder) / "python-check.sh"
        path.write_text(script + "\n")
        try:
            done = run(["bash", str(path)], capture_output=True, text=True, timeout=120, env=submit_env(env))
        except subprocess.TimeoutExpired:
            return Check.fail("python", f"{where} did not answer within 120 s",
                              f"check the setup lines and python in {site_file(site)}")
    lines = done.stdout.strip().splitlines()
    return judge_versions("python", where, _json(lines[-1]) if lines else None, versions(), python, site,
                          said=_last_line(done.stderr) or f"exit code {done.returncode}")


def judge_versions(name: str, where: str, found: dict[str, Any] | None, here: Mapping[str, str | None],
                   python: str, site: Site, said: str = "") -> Check:
    """The interpreter's versions against this one's: hpc-garage, Prefect, distributed must agree."""
    mine = here.get("hpc-garage")
    if found is None:
        if "No module named" in said and "hpc_garage" in said:
            return Check.fail(name, f"{where} has no hpc-garage ({said})",
                              f"install it there: `{python} -m pip install hpc-garage=={mine}`, or set python "
                              f"in {site_file(site)}")
        return Check.fail(name, f"{where} does not run ({said})",
                          f"set python in {site_file(site)} to an interpreter with hpc-garage {mine}")
    differ = [f"{pkg} {found.get(pkg) or 'missing'} (here {want})" for pkg, want in here.items()
              if found.get(pkg) != want]
    if differ:
        return Check.fail(name, f"{where} has {', '.join(differ)}",
                          f"install the same versions there: `{python} -m pip install "
                          + " ".join(f"{pkg}=={want}" for pkg, want in here.items() if want) + "`")
    return Check(name, f"{where} has " + ", ".join(f"{pkg} {found.get(pkg)}" for pkg in here) + ", as here")


def interface(site: Site, names: Callable[[], list[str]] | None = None) -> Check | None:
    """The site's network interface exists here. Login nodes may lack the compute nodes' fabric, so where
    jobs run elsewhere a missing one is a note (`--job` checks on a compute node)."""
    if not site.interface:
        return None
    have = names() if names is not None else [n for _, n in socket.if_nameindex()]
    if site.interface in have:
        return Check("interface", f"{site.interface} exists here")
    found = f"{site.interface} does not exist on this node (it has {', '.join(have)})"
    from hpc_garage.schedulers import get

    if not get(site.scheduler).takes_jobs:  # its jobs run here: the interface must be here too
        return Check.fail("interface", found, f"set interface in {site_file(site)} to one of them")
    return Check.note("interface", f"{found}; compute nodes may have it: `hpc-garage doctor --job` checks there")


def run_directory(site: Site) -> Check:
    """Where `submit` writes each job's run directory (created on first use)."""
    from hpc_garage.rundir import RunRoot

    return writable("run directory", RunRoot.of_site(site).path,
                    f"set run_directory in {site_file(site)} to a directory you can write, on storage every "
                    "node shares")


def results_directory(site: Site) -> Check:
    """Where sweeps keep their results: the site's results_directory must exist (the default one is made)."""
    from hpc_garage.sweeps import check_results_root, results_key, results_root

    root = results_root(site.results_directory, site.run_directory)
    try:
        check_results_root(root, given=bool(site.results_directory), where=results_key(site))
    except UserError as exc:  # one line that holds its fix
        return Check.fail("results directory", str(exc))
    return writable("results directory", root,
                    f"set results_directory in {site_file(site)} to a directory you can write, on storage "
                    "every node shares")


def writable(name: str, path: Path, fix: str) -> Check:
    """A file can be created in `path`, or in the nearest existing folder above it (which hpc-garage fills)."""
    target = path
    while not target.exists() and target != target.parent:
        target = target.parent
    if not target.is_dir():
        return Check.fail(name, f"{target} is not a directory", fix)
    try:
        with tempfile.NamedTemporaryFile(dir=target, prefix=".hpc-garage-doctor-"):
            pass
    except OSError as exc:
        return Check.fail(name, f"cannot write in {target} ({exc.strerror or exc})", fix)
    return Check(name, f"{path} is writable" if target == path else f"{path} will be created in {target}")


def prefect_server(env: Mapping[str, str], timeout: float = 120.0) -> Check:
    """The Prefect API a run would use answers: the user's (PREFECT_API_URL, or the active profile's), else
    hpc-garage's managed server, started if it is not running (it stops itself once idle)."""
    from hpc_garage.prefect.server import configured_api_url, ensure_api, server_status

    if url := configured_api_url(env):
        said = _health({**{k: v for k, v in env.items() if k.startswith("PREFECT_API_")}, "PREFECT_API_URL": url})
        if said is not None:
            return Check.fail("prefect server", f"PREFECT_API_URL={url} does not answer ({said})",
                              "start that server, or unset PREFECT_API_URL to let hpc-garage run its own")
        return Check("prefect server", f"PREFECT_API_URL={url} answers")
    running = server_status().get("healthy")
    started = time.monotonic()
    try:
        api = ensure_api(env=env, timeout=timeout)
    except UserError as exc:
        return Check.fail("prefect server", f"hpc-garage's Prefect server does not start: {exc}",
                          f"read {server_status().get('log')}; `hpc-garage server status` says more")
    how = "was running" if running else f"started in {time.monotonic() - started:.1f} s; it stops when idle"
    return Check("prefect server", f"hpc-garage's server answers at {api.get('PREFECT_API_URL')} ({how})")


def _health(api: Mapping[str, str], timeout: float = 10.0) -> str | None:
    """None when the API answers /health (any answer: auth is Prefect's business), else why not."""
    from hpc_garage.prefect_api import PrefectApi

    client = PrefectApi.from_env(api, timeout=timeout)
    assert client is not None
    try:
        answer = client.answer("GET", "/health")
    except (OSError, ValueError) as exc:
        return str(getattr(exc, "reason", None) or exc)
    return None if answer.status < 500 else f"HTTP {answer.status}"


def gpu_libraries(site: Site) -> Check:
    """Which GPU library this Python can read (the report's GPU figures come from it); informative."""
    _, text = gpu_library(site.node.gpu_vendor)
    return Check.note("gpu library", f"{site.node.gpu_vendor}: {text}")


def _json(line: str) -> dict[str, Any] | None:
    try:
        data = json.loads(line)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""
