"""What every benchmark shares: a measured figure and its statistics, the machine, processes, SLURM jobs."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"
# the interpreter of the environment hpc-garage runs in, as it was started: never realpath()'d (a venv's python
# is a link to its base interpreter, which lacks the venv's packages)
PYTHON = sys.executable
BIN = Path(sys.executable).parent  # console scripts installed beside it (hpc-garage, dask-mpi)


@dataclass
class Figure:
    """One measured quantity: every run's value, and what it is compared with.

    `ours` marks hpc-garage's figure in its group; ratios are ours / peer, medians of the same run.
    """

    group: str  # e.g. "start-up, 1 node x 4 workers: job running -> all workers registered"
    label: str  # who: "hpc-garage mpi launcher", "dask-mpi CLI + Client(scheduler_file)"
    unit: str  # "s" or "tasks/s"
    values: list[float] = field(default_factory=list)
    ours: bool = False
    higher_is_better: bool = False
    goal: str = ""  # in words, e.g. "<= 0.8x the best peer"
    met: bool | None = None
    note: str = ""
    ratios: dict[str, float] = field(default_factory=dict)

    @property
    def median(self) -> float | None:
        return statistics.median(self.values) if self.values else None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["median"] = self.median
        out["min"] = min(self.values) if self.values else None
        out["max"] = max(self.values) if self.values else None
        return out


def compare(figures: list[Figure], goal: str, check: Callable[[Figure, list[Figure]], bool | None]) -> None:
    """Fill in each of our figures' ratios to its group's peers and whether `check(ours, peers)` holds."""
    for ours in (f for f in figures if f.ours):
        peers = [f for f in figures if f.group == ours.group and not f.ours and f.median]
        ours.ratios = {p.label: ours.median / p.median for p in peers if ours.median is not None}
        ours.goal = goal
        ours.met = check(ours, peers) if ours.median is not None and peers else None


def ratio_to_best(ours: Figure, peers: list[Figure]) -> float:
    best = max(p.median for p in peers) if ours.higher_is_better else min(p.median for p in peers)
    return ours.median / best


# ------------------------------------------------------------------------------------------- machine


def machine() -> dict[str, Any]:
    """What the figures were measured on: they mean little without it."""
    cpu = "unknown"
    with _quiet(OSError):
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    versions = {}
    for name in ("hpc-garage", "prefect", "prefect-dask", "distributed", "dask-jobqueue", "dask-mpi", "mpi4py"):
        with _quiet(Exception):
            from importlib.metadata import version

            versions[name] = version(name)
    slurm = _output(["sinfo", "--version"]) or "not installed"
    nodes = _output(["sinfo", "-h", "-N", "-o", "%N %P %c %m %G"]) or ""
    mpi = (_output(["mpirun", "--version"]) or "").splitlines()[:1]
    return {
        "cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(memory / 2**30, 1),
        "os": platform.platform(), "python": platform.python_version(), "interpreter": PYTHON,
        "packages": versions, "slurm": slurm, "slurm_nodes": sorted(set(nodes.splitlines())),
        "mpi": mpi[0] if mpi else "not installed",
        "load_average_at_start": os.getloadavg()[0],
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def _output(argv: list[str]) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


@contextmanager
def _quiet(*kinds: type[BaseException]) -> Iterator[None]:
    try:
        yield
    except kinds:
        pass


# ---------------------------------------------------------------------------------------- processes


def say(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_idle(pid: int, *, below: float = 0.15, window: float = 0.5, timeout: float = 30) -> None:
    """Wait until a process (e.g. the Prefect server catching up on events) uses < `below` of a core."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            before = cpu_seconds(pid)
        except OSError:
            return
        time.sleep(window)
        with _quiet(OSError):
            if (cpu_seconds(pid) - before) / window < below:
                return


def read_json_when_ready(path: Path, timeout: float, alive: Callable[[], bool] = lambda: True,
                         check_every: float = 1.0) -> dict[str, Any]:
    """The JSON object at `path` once it is there and whole; gives up early when `alive()` turns false.

    The file is looked at every 20 ms (a stat); `alive` (e.g. an `squeue`) only every `check_every` s, so that
    polling costs no CPU worth speaking of while the measured start-up runs on this host's cores.
    """
    deadline = time.monotonic() + timeout
    next_check = time.monotonic() + check_every
    while time.monotonic() < deadline:
        if path.exists():
            with _quiet(ValueError):
                return dict(json.loads(path.read_text()))
        if time.monotonic() >= next_check:
            if not alive():
                raise TimeoutError(f"{path} did not appear: what was to write it has ended")
            next_check = time.monotonic() + check_every
        time.sleep(0.02)
    raise TimeoutError(f"{path} did not appear within {timeout:.0f} s")


class Phases:
    """Where a benchmark's wall time goes: seconds by phase, summed over its runs (reported in the Details)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - start

    def to_dict(self) -> dict[str, float]:
        return {k: round(v, 1) for k, v in self.seconds.items()}

    def since(self, before: dict[str, float]) -> str:
        """The phases' seconds since the snapshot `before` (a copy of `seconds`), for a log line."""
        return ", ".join(f"{k} {v - before.get(k, 0):.1f} s" for k, v in self.seconds.items() if v > before.get(k, 0))


BENCH_TMP = Path(os.environ.get("HPC_GARAGE_BENCH_TMP") or Path.home() / ".cache" / "hpc-garage-bench")


def scratch(prefix: str) -> Path:
    """A directory every fake node can see (they share this host)."""
    BENCH_TMP.mkdir(parents=True, exist_ok=True, mode=0o700)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=BENCH_TMP))


# -------------------------------------------------------------------------------------------- SLURM


def outside_job_env(also: tuple[str, ...] = ()) -> dict[str, str]:
    """This environment as a login shell's (no job's SLURM_*/PBS_*, no HPC_GARAGE_*), SLURM_CONF kept: it
    names the cluster this bench uses (the CI runs the quick bench on a second local SLURM)."""
    return {k: v for k, v in os.environ.items()
            if k == "SLURM_CONF" or not k.startswith(("SLURM", "PBS_", "HPC_GARAGE", *also))}


def slurm_problem() -> str | None:
    if not shutil.which("sbatch"):
        return "sbatch is not installed (scripts/local-slurm up)"
    out = _output(["sinfo", "-h", "-o", "%T"])
    if out is None:
        return "no SLURM controller answers (scripts/local-slurm up)"
    return None


class Jobs:
    """The SLURM jobs this bench submitted: waited for, and cancelled (only these) if left behind."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def sbatch(self, script: Path, *extra: str, env: dict[str, str] | None = None) -> str:
        done = subprocess.run(["sbatch", "--parsable", *extra, str(script)], capture_output=True, text=True,
                              cwd=script.parent, env=env, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch {script.name}: {done.stderr.strip()}")
        job = done.stdout.strip().split(";")[0]
        self.ids.append(job)
        return job

    def adopt(self, text: str) -> str:
        """Remember a job another command submitted (its id in `text`)."""
        match = re.search(r"submitted job (\d+)", text)
        if not match:
            raise RuntimeError(f"no job id in: {text!r}")
        self.ids.append(match.group(1))
        return match.group(1)

    def wait_gone(self, job: str, timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = _output(["scontrol", "show", "job", "-o", job]) or ""
            state = m.group(1) if (m := re.search(r"JobState=(\S+)", out)) else ""
            if not state or state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
                return state
            time.sleep(0.2)
        self.cancel([job])
        raise TimeoutError(f"job {job} still running after {timeout:.0f} s (cancelled)")

    def end(self, job: str) -> None:
        """The figure is taken: kill the job's processes now (SIGKILL, every step and the batch script) rather
        than let it tear down: a plain scancel sends SIGTERM and waits KillWait for clean exits, which nobody
        measures (and which hpc-garage's `run`, finishing its flow first, uses in full). Same for every contender."""
        subprocess.run(["scancel", "--signal=KILL", "--full", job], capture_output=True, timeout=30)
        self.cancel([job])
        self.wait_gone(job, timeout=60)

    def cancel(self, jobs: Sequence[str] | None = None) -> None:
        """scancel these (default: every job this bench submitted); one already gone is only a message."""
        targets = list(jobs if jobs is not None else self.ids)
        if targets:
            subprocess.run(["scancel", *targets], capture_output=True, timeout=30)

    @staticmethod
    def queued(job: str) -> bool:
        """Whether the job is still in the queue (pending, running or completing)."""
        return bool((_output(["squeue", "-h", "-j", job, "-o", "%T"]) or "").strip())


def wait_for_free_nodes(timeout: float = 120) -> None:
    """Benchmarks need the whole (2-node) cluster: wait until nothing else runs on it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not (_output(["squeue", "-h", "-o", "%i"]) or "").split():
            return
        time.sleep(0.2)
    say("warning: other jobs still hold the local SLURM; start-up figures include their contention")


@contextmanager
def prefect_and_cluster(workers: int = 2, threads: int = 1,
                        phase: Callable[[], Any] | None = None) -> Iterator[tuple[dict[str, Any], int]]:
    """hpc-garage's Prefect server, exported to this process, and a Dask cluster in a process of its own
    (scripts/cluster.py, stopped after): the cluster's info (its "address") and the server's pid, the server
    itself, not its keeper (for `wait_idle`). `phase()`: a context that times the bring-up (Phases)."""
    import contextlib

    from hpc_garage.prefect.server import ensure_api, server_status
    from hpc_garage.prefect.flow_api import use_api

    timed = phase or contextlib.nullcontext
    with timed():
        api = ensure_api()
    use_api(api)
    status = server_status()
    server_pid = int(status.get("server_pid") or status.get("pid") or 0)
    info_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-cluster-{os.getpid()}.json"
    cluster = subprocess.Popen([PYTHON, str(SCRIPTS / "cluster.py"), "--workers", str(workers), "--threads",
                                str(threads), "--out", str(info_file)], stdin=subprocess.PIPE, env={**os.environ, **api})
    try:
        with timed():
            info = read_json_when_ready(info_file, 120, alive=lambda: cluster.poll() is None)
        yield info, server_pid
    finally:
        assert cluster.stdin is not None
        cluster.stdin.close()
        try:
            cluster.wait(30)
        except subprocess.TimeoutExpired:
            cluster.kill()
        info_file.unlink(missing_ok=True)


def tasks_main(measure: Callable[[int, int], dict[str, Any]], argv: list[str] | None, tasks: int = 200) -> int:
    """The command line of a per-task benchmark: `--tasks N --runs R --out FILE`, the figures as JSON."""
    import argparse
    import json

    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=tasks)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    Path(args.out).write_text(json.dumps(measure(args.tasks, args.runs), indent=2))
    return 0


def on_against_bypassed(label: str, run: Callable[[bool, int], dict[str, Any]], contenders: dict[str, bool], n: int,
                        runs: int, server_pid: int) -> dict[str, list[dict[str, Any]]]:
    """A feature on against bypassed in one process: a warm-up of each, then `runs` rounds in alternating order
    (neither always first), each after the server has gone idle. `run(bypassed, count)` returns a sample with
    its `inner` seconds; the samples come back per contender."""
    for name, bypassed in contenders.items():  # warm-up: imports, the first flow run
        say(f"{label}: warm-up {name}")
        run(bypassed, min(n, 5))
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in contenders}
    for i in range(runs):
        order = list(contenders.items()) if i % 2 == 0 else list(contenders.items())[::-1]
        for name, bypassed in order:
            if server_pid:
                wait_idle(server_pid)
            sample = run(bypassed, n)
            samples[name].append(sample)
            say(f"{label} run {i + 1}/{runs}: {name}: {n / sample['inner']:.1f} tasks/s")
    return samples
