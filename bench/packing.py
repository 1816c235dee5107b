"""(4) Packing: a reference sweep on a fixed allocation of 2 nodes x 4 GPUs (48 GPU trials and 16 CPU-only
trials of known sleep, then one aggregation), its makespan against the lower bound, and whether any GPU
ever ran two trials at once; for hpc-garage's layout and the two layouts people write by hand.

    python -m bench.packing --runs 5 --out packing.json [--plot timeline.png]

Layouts (each on its own 2-node job(s), the sweep repeated `runs` times on the running cluster):
- hpc-garage: `hpc-garage submit --site lab-gpu --nodes 2`: one worker per GPU, each pinned to its GPU.
- the garage guide's: per node `dask worker --nworkers 4 --resources GPU=1` (the guide's `--nprocs 4`).
- dask-jobqueue's default: one worker per job (per node), 8 threads, `--resources GPU=4`.
- prefect-submitit (0.1.x), the Prefect 3 task runner for SLURM: its `srun` mode inside one `sbatch -N2` job,
  every task an `srun --exact -n1 --gres gpu:1` step (a fresh Python per task); it needs Python >= 3.12, so it
  runs in its own virtual environment (built once under the bench's cache with the same Prefect version);
  one sweep (each costs 64 interpreter starts and Prefect imports on this host's 2 cores).
The lower bound is max(GPU work / GPUs, all work / worker threads) + the aggregation, the longest chain
being shorter here.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.common import (BENCH_TMP, BIN, PYTHON, ROOT, SCRIPTS, Figure, Jobs, read_json_when_ready, say, scratch,
                          wait_for_free_nodes)

OURS = "hpc-garage layout (lab-gpu, one pinned worker per GPU)"
GUIDE = "garage guide: dask worker --nworkers 4 --resources GPU=1 per node"
AGGREGATE = 0.1  # s: the aggregation task after the trials
JOBQUEUE = "dask-jobqueue default: one worker per job, --resources GPU=4"
SUBMITIT = "prefect-submitit SlurmTaskRunner(execution_mode='srun', gpus_per_node=1), one sbatch -N2 job"
SUBMITIT_RUNS = 1  # sweeps at most: each starts a Python (and imports Prefect) per trial, ~2 min a sweep here


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--gpu-trials", type=int, default=48)
    parser.add_argument("--cpu-trials", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--plot")
    parser.add_argument("--trials", help="also write every trial of every sweep here (JSON)")
    parser.add_argument("--layouts", default="ours,guide,jobqueue,submitit")
    args = parser.parse_args(argv)
    sweep = ["--runs", str(args.runs), "--gpu-trials", str(args.gpu_trials), "--cpu-trials", str(args.cpu_trials),
             "--seconds", str(args.seconds), "--aggregate-seconds", str(AGGREGATE)]
    jobs = Jobs()
    layouts: dict[str, dict[str, Any]] = {}
    try:
        chosen = args.layouts.split(",")
        for key, name, run in (("ours", OURS, _ours), ("guide", GUIDE, _guide), ("jobqueue", JOBQUEUE, _jobqueue),
                               ("submitit", SUBMITIT, _submitit)):
            if key not in chosen:
                continue
            wait_for_free_nodes()
            directory = scratch("packing-")
            try:
                layouts[name] = run(directory, sweep, jobs)
            except Exception as exc:  # noqa: BLE001 - reported in the table
                layouts[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                say(f"packing: {name} failed: {layouts[name]['error']}")
            shutil.rmtree(directory, ignore_errors=True)
    finally:
        jobs.cancel()
    result = summarize(layouts, args.gpu_trials, args.cpu_trials, args.seconds, AGGREGATE)
    if args.plot:
        result["plot"] = plot(layouts, Path(args.plot))
    if args.trials:
        Path(args.trials).write_text(json.dumps(layouts))
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


def _ours(directory: Path, sweep: list[str], jobs: Jobs) -> dict[str, Any]:
    out = directory / "out.json"
    done = subprocess.run([str(BIN / "hpc-garage"), "submit", "--site", "lab-gpu", "--nodes", "2",
                           str(SCRIPTS / "packing_flow.py"), str(out), *sweep], cwd=directory,
                          capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"hpc-garage submit: {done.stderr.strip()[-300:]}")
    job = jobs.adopt(done.stdout + done.stderr)
    result = read_json_when_ready(out, 600, alive=lambda: Jobs.queued(job))
    jobs.end(job)
    return result


def _guide(directory: Path, sweep: list[str], jobs: Jobs) -> dict[str, Any]:
    from hpc_garage.prefect.server import ensure_api

    scheduler_file = directory / "scheduler.json"
    script = directory / "job.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH --job-name=bench-guide
#SBATCH --partition=gpu
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --gres=gpu:4
#SBATCH --mem=15000M
#SBATCH --time=00:15:00
#SBATCH --output={directory}/slurm-%j.out
{BIN / 'dask'} scheduler --scheduler-file {scheduler_file} --interface lo --port 0 --dashboard-address :0 &
srun --ntasks-per-node=1 {BIN / 'dask'} worker --scheduler-file {scheduler_file} --nworkers 4 --nthreads 2 \\
  --resources GPU=1 --memory-limit 3.5GB --interface lo &
BENCH_WORKERS=8 {PYTHON} {SCRIPTS / 'packing_flow.py'} {directory}/out.json --scheduler-file {scheduler_file} {' '.join(sweep)}
kill %1 %2 2>/dev/null
wait
""")
    job = jobs.sbatch(script, env={**os.environ, **ensure_api()})
    result = read_json_when_ready(directory / "out.json", 600, alive=lambda: Jobs.queued(job))
    jobs.end(job)
    return result


def _jobqueue(directory: Path, sweep: list[str], jobs: Jobs) -> dict[str, Any]:
    out = directory / "out.json"
    done = subprocess.run([PYTHON, str(SCRIPTS / "packing_flow.py"), str(out), "--jobqueue", "2", *sweep],
                          cwd=directory, capture_output=True, text=True, timeout=600)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"jobqueue driver exited {done.returncode}: {done.stderr.strip()[-300:]}")
    return dict(json.loads(out.read_text()))




def _submitit(directory: Path, sweep: list[str], jobs: Jobs) -> dict[str, Any]:
    from hpc_garage.prefect.server import ensure_api

    python = submitit_python()
    runs = min(int(sweep[sweep.index("--runs") + 1]), SUBMITIT_RUNS)
    script = directory / "job.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH --job-name=bench-submitit
#SBATCH --partition=gpu
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --cpus-per-task=1
#SBATCH --gres=gpu:4
#SBATCH --mem=15000M
#SBATCH --time=00:20:00
#SBATCH --output={directory}/slurm-%j.out
cd {directory}
{python} {SCRIPTS / 'packing_submitit.py'} {directory}/out.json {' '.join(sweep)} --runs {runs} --log-folder {directory}/logs
""")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | ensure_api()
    job = jobs.sbatch(script, env=env)
    result = read_json_when_ready(directory / "out.json", 900, alive=lambda: Jobs.queued(job))
    jobs.end(job)
    return result


def submitit_python() -> str:
    """A Python >= 3.12 with prefect-submitit 0.1.x and this Prefect version, in a virtual environment under
    the bench's cache (made once): prefect-submitit requires 3.12, hpc-garage's own interpreter may be older."""
    from importlib.metadata import version

    if sys.version_info >= (3, 12) and importlib.util.find_spec("prefect_submitit"):
        return PYTHON
    venv = BENCH_TMP / "prefect-submitit-venv"
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import prefect_submitit"], capture_output=True).returncode == 0:
        return str(python)
    base = next((p for p in _pythons_312() if subprocess.run([p, "-c", "pass"], capture_output=True).returncode == 0),
                None)  # a pyenv shim of a version that is installed but not selected is on PATH yet fails (127)
    if base is None:
        raise RuntimeError("prefect-submitit needs Python >= 3.12 and none runs (python3.12, python3.13 on PATH "
                           "or in pyenv's versions)")
    say(f"packing: building {venv} for prefect-submitit (once)")
    subprocess.run([base, "-m", "venv", str(venv)], check=True, capture_output=True)
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "prefect-submitit>=0.1,<0.2",
                           f"prefect=={version('prefect')}"], capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"pip install prefect-submitit: {done.stderr.strip()[-300:]}")
    return str(python)


def _pythons_312() -> list[str]:
    """Interpreters of Python 3.12 or newer: on PATH, then pyenv's installed versions (not selected ones)."""
    found = [p for p in (shutil.which("python3.13"), shutil.which("python3.12")) if p]
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    found += sorted((str(p) for p in root.glob("3.1[2-9]*/bin/python3")), reverse=True)
    return found


# ------------------------------------------------------------------------------------------- analysis


def lower_bound(gpu_trials: int, cpu_trials: int, seconds: float, aggregate: float, gpus: float, threads: int) -> float:
    return max(gpu_trials * seconds / gpus, (gpu_trials + cpu_trials) * seconds / threads) + aggregate


def gpu_overlaps(trials: list[dict[str, Any]]) -> tuple[int, int]:
    """(pairs of GPU trials that overlapped on one physical GPU, most trials on one GPU at once)."""
    lanes: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for t in trials:
        if t["kind"] == "gpu":
            lanes[(t["node"], t["gpu"] or "none")].append((t["start"], t["end"]))
    pairs, most = 0, 0
    for intervals in lanes.values():
        events = sorted([(s, 1) for s, _ in intervals] + [(e - 1e-3, -1) for _, e in intervals])
        running = 0
        for _, step in events:
            if step > 0:
                pairs += running
            running += step
            most = max(most, running)
    return pairs, most


def idle_per_trial(run: dict[str, Any], gpus: float) -> float:
    """Per-task overhead: GPU-seconds no trial ran, from the sweep's start to its last trial's end, per trial
    ((GPUs x that span - the time each GPU had a trial on it) / trials): the dispatch, start-up and result
    round trips a runner adds between trials, whatever it is made of."""
    lanes: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for t in run["trials"]:
        lanes[(t["node"], t["gpu"] or "none")].append((t["start"], t["end"]))
    busy = 0.0
    for intervals in lanes.values():
        edge = run["start"]
        for s, e in sorted(intervals):
            busy += max(0.0, e - max(s, edge))
            edge = max(edge, e)
    span = max(t["end"] for t in run["trials"]) - run["start"]
    return (gpus * span - busy) / len(run["trials"])


def placement(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """How the GPU trials were spread: trials per GPU (fewest, most), and how long a trial sat on its worker
    between the scheduler's assignment and its start (median, longest), when the run recorded assignments."""
    lanes: dict[tuple[str, str], int] = defaultdict(int)
    waits = []
    for t in trials:
        if t["kind"] == "gpu":
            lanes[(t["node"], t["gpu"] or t.get("worker", "none"))] += 1
            if "assigned" in t:
                waits.append(max(0.0, t["start"] - t["assigned"]))
    counts = sorted(lanes.values())
    waits.sort()
    return {"per_gpu": [counts[0], counts[-1]] if counts else [0, 0], "gpus_used": len(counts),
            "wait_on_worker": [waits[len(waits) // 2], waits[-1]] if waits else None}


def summarize(layouts: dict[str, dict[str, Any]], gpu_trials: int, cpu_trials: int, seconds: float,
              aggregate: float) -> dict[str, Any]:
    group = (f"packing: {gpu_trials} GPU + {cpu_trials} CPU trials of {seconds:g} s + aggregation, "
             "2 nodes x 4 GPUs: makespan")
    figures, details = [], {}
    for name, data in layouts.items():
        if "error" in data:
            figures.append(Figure(group, name, "s", [], ours=name == OURS, note=data["error"]))
            continue
        shape = data["threads"]
        bound = lower_bound(gpu_trials, cpu_trials, seconds, aggregate, shape["gpus"], shape["threads"])
        overlaps = [gpu_overlaps(run["trials"]) for run in data["runs"]]
        pairs, most = sum(p for p, _ in overlaps), max(m for _, m in overlaps)
        figure = Figure(group, name, "s", [run["makespan"] for run in data["runs"]], ours=name == OURS)
        figure.goal = "<= 1.05x lower bound; no GPU runs two trials at once"
        ratio = figure.median / bound
        figure.ratios = {"lower bound": ratio}
        figure.met = ratio <= 1.05 and pairs == 0
        figure.note = (f"lower bound {bound:.2f} s ({shape['workers']} workers, {shape['threads']} threads, "
                       f"{shape['gpus']:g} GPUs); GPU trials sharing a GPU: {pairs} overlapping pairs, "
                       f"up to {most} at once; a warm-up sweep of 0.1 s trials first, not counted ({data['warmup_makespan']:.1f} s)")
        figures.append(figure)
        spread = [placement(run["trials"]) for run in data["runs"]]
        fewest, most_trials = min(p["per_gpu"][0] for p in spread), max(p["per_gpu"][1] for p in spread)
        figure.note += f"; GPU trials per GPU {fewest}-{most_trials}"
        overhead = statistics.median(idle_per_trial(run, shape["gpus"]) for run in data["runs"])
        figure.note += (f"; per-task overhead {overhead:.2f} s (idle GPU-seconds between the sweep's start and its "
                        f"last trial's end, per trial)")
        seen = {t["visible"] for run in data["runs"] for t in run["trials"] if t["kind"] == "gpu"}
        if any("," in (v or "") for v in seen):  # a trial saw several GPUs: CUDA would use the first
            as_cuda = [{**t, "gpu": (t["visible"] or "").split(",")[0]} for run in data["runs"] for t in run["trials"]]
            figure.note += (f"; GPU trials saw CUDA_VISIBLE_DEVICES {', '.join(sorted(seen))}: by the first id, which a "
                            f"CUDA framework uses, {gpu_overlaps(as_cuda)[0]} overlapping pairs")
        if name == SUBMITIT:
            figure.note += (f"; every trial is an srun step holding 1 GPU (CPU trials too: one resource shape per runner "
                            f"in srun mode), so its own bound is {lower_bound(gpu_trials + cpu_trials, 0, seconds, aggregate, shape['gpus'], shape['threads']):.2f} s; "
                            f"{len(data['runs'])} sweeps")
        details[name] = {"lower_bound": bound, "overlapping_pairs": pairs, "most_at_once": most, **shape,
                         "per_task_overhead_s": overhead,
                         "placement": spread}
    return {"figures": [f.to_dict() for f in figures], "layouts": details}


def plot(layouts: dict[str, dict[str, Any]], path: Path) -> str | None:
    """A per-GPU timeline of each layout's last sweep; overlapping GPU trials in red. None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("packing: matplotlib is not installed: no timeline plot")
        return None
    shown = {n: d for n, d in layouts.items() if "runs" in d}
    if not shown:
        return None
    fig, axes = plt.subplots(len(shown), 1, figsize=(11, 2.6 * len(shown)), squeeze=False)
    for ax, (name, data) in zip(axes[:, 0], shown.items()):
        run = data["runs"][-1]
        lanes = sorted({(t["node"], t["gpu"] or "-") for t in run["trials"] if t["kind"] == "gpu"})
        index = {lane: i for i, lane in enumerate(lanes)}
        busy: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
        for t in sorted(run["trials"], key=lambda t: t["start"]):
            if t["kind"] != "gpu":
                continue
            lane = (t["node"], t["gpu"] or "-")
            clash = any(s < t["end"] - 1e-3 and t["start"] < e - 1e-3 for s, e in busy[lane])
            busy[lane].append((t["start"], t["end"]))
            ax.barh(index[lane], t["end"] - t["start"], left=t["start"] - run["start"], height=0.8,
                    color="#d62728" if clash else "#1f77b4", alpha=0.55 if clash else 0.9, edgecolor="white")
        ax.set_yticks(range(len(lanes)), [f"{node} GPU {gpu}" for node, gpu in lanes], fontsize=8)
        ax.set_title(f"{name}: makespan {run['makespan']:.1f} s", fontsize=9, loc="left")
        ax.set_xlim(0, max(d["runs"][-1]["makespan"] for d in shown.values()) * 1.02)
    axes[-1, 0].set_xlabel("seconds since the sweep started (red: a second trial on a GPU already in use)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


if __name__ == "__main__":
    sys.exit(main())
