"""Inside the doctor's job: COMMAND under `hpc-garage run`, it looks at the allocation from inside.

It writes what it finds to `doctor.json` in the job's run directory as it goes (atomically, after each
step), so that a job whose workers never come still tells what it saw before: the Python's versions, the
results directory as this node sees it, the interface. It judges nothing: `doctor/job.py` does, on the
login node, where the expected versions and the token it wrote are known. Run as
`python jobscripts/doctor_probe.py --site SITE --token TOKEN` (the job's SCRIPT) or `python -m
hpc_garage.doctor probe ...`. The functions the workers run (`worker_facts`, `rank_facts`) are light: Dask
imports this module in every worker.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

TOKEN_PREFIX = ".hpc-garage-doctor-"  # in the results directory: <prefix><token>, and the job's <...>.reply
REPLY_SUFFIX = ".reply"
VERSIONED = ("hpc-garage", "prefect", "distributed")  # the packages whose versions must agree with the login node
GPU_LIBRARIES = {"nvidia": ("pynvml", "nvidia-ml-py"), "amd": ("amdsmi", "amdsmi")}  # as gpu_sampler reads them


def versions() -> dict[str, str | None]:
    """hpc-garage's, Prefect's and distributed's versions in this Python (None: not installed)."""
    import importlib.metadata

    from hpc_garage._version import __version__

    found: dict[str, str | None] = {}
    for name in VERSIONED:
        try:
            found[name] = __version__ if name == "hpc-garage" else importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


# The same, for another interpreter (the site's `python`), which may have no hpc-garage or an old one.
VERSIONS_CODE = """import importlib.metadata as m, json
def v(name):
    try:
        return m.version(name)
    except Exception:
        return None
found = {name: v(name) for name in %r}
import hpc_garage
found["hpc-garage"] = hpc_garage.__version__
print(json.dumps(found))
""" % (VERSIONED,)


def gpu_library(vendor: str, ids: list[str] | None = None) -> tuple[bool, str]:
    """Whether this process can read its GPUs' figures (NVML through nvidia-ml-py, or amdsmi), in words."""
    import importlib
    import importlib.metadata

    if vendor not in GPU_LIBRARIES:
        return False, f"hpc-garage reads no {vendor} GPU library (only NVML and amdsmi): no GPU figures in reports"
    module, package = GPU_LIBRARIES[vendor]
    try:
        lib = importlib.import_module(module)
    except ImportError:
        return False, f"{package} is not installed: no GPU figures in reports (`pip install {package}`)"
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        package = f"{package} {importlib.metadata.version(package)}"
    try:
        if vendor == "nvidia":
            lib.nvmlInit()
            try:
                count = lib.nvmlDeviceGetCount()
            finally:
                lib.nvmlShutdown()
        else:
            lib.amdsmi_init()
            try:
                count = len(lib.amdsmi_get_processor_handles())
            finally:
                lib.amdsmi_shut_down()
    except Exception as exc:  # noqa: BLE001 - no driver, no device: what the library says is the answer
        said = " ".join(str(exc).split()) or type(exc).__name__
        return False, f"{package} imports but cannot read GPUs here ({said})"
    seen = f"; this process sees {','.join(ids)}" if ids else ""
    return True, f"{package} reads {count} GPU{'s' if count != 1 else ''}{seen}"


# ------------------------------------------------------------------------------------ what workers run


def worker_facts(vendor: str, token_file: str, dask_worker: Any = None) -> dict[str, Any]:
    """One worker's view: its node, the GPUs its environment pins it to, its GPU library, the token."""
    from hpc_garage.launchers.topology import worker_gpu_ids
    from hpc_garage.schedulers import node_name

    ids = list(worker_gpu_ids(vendor, os.environ))
    readable, library = gpu_library(vendor, ids)
    return {"name": str(getattr(dask_worker, "name", "")), "host": node_name(os.environ), "pid": os.getpid(),
            "gpus": ids, "library": {"ok": readable, "text": library}, "token_seen": _token(Path(token_file))}


def rank_facts(dask_worker: Any = None) -> dict[str, Any]:
    """In a dask-mpi rank (the worker's Nanny runs in it): whether MPI is initialised, its rank and size.
    mpi4py initialises MPI when `mpi4py.MPI` is imported: a rank where it was not imported is not asked."""
    from hpc_garage.schedulers import node_name

    here = {"name": str(getattr(dask_worker, "name", "")), "host": node_name(os.environ), "pid": os.getpid()}
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return {**here, "initialised": False, "why": "mpi4py.MPI was never imported in this process"}
    try:
        return {**here, "initialised": bool(mpi.Is_initialized()), "rank": mpi.COMM_WORLD.Get_rank(),
                "size": mpi.COMM_WORLD.Get_size()}
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the doctor judges it
        return {**here, "initialised": False, "why": f"{type(exc).__name__}: {exc}"}


def _token(path: Path) -> str | None:
    """The token file's text, or None where this process cannot see it."""
    try:
        return path.read_text().strip()
    except OSError:
        return None


# --------------------------------------------------------------------------------------------- the probe


class Stopped(Exception):
    """`hpc-garage run` ended COMMAND (its workers did not come up)."""


class Findings:
    """doctor.json, rewritten whole after each step."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"started": time.time()}

    def __call__(self, **found: Any) -> None:
        from hpc_garage.files import write_private

        self.data |= found
        write_private(self.path, json.dumps(self.data, indent=2))


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Look, write doctor.json, exit 0 once everything could be looked at (the doctor judges what was seen)."""
    parser = argparse.ArgumentParser(prog="hpc-garage doctor probe")
    parser.add_argument("--site", required=True)
    parser.add_argument("--token", required=True)
    args = parser.parse_args(argv)
    env = os.environ if env is None else env
    from hpc_garage.schedulers import node_name
    from hpc_garage.rundir import RunDir
    from hpc_garage.variables import RUN_DIR_ENV

    if not env.get(RUN_DIR_ENV):
        print("hpc-garage doctor probe: run it under `hpc-garage run` (no run directory)", file=sys.stderr)
        return 2

    def stop(signum: int, frame: Any) -> None:
        raise Stopped(f"`hpc-garage run` stopped the probe with signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    found = Findings(RunDir(Path(env[RUN_DIR_ENV])).doctor_file)
    found(host=node_name(env), python=sys.executable, versions=versions())
    from hpc_garage.sites import load_site
    from hpc_garage.sweeps import results_root

    site = load_site(args.site)
    root = results_root(site.results_directory, site.run_directory)
    token_file = root / f"{TOKEN_PREFIX}{args.token}"
    found(results=_results(token_file, args.token), interface=_interface(site.interface))
    found(expected=_expected(site, env))
    return _cluster(site, token_file, found)


def _results(token_file: Path, token: str) -> dict[str, Any]:
    """Whether the token the login node wrote is here, and whether this node can write back beside it."""
    seen = _token(token_file)
    wrote, why = False, None
    if seen == token:
        try:
            from hpc_garage.files import write_private

            write_private(token_file.with_name(token_file.name + REPLY_SUFFIX), socket.gethostname())
            wrote = True
        except OSError as exc:
            why = exc.strerror or str(exc)
    return {"root": str(token_file.parent), "exists": token_file.parent.is_dir(), "seen": seen == token,
            "wrote": wrote, "write_error": why}


def _interface(name: str | None) -> dict[str, Any] | None:
    if not name:
        return None
    have = [n for _, n in socket.if_nameindex()]
    return {"name": name, "present": name in have, "have": have}


def _expected(site: Any, env: Mapping[str, str]) -> dict[str, Any]:
    """The workers `run` lays out for this allocation, with the GPU ids each must be pinned to on this node."""
    from hpc_garage.core.errors import UserError

    if site.launcher == "jobqueue":
        return {"workers": None, "why": "worker jobs: their GPUs are their own jobs'"}
    try:
        from hpc_garage.core.layout import layout
        from hpc_garage.schedulers import allocation_from_env

        allocation = allocation_from_env(site, env)
        workers = layout(site, allocation).workers
    except UserError as exc:
        return {"workers": None, "why": str(exc)}
    job_gpus = list(allocation.nodes[0].gpus)
    return {"job_gpus": job_gpus, "host": allocation.nodes[0].host,
            "workers": {w.name: {"node": w.node, "gpus": [job_gpus[i] for i in w.gpu_slots] if w.node == 0 else None,
                                 "slots": len(w.gpu_slots)} for w in workers}}


def _cluster(site: Any, token_file: Path, found: Findings) -> int:
    """Wait for the workers as a flow would (the scheduler file), then ask each of them, and each rank."""
    from hpc_garage.cluster.handoff import handoff_from_env, workers_now
    from hpc_garage.core.errors import UserError

    started = time.monotonic()
    try:
        handoff = handoff_from_env()
    except (UserError, Stopped) as exc:
        found(workers={"error": f"the workers did not come up ({exc})", "waited": time.monotonic() - started})
        return 1
    if handoff is None:
        found(workers={"error": "no scheduler file: the probe does not run under `hpc-garage run`"})
        return 1
    from distributed import Client

    with Client(handoff.address, security=handoff.security(), timeout=60) as client:
        names = sorted(str(w.get("name")) for w in workers_now(client).values())
        found(workers={"expected": handoff.workers, "registered": names, "waited": time.monotonic() - started})
        facts = client.run(worker_facts, site.node.gpu_vendor, str(token_file))
        found(worker_facts=list(facts.values()))
        if site.mpi.launch == "dask-mpi" and site.launcher != "jobqueue":
            ranks = client.run(rank_facts, nanny=True, on_error="return")
            found(mpi=[r if isinstance(r, dict) else {"initialised": False, "why": repr(r)} for r in ranks.values()])
    found(finished=time.time())
    return 0

