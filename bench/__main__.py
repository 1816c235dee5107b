"""`python -m bench`: every benchmark of issue 5 on this machine's local SLURM and login node, one command.

    python -m bench                 full: 5 runs each (pruning and search, the Ray Tune peers, at least 5 whatever
                                    --runs says), writes bench/results/latest.{md,json} and the timeline, and
                                    each benchmark's own output into bench/results/runs/ (bench/report.py)
    python -m bench --quick         CI: tiny sizes, one run, into a temporary directory; asserts no timings
    python -m bench --only overhead,cli --runs 7 --out DIR
    python -m bench --only scaling  registration at 2-16 fake nodes on a second local SLURM (not in --quick)
    python -m bench --only faults   what issue 11's API-outage hooks cost per tagged task (on vs bypassed)
    python -m bench --only trials   what issue 24's per-trial API costs trials that never call it (on vs bypassed)
    python -m bench --only ui       the managed Prefect server's start-up and memory with its UI and without
    python -m bench --only deployment   a deployment run on an `hpc-garage` work pool against `submit`
    python -m bench --only pruning  issue 25's pruned sweep on SLURM (none, ASHA, median) against Ray Tune's ASHA
    python -m bench --only search   issue 34's hpc_garage.search (TPE + ASHA) against Ray Tune's Tuner (OptunaSearch +
                                    ASHAScheduler), and a cancelled + resumed search against an uninterrupted one
    python -m bench --only reports  what 10,000 `trial.report()` calls per trial cost, and the scheduler meanwhile
    python -m bench --only scale    1,000-100,000 trials in one flow under `hpc-garage run --site local` (issue 32;
                                    not in --quick's default set; --scale-sizes sets the sizes)
    python -m bench --only server   the managed Prefect server's CPU and database growth per task run
    python -m bench --only workers  128-1,024 TLS workers on one scheduler, then 50,000 tasks over them for 10
                                    minutes (not in --quick; --worker-tasks/--worker-hold scale the run down)

Each benchmark runs in its own Python process (bench.startup, bench.overhead, bench.fault_cost, bench.trial_cost, bench.report_cost, bench.packing,
bench.tune_peer, bench.search_peer, bench.cli_speed, bench.server_ui, bench.deployment), so one's imports, Prefect settings and clusters cannot colour another's figures. Needs the local SLURM up
(scripts/local-slurm up) for start-up, packing, pruning and search; they are reported as skipped without it. The pruning
benchmark's Ray Tune peer builds a virtual environment with `ray[tune]` once, under the bench's cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import PYTHON, ROOT, machine, say, slurm_problem
from bench.report import store_run, write_index, write_reports

RESULTS = Path(__file__).resolve().parent / "results"
PEER_RUNS = 5  # issue 31: Ray Tune's spread needs at least 5 interleaved runs, whatever --runs the rest gets
ORDER = ("cli", "overhead", "faults", "trials", "reports", "ui", "packing", "pruning", "search", "startup",
         "deployment", "scaling", "workers", "scale", "server")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one run (CI): checks the bench works")
    parser.add_argument("--runs", type=int, help="runs per figure (default 5; 1 with --quick)")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(ORDER)}")
    parser.add_argument("--out", type=Path, help="results directory (default bench/results; a temp dir with --quick)")
    parser.add_argument("--startup-nodes", help="node counts for the start-up benchmark (default 1,2; 1 with --quick)")
    parser.add_argument("--worker-tasks", type=int, default=50_000, help="the workers benchmark's tasks (issue 32)")
    parser.add_argument("--worker-hold", type=int, default=600, help="the workers benchmark's task run, seconds at least")
    parser.add_argument("--worker-sizes", default="128,256,512,1024", help="the workers benchmark's cluster sizes")
    parser.add_argument("--scale-sizes", default="1000,10000,100000", help="the scale benchmark's trial counts")
    parser.add_argument("--worker-task-sizes", default="", help="sizes the tasks run at (default: the largest)")
    args = parser.parse_args(argv)
    runs = args.runs or (1 if args.quick else 5)
    out = args.out or (Path(tempfile.mkdtemp(prefix="hpc-garage-bench-quick-")) if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    chosen = [b for b in ORDER if (not args.only or b in args.only.split(","))
              and not (args.quick and (b in ("scaling", "workers", "server") or b == "scale" and not args.only))]
    # not in --quick: a 16-node SLURM, 1,024 workers, 3 managed servers; scale only when named (--quick --only scale: 200 trials)
    no_slurm = slurm_problem()
    started = time.monotonic()
    info = machine()
    sections: dict[str, Any] = {}
    failed = []
    for name in chosen:
        if name in ("startup", "packing", "pruning", "search", "deployment", "scaling") and no_slurm:
            sections[name] = {"skipped": no_slurm}
            say(f"{name}: skipped: {no_slurm}")
            continue
        say(f"{name}: running")
        begun, at_start = time.monotonic(), machine()
        target = out / f"{name}.json"
        extra = ["--nodes", args.startup_nodes] if name == "startup" and args.startup_nodes else []
        if name == "scale":
            extra = ["--quick"] if args.quick else ["--sizes", args.scale_sizes]
        if name == "workers":
            extra = ["--tasks", str(args.worker_tasks), "--hold", str(args.worker_hold), "--sizes", args.worker_sizes,
                     "--task-sizes", args.worker_task_sizes]
        code = _run([PYTHON, "-m", f"bench.{_module(name)}", *_arguments(name, args.quick, runs, out), *extra,
                     "--out", str(target)], out / f"{name}.log")
        if code != 0 or not target.exists():
            failed.append(name)
            _say_why(name, code, out / f"{name}.log")
            sections[name] = {"failed": f"exit code {code}"}
            continue
        sections[name] = json.loads(target.read_text()) | {"seconds": round(time.monotonic() - begun, 1)}
        target.unlink()
        once = 1 if name == "scale" else _runs_of(name, runs, args.quick)  # scale: each size one run (minutes)
        command = "python -m bench" + (" --quick" if args.quick else "") + f" --only {name} --runs {once}" + (
            f" --startup-nodes {args.startup_nodes}" if extra and name == "startup" else "") + (
            f" --worker-tasks {args.worker_tasks} --worker-hold {args.worker_hold} --worker-sizes {args.worker_sizes}"
            + (f" --worker-task-sizes {args.worker_task_sizes}" if args.worker_task_sizes else "") if name == "workers"
            else "") + (f" --scale-sizes {args.scale_sizes}" if name == "scale" and not args.quick else "")
        store_run(out, name, sections[name], at_start, command, os.getloadavg()[0], once, args.quick)
    given = sys.argv[1:] if argv is None else argv
    report = {"machine": info, "quick": args.quick, "runs": runs, "peer_runs": _runs_of("search", runs, args.quick),
              "command": " ".join(["python -m bench", *given]), "seconds": round(time.monotonic() - started, 1),
              "benchmarks": sections}
    md, js = write_reports(report, out)
    index = write_index(out)
    say(f"wrote {md}, {js} and {index} in {report['seconds']:.0f} s")
    if failed:
        say(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


def _run(argv: list[str], log: Path) -> int:
    """Run one benchmark; its whole output (Prefect's logs included) goes to `log`, its `bench:` lines here too."""
    with open(log, "w") as sink:
        process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert process.stdout is not None
        for line in process.stdout:
            sink.write(line)
            if line.startswith("bench:"):
                print(line, end="", file=sys.stderr, flush=True)
        return process.wait()


def _say_why(name: str, code: int, log: Path, lines: int = 25) -> None:
    """A failed benchmark's last log lines (its traceback), where the caller sees them: a CI run keeps no log."""
    tail = log.read_text(errors="replace").splitlines()[-lines:] if log.exists() else []
    say(f"{name}: exit code {code}; the last {len(tail)} lines of {log}:")
    for line in tail:
        say(f"{name}| {line}")


def _runs_of(name: str, runs: int, quick: bool) -> int:
    """Runs a benchmark gets: --runs, but at least PEER_RUNS for the Ray Tune peers (pruning, search)."""
    return max(runs, PEER_RUNS) if name in ("pruning", "search") and not quick else runs


def _module(name: str) -> str:
    return {"cli": "cli_speed", "faults": "fault_cost", "trials": "trial_cost", "ui": "server_ui",
            "reports": "report_cost", "pruning": "tune_peer", "search": "search_peer",
            "server": "server_cost"}.get(name, name)


def _arguments(name: str, quick: bool, runs: int, out: Path) -> list[str]:
    base = ["--runs", str(runs)]
    if name == "overhead":
        return base + ["--tasks", "10" if quick else "100"]
    if name in ("faults", "trials"):
        return base + ["--tasks", "10" if quick else "200"]
    if name == "cli":
        return base + (["--nodes", "64"] if quick else [])
    if name == "reports":  # issue 25: 10,000 trial.report() calls per trial (2,000 in --quick), 2 trials at once
        return base + ["--reports", "2000" if quick else "10000", "--trials", "2"]
    if name == "pruning":  # issue 25: each sweep is a SLURM job (and Ray Tune's a login-node run); issue 31: as
        # many interleaved runs as asked (5 by default), so that Ray Tune's spread is measured, not guessed
        if quick:  # hpc-garage without pruner and with ASHA, and Ray Tune where its environment is built already
            return ["--runs", "1", "--trials", "8", "--steps", "8", "--step-seconds", "0.2", "--pruners", "none,asha",
                    "--no-ray-build"]
        return ["--runs", str(_runs_of(name, runs, quick))]
    if name == "search":  # issue 34: two SLURM jobs (one uninterrupted, one cancelled + resumed) and Ray Tune a run
        if quick:  # one small search, no resume, Ray Tune only where its environment is built already
            return ["--runs", "1", "--resume-runs", "0", "--trials", "8", "--steps", "6", "--step-seconds", "0.2",
                    "--budget", "1000", "--no-ray-build"]
        return ["--runs", str(_runs_of(name, runs, quick))]
    if name == "packing":
        # quick: not prefect-submitit (a Python 3.12 venv to build, and an interpreter start per trial)
        sizes = ["--gpu-trials", "8", "--cpu-trials", "2", "--seconds", "0.2", "--layouts", "ours,guide,jobqueue"] if quick else []
        return base + sizes + ["--plot", str(out / "packing-timeline.png")]
    if name == "deployment":  # a deployment run on an hpc-garage work pool vs `submit` (issue 22)
        return base + ["--poll", "5"]
    if name == "startup":
        return base + (["--nodes", "1"] if quick else [])
    if name == "server":  # issue 32: the managed server's CPU per task run (Prefect's own settings as the peer)
        return base + ["--tasks", "1000", "--variants", "managed,no-event-store,prefect"]  # not in --quick
    if name == "scaling":
        return ["--runs", "1"]  # one job per size and mode: the sizes are the repeats the fit uses
    return base


if __name__ == "__main__":
    sys.exit(main())
