"""(issue 32) Sweeps as big as the allocation: N trivial tagged trials in one flow under `hpc-garage run --site
local` (2 workers x 1 thread on this machine), written as a user writes them (bench/scale_flow.py), against raw
`Client.map` on the same workers, plain prefect-dask (at the smallest size: it is too slow beyond) and Prefect's
ThreadPoolTaskRunner (no cluster; at the middle size).

    python -m bench.scale --sizes 1000,10000,100000 --out scale.json
    python -m bench.scale --quick --out scale.json      # 200 trials, hpc-garage and Client.map: the bench works
    python -m bench.scale --sizes 100000 --contenders hpc-garage --store   # one row, stored in bench/results/runs/
    python -m bench.scale --sizes 100000 --contenders hpc-garage --site lab-cpu --nodes 2 --store   # a batch job

Each row is one `hpc-garage run` with a HOME of its own (so its own Prefect server and database, stopped after):
trials/s (the flow's first submission to its last result read; and to the flow's return, once Prefect's server
has recorded every trial: `trials_per_s_recorded`), the time per 1,000 trials at the start (the second
1,000: the first includes the workers' first imports) and at the end (the last 1,000), from the trials' own end
times; peak RSS summed by process kind (the scheduler = `run`'s process, the flow, the workers, the Prefect server
and its database) sampled every second; the server's CPU per trial over the flow's life; and how long
`hpc-garage status` and `hpc-garage status JOBID` take while the run runs (every 10 s, a fresh CLI each time);
and the server's database on disk once the server has stopped (issue 32: how it grows per 100,000 trials), with
the events its log says it dropped (Prefect's in-memory bus holds 10,000 a subscriber) and those it stored. A
failed row's job logs and its server log's end are kept in bench/results/failed/.
With --site (hpc-garage's row only), the same flow is a batch job: `hpc-garage submit --site SITE -N NODES --wait
bench/scale_flow.py N ...` on the local SLURM, its processes (each node's, on this one host) sampled the same way.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import statistics
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import BIN, PYTHON, ROOT, Figure, compare, machine, say

STEP = 1000
PROBE_SECONDS = 10.0  # how often StatusProbe asks `hpc-garage status` while a run runs
KINDS = {"hpc-garage": "hpc-garage task_runner()", "dask": "raw Client.map, same workers",
         "prefect-dask": "plain prefect-dask DaskTaskRunner, same workers",
         "threads": "Prefect ThreadPoolTaskRunner(2), no cluster"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000", help="trial counts (hpc-garage and raw Client.map)")
    parser.add_argument("--quick", action="store_true", help="200 trials, hpc-garage and raw Client.map only")
    parser.add_argument("--runs", type=int, default=1, help="ignored: each size is one run (minutes each)")
    parser.add_argument("--contenders", default=",".join(KINDS), help=f"of {', '.join(KINDS)} (comma-separated)")
    parser.add_argument("--out", type=Path, help="the section as JSON (python -m bench reads it)")
    parser.add_argument("--store", action="store_true", help="store it in bench/results/runs/ as python -m bench does")
    parser.add_argument("--site", help="hpc-garage's row as a batch job of this site (`submit --wait`), not `run`")
    parser.add_argument("--nodes", type=int, default=1, help="the batch job's nodes (with --site)")
    parser.add_argument("--ui", action="store_true", help="then open hpc-garage's flow run in chromium (its "
                        "page and Task Runs tab, timed, a screenshot in bench/results/) before the server stops")
    parser.add_argument("--worker-profiler", action="store_true", help="Dask's worker profiler on, as a user's "
                        "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED=True turns it on (hpc-garage turns it off)")
    args = parser.parse_args(argv)
    if args.worker_profiler:
        os.environ["DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED"] = "True"  # every row's `run` passes it on
    wanted = args.contenders.split(",")
    if not (args.out or args.store) or set(wanted) - set(KINDS):
        parser.error(f"--contenders {args.contenders}: of {', '.join(KINDS)}; and --out FILE or --store")
    if args.site and wanted != ["hpc-garage"]:
        parser.error(f"--site {args.site}: give --contenders hpc-garage (the peers run under `run --site local`)")
    began, about = time.monotonic(), machine()
    sizes = [200] if args.quick else [int(s) for s in args.sizes.split(",")]
    rows = [(kind, n) for n in sizes for kind in ("hpc-garage", "dask")]
    if not args.quick:  # each row is a run of its own (a cluster, a server): --quick keeps two
        rows.insert(2, ("prefect-dask", sizes[0]))
        rows.append(("threads", sizes[min(1, len(sizes) - 1)]))
    job = Job(args.site, args.nodes) if args.site else None
    found = [measure(kind, n, ui=args.ui and kind == "hpc-garage", job=job) for kind, n in rows if kind in wanted]
    if args.out:
        args.out.write_text(json.dumps(section(found), indent=2) + "\n")
    if args.store:
        from bench.report import store_run, write_index

        command = " ".join(["python -m bench.scale", *(argv if argv is not None else sys.argv[1:])])
        store_run(ROOT / "bench" / "results", "scale", section(found) | {"seconds": round(time.monotonic() - began)},
                  about, command, os.getloadavg()[0], 1, args.quick)
        write_index(ROOT / "bench" / "results")
    return 0 if all(r.get("right") for r in found) else 1


@dataclass(frozen=True)
class Job:
    """hpc-garage's row as a batch job: `submit --site SITE -N NODES --wait` instead of `run --site local`."""

    site: str
    nodes: int

    def argv(self, flow: list[str]) -> list[str]:
        return [str(BIN / "hpc-garage"), "submit", "--site", self.site, "-N", str(self.nodes), "--time", "01:00:00",
                "--wait", str(ROOT / "bench" / "scale_flow.py"), *flow]

    def says(self) -> str:
        return f"`hpc-garage submit --site {self.site} -N {self.nodes}`, the local SLURM"


def measure(kind: str, n: int, ui: bool = False, job: Job | None = None) -> dict[str, Any]:
    """One row: `hpc-garage run --site local -- python -m bench.scale_flow N` in a HOME of its own (or `job`'s
    submit); with `ui`, the flow run's page in chromium once the run has ended (bench/ui_at_size.py)."""
    from hpc_garage.prefect.server.postgres import database_choice

    database = database_choice(os.environ)  # HPC_GARAGE_PREFECT_DATABASE, as `run` reads it
    said = {"kind": kind, "n": n, "database": database.label(), **({"job": job.says()} if job else {}),
            **({"worker_profiler": True} if os.environ.get("DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED") else {})}
    say(f"scale: {kind}, {n:,} trials" + (f", Prefect's database {database.label()}" if kind == "hpc-garage" else ""))
    with tempfile.TemporaryDirectory(prefix="hpc-garage-bench-scale-") as home:
        out = Path(home) / "flow.json"
        env = {**os.environ, "HOME": home, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                                     os.environ.get("PYTHONPATH")]))}
        for name in ("PREFECT_API_URL", "PREFECT_HOME", "PREFECT_PROFILE", "HPC_GARAGE_SCHEDULER_FILE"):
            env.pop(name, None)
        started = time.monotonic()
        argv = [str(BIN / "hpc-garage"), "run", "--site", "local", "--", PYTHON, "-m", "bench.scale_flow", str(n),
                str(out), kind] if job is None else job.argv([str(n), str(out), kind])
        process = subprocess.Popen(argv, cwd=home, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   text=True)
        sampler = Sampler(process.pid, home)
        sampler.start()
        probe = StatusProbe(env, home) if kind == "hpc-garage" else None
        if probe is not None:
            probe.start()
        try:
            _, stderr = process.communicate()
            wall = time.monotonic() - started
            sampler.stop()  # the row's figures end with the run, before any browsing
            if probe is not None:
                probe.stop()
            seen = browse_run(env, n, database.kind) if ui and process.returncode == 0 else {}
        finally:
            sampler.stop()
            if probe is not None:
                probe.stop()
            process.kill()  # interrupted: nothing of this row outlives it (the server, below)
            subprocess.run([str(BIN / "hpc-garage"), "server", "stop", "--force"], env=env, cwd=home,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
        measured = {"peak_rss_mib": sampler.peak_mib(), "database_mib": database_mib(Path(home)),
                    **server_events(Path(home)), **({"status_s": probe.figures()} if probe is not None else {})}
        if process.returncode != 0 or not out.exists():
            kept = keep_logs(Path(home), f"{time.strftime('%Y%m%d-%H%M%S')}-scale-{kind}-{n}")
            say(f"scale: {kind} {n:,}: exit {process.returncode}: {stderr.strip().splitlines()[-1:]}; logs in {kept}")
            return {**said, "right": False, "error": f"exit code {process.returncode}", "logs": str(kept),
                    **measured}
        flow = json.loads(out.read_text())
    row = {**said, "right": flow["right"], "seconds": flow["seconds"], "run_seconds": round(wall, 1),
           "trials_per_s": round(n / flow["seconds"], 1), **per_thousand(flow["ends"], n), **measured,
           "server_cpu_ms_per_trial": sampler.server_cpu_ms(n), "cores_start_end": sampler.cores_by_kind(),
           **({"trials_per_s_recorded": round(n / flow["recorded_s"], 1)} if flow.get("recorded_s") else {}),
           **{k: flow[k] for k in ("limit", "peak_in_flight", "released", "recorded_s", "waited_for_server_s")
              if k in flow}, **seen}
    say(f"scale: {kind} {n:,}: {row['trials_per_s']} trials/s ({row.get('trials_per_s_recorded')} to the flow's "
        f"return, every trial recorded), per 1,000 {row['per_1000_start_s']} s → "
        f"{row['per_1000_end_s']} s, RSS {row['peak_rss_mib']} MiB, server {row['server_cpu_ms_per_trial']} ms/trial, "
        f"database {row['database_mib']} MiB on disk, events the server dropped {row.get('events_dropped')} "
        f"(stored {row.get('events_stored')})"
        + "".join(f", `status{' JOBID' if what == 'job' else ''}` median {statistics.median(xs):.2f} s, max "
                  f"{max(xs):.2f} s" for what, xs in (row.get("status_s") or {}).items()))
    return row


def browse_run(env: dict[str, str], n: int, database: str) -> dict[str, Any]:
    """The run's flow run in chromium, its server (on `database`: sqlite, postgresql) still up: seconds to its
    page and its Task Runs tab."""
    from bench.concurrent_sweeps import _post
    from bench.ui_at_size import browse, caught_up, managed_api

    try:
        api = managed_api(env)
        flow_run = _post(api, "/flow_runs/filter", {"limit": 1})[0]["id"]
        shot = Path("bench") / "results" / f"ui-scale-{database}-{n}.png"
        return {"ui": {"caught_up_s": caught_up(env)} | browse(api, flow_run, ROOT / shot) | {"screenshot": str(shot)}}
    except Exception as exc:  # noqa: BLE001 - a bench: the failure is the result
        return {"ui": {"error": f"{type(exc).__name__}: {exc}"[:500]}}


def database_mib(home: Path) -> float | None:
    """The server's database on disk under `home` (its server stopped): SQLite's prefect.db with its -wal and -shm
    files, or the PostgreSQL data directory (the one holding PG_VERSION nearest the top). None: neither found."""
    state = home / ".hpc-garage" / "prefect"
    files = list(state.glob("*/home/prefect.db*"))
    if marks := sorted(state.rglob("PG_VERSION"), key=lambda p: len(p.parts)):
        files += [p for p in marks[0].parent.rglob("*") if p.is_file()]
    return round(sum(p.stat().st_size for p in files) / 2**20, 1) if files else None


DROPPED = ("Subscription queue is full, dropping message", "Event queue full")  # Prefect's server, one line each
SAID_DROPPED = re.compile(r": (\d+) event\(s\) dropped since this was last said")  # serve.DroppedEvents' line


def server_events(home: Path) -> dict[str, int]:
    """What the stopped server under `home` kept of the events it was sent: the events its log says Prefect
    dropped (its in-memory bus holds 10,000 a subscriber; a line each, or hpc-garage's line a minute with their
    count), and the events its SQLite database holds."""
    import sqlite3

    found: collections.Counter[str] = collections.Counter()
    for server in servers_under(home):
        if server.log_file.is_file():
            with server.log_file.open(errors="replace") as lines:
                for line in lines:
                    if any(d in line for d in DROPPED):
                        said = SAID_DROPPED.search(line)
                        found["events_dropped"] += int(said[1]) if said else 1
        if (database := server.home / "prefect.db").is_file():
            with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as db:
                found["events_stored"] += db.execute("SELECT count(*) FROM events").fetchone()[0]
    return dict(found)


def keep_logs(home: Path, name: str) -> Path:
    """A failed row's job logs and the last 400 lines of its server's log, kept in bench/results/failed/NAME
    (its HOME goes with the row)."""
    kept = ROOT / "bench" / "results" / "failed" / name
    kept.mkdir(parents=True, exist_ok=True)
    for log in (home / ".hpc-garage" / "runs").glob("*.out"):
        shutil.copy(log, kept / log.name)
    for server in servers_under(home):
        if server.log_file.is_file():
            with server.log_file.open(errors="replace") as lines:
                tail = "".join(collections.deque(lines, maxlen=400))
            (kept / f"server-{server.path.name}.log").write_text(tail)
    return kept


def servers_under(home: Path) -> list[Any]:
    """The managed servers' directories (prefect/server/state.ServerDir: their paths' owner) under a row's HOME."""
    from hpc_garage.prefect.server.state import ServerDir

    return [ServerDir(path) for path in sorted((home / ".hpc-garage" / "prefect").glob("*")) if path.is_dir()]


def per_thousand(ends: list[float], n: int) -> dict[str, float | None]:
    """The time per 1,000 trials at the start (the second 1,000) and at the end (the last), from the trials' end
    times (seconds since the flow's start, sorted); with fewer than 2,000 trials, tenths scaled to 1,000."""
    ends = sorted(ends)
    step = STEP if n >= 2 * STEP else max(1, n // 10)
    if len(ends) < 2 * step:
        return {"per_1000_start_s": None, "per_1000_end_s": None}
    scale = STEP / step
    start = ends[2 * step - 1] - ends[step - 1]
    end = ends[-1] - ends[-1 - step]
    return {"per_1000_start_s": round(start * scale, 2), "per_1000_end_s": round(end * scale, 2)}


def kind_of(pid: int, root: int, cmdline: str) -> str:
    """Which part of a run a process is: `run` (the root, or the batch job's) holds the scheduler."""
    command = re.search(r"(?:hpc-garage|-m hpc_garage) (run|submit)\b", cmdline)
    words = cmdline.split()
    if command and command.group(1) == "submit" or words and Path(words[0]).name in ("srun", "mpiexec", "mpirun"):
        return "other"  # the bench's `submit --wait`, which follows the job; the launchers' step commands
    if pid == root or command:
        return "scheduler"
    if "scale_flow" in cmdline:
        return "flow"
    if "postgres" in cmdline:
        return "database"
    if "multiprocessing" in cmdline or "spawn_main" in cmdline or "hpc_garage.launchers." in cmdline:
        return "workers"  # the workers (and their forkserver); a batch job's node processes
    if "prefect" in cmdline and "server" in cmdline:  # the keeper and the server
        return "server"
    return "other"


class Background:
    """What a row samples while its run runs: `_run` in a daemon thread until `stop`."""

    join_seconds = 10.0  # how long `stop` waits for the sample under way

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.join_seconds)

    def _run(self) -> None:
        raise NotImplementedError


class StatusProbe(Background):
    """`hpc-garage status` (every job) and `hpc-garage status JOBID` (the run, its sweep read from its results
    directory) while the run is running, every PROBE_SECONDS: issue 32's "status answers in <= 2 s while it
    runs", timed as a user's shell would see it (a fresh CLI process each time)."""

    join_seconds = 60.0  # a status call under way: its own timeout is 120 s, but it answers in seconds

    def __init__(self, env: dict[str, str], home: str) -> None:
        super().__init__()
        self.env, self.home = env, home
        self.seconds: dict[str, list[float]] = {"list": [], "job": []}

    def figures(self) -> dict[str, list[float]]:
        return {what: [round(x, 3) for x in xs] for what, xs in self.seconds.items() if xs}

    def _timed(self, *args: str) -> tuple[float, str | None]:
        began = time.monotonic()
        done = subprocess.run([str(BIN / "hpc-garage"), "status", *args], env=self.env, cwd=self.home,
                              capture_output=True, text=True, timeout=120)
        return time.monotonic() - began, done.stdout if done.returncode == 0 else None

    def _run(self) -> None:
        while not self._stop.wait(PROBE_SECONDS):
            took, out = self._timed("--json")
            running = [j["job_id"] for j in json.loads(out or "[]") if j["scheduler"] == "local"
                       and str(j["summary"]).startswith("running") and j["summary"] != "running (starting)"]
            if not running or self._stop.is_set():
                continue  # starting or ending: not "while it runs"
            self.seconds["list"].append(took)
            took, out = self._timed(running[0])
            if out is not None and not self._stop.is_set():
                self.seconds["job"].append(took)


class Sampler(Background):
    """Peak RSS by process kind, and the server's CPU while the flow lives, every second: `run`'s process tree
    and anything else started with this row's HOME (the server, once `run` has exited)."""

    def __init__(self, root: int, home: str) -> None:
        super().__init__()
        self.root, self.home = root, home
        self.peak: dict[str, int] = {}
        self.server_cpu: list[float] = []  # the server's CPU seconds at each sample while the flow ran
        self.cpu: list[tuple[float, dict[str, float]]] = []  # CPU seconds by kind at each sample while it ran

    def peak_mib(self) -> dict[str, int]:
        return {k: round(v / 2**20) for k, v in sorted(self.peak.items()) if k != "other"}

    def server_cpu_ms(self, n: int) -> float | None:
        if len(self.server_cpu) < 2:
            return None
        return round((self.server_cpu[-1] - self.server_cpu[0]) * 1000 / n, 2)

    def cores_by_kind(self) -> dict[str, str]:
        """Cores each kind kept busy in the first and in the last tenth of the flow's life: who is the
        bottleneck when the time per 1,000 grows."""
        if len(self.cpu) < 20:
            return {}
        tenth = len(self.cpu) // 10

        def cores(a: int, b: int) -> dict[str, float]:
            (t0, c0), (t1, c1) = self.cpu[a], self.cpu[b]
            return {k: (c1.get(k, 0.0) - c0.get(k, 0.0)) / max(t1 - t0, 1e-9) for k in c1}

        start, end = cores(0, tenth), cores(-1 - tenth, -1)
        return {k: f"{start.get(k, 0):.2f} → {end.get(k, 0):.2f}" for k in sorted(end) if k != "other"}

    def _processes(self) -> list[Any]:
        import psutil

        try:
            found = {p.pid: p for p in psutil.Process(self.root).children(recursive=True)}
            found[self.root] = psutil.Process(self.root)
        except psutil.Error:
            found = {}
        for p in psutil.process_iter():
            try:
                if p.pid not in found and p.environ().get("HOME") == self.home:
                    found[p.pid] = p
            except psutil.Error:
                continue
        return list(found.values())

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            sums: dict[str, int] = {}
            server_cpu, flow_alive = 0.0, False
            by_kind: dict[str, float] = {}
            for p in self._processes():
                try:
                    kind = kind_of(p.pid, self.root, " ".join(p.cmdline()))
                    rss, cpu = p.memory_info().rss, p.cpu_times()
                except psutil.Error:
                    continue
                sums[kind] = sums.get(kind, 0) + rss
                flow_alive = flow_alive or kind == "flow"
                by_kind[kind] = by_kind.get(kind, 0.0) + cpu.user + cpu.system
                if kind in ("server", "database"):
                    server_cpu += cpu.user + cpu.system + cpu.children_user + cpu.children_system
            for kind, rss in sums.items():
                self.peak[kind] = max(self.peak.get(kind, 0), rss)
            if flow_alive:
                self.server_cpu.append(server_cpu)
                self.cpu.append((time.monotonic(), by_kind))
            self._stop.wait(1.0)


def section(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The rows, and hpc-garage's trials/s at each size as a figure against its peers at that size."""
    figures = []
    for n in sorted({r["n"] for r in rows}):
        ours = [r for r in rows if r["n"] == n and r.get("kind") == "hpc-garage"]
        how = next((r["job"] for r in ours if r.get("job")), "`hpc-garage run --site local`, 2 workers")
        group = f"issue 32 scale: {n:,} trivial tagged trials, {how}" + "".join(
            sorted({f", Prefect's database {r['database']}" for r in ours if r.get("database", "sqlite") != "sqlite"}))
        for r in (r for r in rows if r["n"] == n):
            figures.append(Figure(group, KINDS[r["kind"]], "tasks/s", [r["trials_per_s"]] if r.get("right") else [],
                                  ours=r["kind"] == "hpc-garage", higher_is_better=True,
                                  note="" if r.get("right") else r.get("error", "wrong results")))
    compare(figures, ">= 100 trials/s; time per 1,000 at the end <= 1.1x the start",
            lambda ours, peers: ours.median is not None and ours.median >= 100)
    for f in figures:  # the flatness goal, from the row itself
        row = next((r for r in rows if KINDS[r["kind"]] == f.label and f.group.startswith(
            f"issue 32 scale: {r['n']:,} ")), None)
        if f.ours and f.met and row and row.get("per_1000_start_s") and row.get("per_1000_end_s"):
            f.met = row["per_1000_end_s"] <= 1.1 * row["per_1000_start_s"]
    for r in (r for r in rows if r.get("status_s")):  # issue 32: status while it runs, each call timed
        for what, xs in r["status_s"].items():
            figures.append(Figure(f"issue 32 scale: `hpc-garage status` while {r['n']:,} trials run",
                                  f"`hpc-garage status{' JOBID' if what == 'job' else ''}` ({len(xs)} calls)", "s",
                                  xs, ours=True, goal="<= 2 s, every call", met=max(xs) <= 2.0))
    return {"figures": [f.to_dict() for f in figures], "rows": rows}


if __name__ == "__main__":
    sys.exit(main())
