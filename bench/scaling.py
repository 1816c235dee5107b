"""(5) Registration scaling: job running -> all workers registered, and the scheduler's CPU per registered
worker, at 2, 4, 8, 16 fake nodes, for both launch modes; then a model of 4,096 nodes x 8 workers.

    python -m bench.scaling --nodes 2,4,8,16 --modes default,dask-mpi --runs 1 --out scaling.json

It runs on a SECOND local SLURM (`scripts/local-slurm up --name scale --nodes 16`, brought up here if it is
not up, and taken down again if this bench brought it up), through SLURM_CONF, so the default 2-node cluster
others test on is untouched. Each job: `hpc-garage submit --site <lab-gpu with max_nodes 16> --nodes N
--gpus-per-node W`, W workers per node (one per fake GPU); COMMAND is registration_probe.py, which samples
the run process (the scheduler) every 20 ms until the scheduler file is published.

What is measured, per run:
- registered: job start (a set-up line's timestamp) -> scheduler file published (every worker registered);
- first worker: job start -> the first worker registered;
- scheduler CPU per worker: the run process's main-thread CPU (the scheduler's event loop) from the first
  to the last registration, divided by the workers after the first.
Every fake node's processes are real processes on this host's 2 cores, so wall times here grow with the
node count for a reason a real cluster does not have (each real node brings its own cores). The model
therefore extrapolates only what stays serial at any scale, the scheduler's event loop:
    T(W) = first-worker time (at the smallest size) + W x (scheduler CPU per worker, slope of a least-squares
    line of the window's main-thread CPU against the workers registered in it),
a lower bound on a real machine's time (it assumes the scheduler never waits for workers and that its
per-worker cost stays flat: heartbeats of already-registered workers, the network, the file system and
srun's fan-out to 4,096 nodes are not in it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import BIN, ROOT, SCRIPTS, Figure, Jobs, read_json_when_ready, say, scratch

CLUSTER = "scale"
MODES = {"default": ("lab-gpu.yaml", "hpc-garage mpi launcher (default)"),
         "dask-mpi": ("lab-gpu-dask-mpi.yaml", "hpc-garage dask-mpi mode, mpi: {launch: dask-mpi}")}
TARGET_NODES, TARGET_PER_NODE = 4096, 8
SUMMIT = "Summit, distributed #3691: about 1,900 of 8,292 workers registered after 180 s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", default="2,4,8,16")
    parser.add_argument("--modes", default="default,dask-mpi")
    parser.add_argument("--dask-mpi-nodes", default="2,4,8", help="node counts for dask-mpi (a rank per worker costs more CPU)")
    parser.add_argument("--workers-per-node", type=int, default=2)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.nodes.split(",")]
    conf, brought_up = _scale_cluster(max(sizes))
    os.environ["SLURM_CONF"] = conf  # every sbatch/squeue/scancel of this process, Jobs' too: the scale cluster only
    jobs = Jobs()
    samples: dict[str, list[dict[str, Any]]] = {m: [] for m in args.modes.split(",")}
    try:
        from hpc_garage.prefect.server import ensure_api

        sites = scratch("sites-")
        stamp = '\nsetup:\n  - date +%s.%N > "$HPC_GARAGE_BENCH_DIR/job_start"\n'
        for mode in samples:
            text = (ROOT / "site-configs" / MODES[mode][0]).read_text().replace("max_nodes: 2", f"max_nodes: {max(sizes)}")
            (sites / f"bench-scale-{mode}.yaml").write_text(text + stamp)
        env = {**os.environ, **ensure_api(), "HPC_GARAGE_SITES_PATH": str(sites), "SLURM_CONF": conf}
        for mode in samples:
            allowed = sizes if mode == "default" else [n for n in sizes if str(n) in args.dask_mpi_nodes.split(",")]
            for nodes in allowed:
                for i in range(args.runs):
                    try:
                        sample = _one(mode, nodes, args.workers_per_node, env, jobs)
                    except Exception as exc:  # noqa: BLE001 - reported, not fatal
                        say(f"scaling: {mode} {nodes} nodes failed: {type(exc).__name__}: {exc}"[:400])
                        samples[mode].append({"nodes": nodes, "error": f"{type(exc).__name__}: {exc}"[:300]})
                        break
                    samples[mode].append(sample)
                    say(f"scaling: {mode} {nodes} nodes x {args.workers_per_node}: registered {sample['registered']:.1f} s, "
                        f"first worker {sample['first_worker']:.1f} s, scheduler CPU/worker "
                        f"{sample['cpu_per_worker'] * 1000:.1f} ms, load {sample['load']:.1f}")
        shutil.rmtree(sites, ignore_errors=True)
    finally:
        jobs.cancel()
        if brought_up:
            _local_slurm("down", max(sizes))
    result = summarize(samples, args.workers_per_node)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


def _local_slurm(action: str, nodes: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(ROOT / "scripts" / "local-slurm"), action, "--name", CLUSTER, "--nodes", str(nodes)],
                          capture_output=True, text=True, timeout=300)


def _scale_cluster(nodes: int) -> tuple[str, bool]:
    """SLURM_CONF of the `scale` cluster with at least `nodes` nodes; whether this call brought it up."""
    conf = f"/tmp/hpc-garage-slurm-{CLUSTER}/etc/slurm.conf"
    listed = subprocess.run(["sinfo", "-h", "-N", "-p", "gpu", "-o", "%N"], env={**os.environ, "SLURM_CONF": conf},
                            capture_output=True, text=True)
    same = Path(conf).exists() and "FirstJobId" in Path(conf).read_text()  # written by this local-slurm
    if listed.returncode == 0 and len(listed.stdout.split()) >= nodes and same:
        return conf, False
    done = _local_slurm("up", nodes)
    if done.returncode != 0:
        raise SystemExit(f"scripts/local-slurm up --name {CLUSTER} --nodes {nodes} failed: {done.stderr[-500:]}")
    return conf, True


def _one(mode: str, nodes: int, per_node: int, env: dict[str, str], jobs: Jobs) -> dict[str, Any]:
    directory = scratch("scaling-")
    out = directory / "out.json"
    run_env = {**env, "HPC_GARAGE_BENCH_DIR": str(directory)}
    done = subprocess.run([str(BIN / "hpc-garage"), "submit", "--site", f"bench-scale-{mode}", "--nodes", str(nodes),
                           "--gpus-per-node", str(per_node), str(SCRIPTS / "registration_probe.py"), str(out)],
                          env=run_env, cwd=directory, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"hpc-garage submit: {done.stderr.strip()[-300:]}")
    job = jobs.adopt(done.stdout + done.stderr)
    try:
        result = read_json_when_ready(out, 400, alive=lambda: _queued(job, env))
    finally:
        subprocess.run(["scancel", "--signal=KILL", "--full", job], env=env, capture_output=True, timeout=30)
        subprocess.run(["scancel", job], env=env, capture_output=True, timeout=30)
        _wait_gone(job, env)
    start = min(float(x) for x in (directory / "job_start").read_text().split())
    shutil.rmtree(directory, ignore_errors=True)
    return analyse(result, start, nodes, per_node) | {"load": os.getloadavg()[0]}


def _queued(job: str, env: dict[str, str]) -> bool:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True, text=True).stdout
    return bool(out.strip())


def _wait_gone(job: str, env: dict[str, str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while _queued(job, env) and time.monotonic() < deadline:
        time.sleep(0.2)


def analyse(result: dict[str, Any], job_start: float, nodes: int, per_node: int) -> dict[str, Any]:
    """One run's figures from the probe's samples (time, main-thread CPU, process CPU, workers)."""
    samples = result["samples"]
    workers = nodes * per_node
    first = next((s for s in samples if s[3] >= 1), samples[-1])
    last = samples[-1]
    window_cpu = last[1] - first[1]
    return {"nodes": nodes, "workers": workers, "registered": result["registered"] - job_start,
            "first_worker": first[0] - job_start, "window": result["registered"] - first[0],
            "window_cpu": window_cpu, "cpu_per_worker": window_cpu / max(1, workers - 1),
            "process_cpu_at_registered": last[2]}


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares line y = a + b x: (a, b)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    if len(set(xs)) < 2:
        return 0.0, (ys[0] / xs[0] if xs and xs[0] else 0.0)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def summarize(samples: dict[str, list[dict[str, Any]]], per_node: int) -> dict[str, Any]:
    figures: list[Figure] = []
    models: dict[str, Any] = {}
    target = TARGET_NODES * TARGET_PER_NODE
    for mode, runs in samples.items():
        label = MODES[mode][1]
        good = [r for r in runs if "error" not in r]
        for nodes in sorted({r["nodes"] for r in runs}):
            mine = [r for r in good if r["nodes"] == nodes]
            group = f"registration scaling, {nodes} fake nodes x {per_node} workers: job running -> all workers registered"
            failed = [r["error"] for r in runs if r["nodes"] == nodes and "error" in r]
            figure = Figure(group, label, "s", [r["registered"] for r in mine], ours=True, note=failed[0] if failed else "")
            if mine:
                loads = ", ".join(f"{r['load']:.1f}" for r in mine)
                figure.note = (f"first worker {statistics.median(r['first_worker'] for r in mine):.1f} s; scheduler "
                               f"main-thread CPU per worker {statistics.median(r['cpu_per_worker'] for r in mine) * 1000:.1f} ms; "
                               f"run process CPU at registered {statistics.median(r['process_cpu_at_registered'] for r in mine):.1f} s; "
                               f"load {loads}")
            figures.append(figure)
        if len({r["workers"] for r in good}) >= 1:
            a, b = fit([(r["workers"] - 1, r["window_cpu"]) for r in good])
            smallest = min(r["nodes"] for r in good)
            t_first = statistics.median(r["first_worker"] for r in good if r["nodes"] == smallest)
            predicted = t_first + b * target
            at_180 = max(0.0, (180 - t_first) / b) if b > 0 else float("inf")
            models[mode] = {"cpu_per_worker_slope_s": b, "intercept_s": a, "first_worker_s": t_first,
                            "predicted_s": predicted, "workers_by_180_s": at_180, "points": len(good)}
            group = (f"registration extrapolated to {TARGET_NODES:,} nodes x {TARGET_PER_NODE} = {target:,} workers "
                     "(model: first worker + workers x scheduler CPU per worker)")
            figures.append(Figure(group, label, "s", [predicted], ours=True,
                                  note=(f"slope {b * 1000:.2f} ms of scheduler CPU per worker (least squares over {len(good)} "
                                        f"runs, intercept {a:.2f} s); first worker {t_first:.1f} s; by this model "
                                        f"{min(at_180, target):,.0f} workers registered after 180 s, against {SUMMIT}")))
    return {"figures": [f.to_dict() for f in figures], "runs": samples, "models": models}


if __name__ == "__main__":
    sys.exit(main())
