"""Test sessions on other versions than the interpreter's own. `bash scripts/test` stays the one entry point: under
CI it runs `oldest` beside its main run (which is on the newest verified versions: it upgrades them).

    nox -s oldest   the fast tests, then one real SLURM sweep, on the OLDEST versions hpc-garage is verified on: the
                    lower bound of each range in hpc_garage/compat/'s VERIFIED (Prefect, prefect-dask,
                    distributed and so dask, dask-jobqueue; tests/test_compat.py holds pyproject.toml's equal)
    nox -s newest   the same on the newest releases inside those ranges

Each session has a virtual environment of its own (.nox/NAME) that sees the interpreter's packages
(--system-site-packages) and installs only what differs, with a constraints file written from those ranges
into it: ~30 s the first time, a few seconds when reused. `nox -s oldest -- fast` runs the fast tests alone,
`-- sweep` the sweep alone (either with more pytest arguments after it), `-- PYTEST ARGS` those tests instead.
Everything the tests start in Python (the server keeper, node processes, job scripts) runs the session's
interpreter, so the SLURM sweep's job runs on the oldest versions too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from hpc_garage.compat import VERIFIED  # noqa: E402  (standard library only; equal to pyproject.toml's bounds)

# one real sweep on the local SLURM: `submit`, the job script, two nodes of two GPUs, the managed Prefect server,
# the task runner's fast path and placement, the job's own interpreter (the session's)
SWEEP = "tests/test_e2e.py::test_two_nodes_two_gpus_each_run_experiments_on_both"
PYTEST = ["python", "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider"]

nox.options.sessions = ["oldest"]
nox.options.reuse_existing_virtualenvs = True  # what the constraints change is reinstalled (pip, below)


def verified_ranges() -> dict[str, tuple[str, str]]:
    """The ranges verified: compat.VERIFIED, and dask, which moves with distributed (pyproject.toml)."""
    return {**VERIFIED, "dask": VERIFIED["distributed"]}


def _run_tests(session: nox.Session, constraints: list[str], *upgrade: str) -> None:
    file = Path(session.virtualenv.location) / "constraints.txt"
    file.write_text("".join(f"{line}\n" for line in constraints))
    session.install(*upgrade, "-c", str(file), "-e", ".[test]", *constraints)
    session.run("python", "-m", "hpc_garage", "--version")
    args = list(session.posargs)
    part = args.pop(0) if args[:1] in (["fast"], ["sweep"]) else None  # scripts/test runs the two apart
    if args and part is None:
        session.run(*PYTEST, *args)
        return
    if part in (None, "fast"):
        session.run(*PYTEST, "-m", "not slow and not slurm", *args)
    if part in (None, "sweep"):
        session.run(*PYTEST, *args, SWEEP)


@nox.session(venv_backend="venv", venv_params=["--system-site-packages"])
def oldest(session: nox.Session) -> None:
    """The fast tests and one SLURM sweep on each verified range's lowest version."""
    _run_tests(session, [f"{name}=={low}" for name, (low, _) in verified_ranges().items()])


@nox.session(venv_backend="venv", venv_params=["--system-site-packages"])
def newest(session: nox.Session) -> None:
    """The same on the newest release inside each verified range."""
    _run_tests(session, [f"{name}>={low},<{high}" for name, (low, high) in verified_ranges().items()], "--upgrade")
