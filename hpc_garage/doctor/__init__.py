"""`hpc-garage doctor`: check a site before its first real job, one line per check.

A site file is written once, by hand, and its mistakes (a partition that does not exist, dask-mpi ranks
that srun starts without PMI, a Python without hpc-garage, results on storage the compute nodes do not see)
otherwise show up only as a job that fails after waiting in the queue. `checks.py` asks what can be asked
here, on the login node; with `--job`, `job.py` submits one short job whose COMMAND is `probe.py`, which
looks from inside the allocation and leaves its findings in the job's run directory for `job.py` to judge.

This package is imported by the probe's workers (Dask runs `probe.py`'s functions there): keep it light.
"""

from __future__ import annotations

from collections.abc import Callable

EXIT_OK, EXIT_FAILED = 0, 1  # and 2, as every command, for bad input (an unknown site): a UserError


def doctor(site_name: str, *, job: bool, echo: Callable[[str], None], say: Callable[[str], None]) -> int:
    """Print one line per check (`echo`), progress on the side (`say`); 0 when nothing failed, else 1.
    With `job`, the probe job is submitted only once every check here has passed."""
    from hpc_garage.doctor.checks import preflight
    from hpc_garage.sites import load_site

    site = load_site(site_name)
    if job:
        from hpc_garage.doctor.job import probe_site

        probe_site(site)
    failed = 0
    for check in preflight(site):
        echo(check.line())
        failed += check.failed
    if site.container is not None:  # the image the job runs in (doctor/container.py)
        import os

        from hpc_garage.doctor.checks import guarded
        from hpc_garage.doctor.container import container_check

        if (found := guarded("container", lambda: container_check(site, os.environ))) is not None:
            echo(found.line())
            failed += found.failed
    if job and failed:
        say(f"doctor: no job submitted: fix the {'problem' if failed == 1 else f'{failed} problems'} above first")
    elif job:
        from hpc_garage.doctor.job import job_checks

        for check in job_checks(site, say):
            echo(check.line())
            failed += check.failed
    say(f"doctor: {'all checks passed' if not failed else f'{failed} check(s) failed'} (site {site.name})")
    return EXIT_FAILED if failed else EXIT_OK
