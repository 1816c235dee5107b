"""(issue 25) Pruning: the synthetic sweep of examples/pruned_sweep.py (32 trials with seeded learning curves,
a few converging well, most poorly) without a pruner and with hpc-garage's pruners, each through
`hpc-garage submit` on the local SLURM (2 nodes x 4 fake GPUs, one trial per GPU), against Ray Tune's
ASHAScheduler on the login node with the same curves, steps and ASHA parameters.

    python -m bench.tune_peer --runs 2 --out pruning.json [--trials 32 --steps 30 --step-seconds 0.2]

Contenders (each run: every pruner in --pruners, then Ray Tune):
- hpc-garage, no pruner; with `pruner="asha"` (the example's `make_pruner`: Optuna's SuccessiveHalvingPruner
  with Ray Tune's ASHA defaults, min_resource 1, reduction factor 4: rungs at steps 1, 4, 16); with
  `pruner="median"` (Optuna's MedianPruner, its defaults). `hpc-garage submit --site lab-gpu --nodes 2
  examples/pruned_sweep.py --gpu yes --pruner P`, one job each (a fresh epoch: nothing cached).
- Ray Tune (scripts/ray_tune_sweep.py): `ASHAScheduler(time_attr="training_iteration", grace_period=1,
  reduction_factor=4, max_t=steps)`, `ray.init(num_cpus=2, num_gpus=8)` (fake GPUs, as Ray's docs say for a
  machine without them; 2 logical CPUs: this host's 2 cores are shared), each trial `{"cpu": 0.25, "gpu": 1}`,
  so 8 at once, as on the 8 fake GPUs. Ray comes from the package registry: a virtual environment under the
  bench's cache, built once (`pip install 'ray[tune]'`) unless this interpreter has Ray.
Figures: GPU-seconds (each trial's duration, its function's start to its end or, under Ray, to the report it
was stopped at, x its 1 GPU, summed) and makespan (first trial's start to last trial's end); pruned count and
best trial (the lowest final loss among the trials that ran to the end) beside them. Goal (issue 25): ASHA
<= 1.0x Ray Tune's GPU-seconds, median or ASHA <= 0.6x the unpruned sweep's, with the same best trial.
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
import time
from pathlib import Path
from typing import Any

from bench.common import BENCH_TMP, BIN, PYTHON, ROOT, SCRIPTS, Figure, Jobs, read_json_when_ready, say, scratch, \
    wait_for_free_nodes

EXAMPLE = ROOT / "examples" / "pruned_sweep.py"
RAY_VENV = BENCH_TMP / "ray-tune-venv"
RAY_CPUS, RAY_CPU_PER_TRIAL, GPUS = 2, 0.25, 8
GRACE, REDUCTION = 1, 4  # ASHA's rungs: steps 1, 4, 16 (examples/pruned_sweep.make_pruner("asha") matches)
LABELS = {
    "none": "hpc-garage submit, no pruner",
    "asha": f"hpc-garage submit, pruner='asha' (Optuna successive halving, min resource {GRACE}, reduction {REDUCTION})",
    "median": "hpc-garage submit, pruner='median' (Optuna MedianPruner)",
    "ray": (f"Ray Tune ASHAScheduler (grace {GRACE}, reduction {REDUCTION}), login node, "
            f"ray.init(num_cpus={RAY_CPUS}, num_gpus={GPUS})"),
}
SAVE_GOAL = 0.6  # GPU-seconds of the pruned sweep / the unpruned one (issue 25)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--trials", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--step-seconds", type=float, default=0.2)
    parser.add_argument("--pruners", default="none,asha,median", help="hpc-garage's contenders")
    parser.add_argument("--ray-build-timeout", type=float, default=1800,
                        help="seconds to build Ray's virtual environment, if needed; past it Ray Tune is skipped")
    parser.add_argument("--no-ray", action="store_true")
    parser.add_argument("--no-ray-build", action="store_true",
                        help="Ray Tune only if this interpreter or the bench's cache has it (--quick: CI's time)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    size = {"trials": args.trials, "steps": args.steps, "step_seconds": args.step_seconds}
    sweeps: dict[str, list[dict[str, Any]]] = {}
    problems: dict[str, str] = {}
    ray_python: str | None = None
    if args.no_ray:
        problems["ray"] = "skipped: --no-ray"
    else:
        try:
            ray_python = find_ray(args.ray_build_timeout, build=not args.no_ray_build)
        except RuntimeError as exc:
            problems["ray"] = f"skipped: {exc}"
            say(f"pruning: Ray Tune {problems['ray']}")
    jobs = Jobs()
    try:
        for i in range(args.runs):
            for key in args.pruners.split(","):
                _attempt(sweeps, problems, key, i, args.runs, lambda: _ours(key, size, jobs))
            if ray_python:
                _attempt(sweeps, problems, "ray", i, args.runs, lambda: _ray(ray_python, size))
    finally:
        jobs.cancel()
    Path(args.out).write_text(json.dumps(summarize(sweeps, problems, size), indent=2))
    return 0


def _attempt(sweeps: dict[str, list[dict[str, Any]]], problems: dict[str, str], key: str, i: int, runs: int,
             run: Any) -> None:
    if key in problems:  # failed once: not again
        return
    try:
        sweep = run()
    except Exception as exc:  # noqa: BLE001 - reported in the table
        problems[key] = f"{type(exc).__name__}: {exc}"[:400]
        say(f"pruning: {key} failed: {problems[key]}")
        return
    sweeps.setdefault(key, []).append(sweep)
    say(f"pruning run {i + 1}/{runs}: {key}: {sweep['gpu_seconds']:.1f} GPU-s, makespan {sweep['makespan']:.1f} s, "
        f"{sweep['pruned']} pruned, best trial {sweep['best']['trial']}")


def _ours(pruner: str, size: dict[str, Any], jobs: Jobs) -> dict[str, Any]:
    wait_for_free_nodes()
    directory = scratch("pruning-")
    try:
        out = directory / "out.json"
        done = subprocess.run([str(BIN / "hpc-garage"), "submit", "--site", "lab-gpu", "--nodes", "2", str(EXAMPLE),
                               "--gpu", "yes", "--pruner", pruner, "--trials", str(size["trials"]), "--steps",
                               str(size["steps"]), "--step-seconds", str(size["step_seconds"]), "--out", str(out)],
                              cwd=directory, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"hpc-garage submit: {done.stderr.strip()[-300:]}")
        job = jobs.adopt(done.stdout + done.stderr)
        result = read_json_when_ready(out, 900, alive=lambda: Jobs.queued(job))
        jobs.end(job)
        return result
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# ----------------------------------------------------------------------------------------------- Ray Tune


def find_ray(build_timeout: float, build: bool = True) -> str:
    """An interpreter with Ray Tune: this one if it has Ray, else the bench's own virtual environment, built
    once (`pip install 'ray[tune]'` from the package registry) into a temporary folder renamed when whole
    (`build=False`: RuntimeError rather than a build)."""
    if importlib.util.find_spec("ray") is not None:
        return PYTHON
    python = RAY_VENV / "bin" / "python"
    if python.exists():
        if _imports_tune(str(python)):
            return str(python)
        shutil.rmtree(RAY_VENV, ignore_errors=True)  # a broken or half-built one
    if not build:
        raise RuntimeError(f"no Ray here nor in {RAY_VENV}, and --quick builds none (`python -m bench --only "
                           "pruning` does, once)")
    building = RAY_VENV.with_name(f"{RAY_VENV.name}.building-{os.getpid()}")
    say(f"pruning: building {RAY_VENV} for Ray Tune (once; pip install 'ray[tune]', at most {build_timeout:.0f} s)")
    started = time.monotonic()
    try:
        subprocess.run([PYTHON, "-m", "venv", str(building)], check=True, capture_output=True, timeout=120)
        done = subprocess.run([str(building / "bin" / "python"), "-m", "pip", "install", "-q", "ray[tune]"],
                              capture_output=True, text=True,
                              timeout=max(1.0, build_timeout - (time.monotonic() - started)))
        if done.returncode != 0:
            raise RuntimeError(f"pip install 'ray[tune]' failed: {done.stderr.strip()[-300:]}")
        try:
            building.rename(RAY_VENV)
        except OSError:  # another bench built it meanwhile
            pass
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"building Ray's virtual environment took over {build_timeout:.0f} s "
                           f"(pip install 'ray[tune]' into {RAY_VENV})") from None
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"{PYTHON} -m venv failed: {exc.stderr.decode(errors='replace').strip()[-300:]}") from None
    finally:
        shutil.rmtree(building, ignore_errors=True)
    if not _imports_tune(str(python)):
        raise RuntimeError(f"{python} cannot import ray.tune after pip install 'ray[tune]'")
    return str(python)


def _imports_tune(python: str) -> bool:
    done = subprocess.run([python, "-c", "import ray.tune"], capture_output=True, timeout=120)
    return done.returncode == 0


def _ray(python: str, size: dict[str, Any]) -> dict[str, Any]:
    """The sweep under Ray Tune, its figures computed as examples/pruned_sweep.py computes hpc-garage's."""
    if str(ROOT) not in sys.path:  # `python -m bench.tune_peer` from the repository has it already
        sys.path.insert(0, str(ROOT))
    from examples.pruned_sweep import best_of, learning_curve, sweep_params

    params = sweep_params(size["trials"])
    curves = [learning_curve(p["lr"], p["dropout"], size["steps"]) for p in params]
    spec = {"curves": curves, "step_seconds": size["step_seconds"], "gpus": GPUS, "num_cpus": RAY_CPUS,
            "cpu_per_trial": RAY_CPU_PER_TRIAL, "grace_period": GRACE, "reduction_factor": REDUCTION}
    result, wall = run_ray_script(python, "ray_tune_sweep.py", spec, "pruning-ray-")
    records = result["records"]
    finished = {r["trial"]: r["loss"] for r in records if not r["pruned"]}
    full = {i: c[-1] for i, c in enumerate(curves)}
    best, expected = best_of(finished), best_of(full)
    return {"pruner": "ray-asha", "trials": len(records), "pruned": sum(r["pruned"] for r in records),
            "gpu_seconds": sum(r["duration"] for r in records),
            "makespan": max(r["end"] for r in records) - min(r["start"] for r in records),
            "best": {"trial": best, "loss": finished[best]}, "expected_best": {"trial": expected, "loss": full[expected]},
            "wall": wall, "init_seconds": result["init_seconds"], "fit_seconds": result["fit_seconds"],
            "ray": result["ray"], "ray_best_trial": result["ray_best_trial"], "records": records}


# ------------------------------------------------------------------------------------------- analysis


def summarize(sweeps: dict[str, list[dict[str, Any]]], problems: dict[str, str], size: dict[str, Any]) -> dict[str, Any]:
    shape = (f"pruning: {size['trials']} trials x {size['steps']} steps of {size['step_seconds']:g} s, "
             "2 nodes x 4 fake GPUs (Ray: login node, 8 fake GPUs)")
    gpu_group, span_group = f"{shape}: GPU-seconds", f"{shape}: makespan"
    expected = next((s["expected_best"]["trial"] for runs in sweeps.values() for s in runs), None)
    figures: dict[tuple[str, str], Figure] = {}
    rows = {}
    for key in ("none", "asha", "median", "ray"):
        if key not in sweeps and key not in problems:
            continue
        runs = sweeps.get(key, [])
        ours = key in ("asha", "median")
        for group, field in ((gpu_group, "gpu_seconds"), (span_group, "makespan")):
            figure = Figure(group, LABELS[key], "s", [s[field] for s in runs], ours=ours)
            figures[(group, key)] = figure
        note = problems.get(key, "")
        if runs:
            bests = sorted({s["best"]["trial"] for s in runs})
            pruned = statistics.median(s["pruned"] for s in runs)
            note = (f"{pruned:g}/{size['trials']} trials pruned; best trial {', '.join(map(str, bests))} "
                    f"({'the best of the full curves' if bests == [expected] else f'the full curves: {expected}'})"
                    + (f"; {note}" if note else ""))
            if key == "ray":
                note += (f"; Ray {runs[0]['ray']}, {RAY_CPU_PER_TRIAL} CPU + 1 GPU per trial; ray.init "
                         f"{statistics.median(s['init_seconds'] for s in runs):.1f} s, Tuner.fit "
                         f"{statistics.median(s['fit_seconds'] for s in runs):.1f} s; Ray's own best (scope last): "
                         f"trial {runs[0]['ray_best_trial']}")
            steps = [r["steps"] for s in runs for r in s.get("records", []) if r.get("pruned")]
            rows[LABELS[key]] = {"gpu_seconds": statistics.median(s["gpu_seconds"] for s in runs),
                                 "makespan": statistics.median(s["makespan"] for s in runs), "pruned": pruned,
                                 "pruned_steps": round(statistics.mean(steps), 1) if steps else None,
                                 "best": bests, "same_best": bests == [expected]}
        figures[(gpu_group, key)].note = note
    for group in (gpu_group, span_group):
        peers = {key: f for (g, key), f in figures.items() if g == group and not f.ours and f.median}
        for (g, key), f in figures.items():
            if g != group or not f.ours or f.median is None:
                continue
            f.ratios = {p.label: f.median / p.median for p in peers.values()}
            if group != gpu_group:
                continue
            same = rows[LABELS[key]]["same_best"] and (
                "ray" not in peers or rows[LABELS["ray"]]["best"] == rows[LABELS[key]]["best"])
            saved = "none" not in peers or f.median / peers["none"].median <= SAVE_GOAL
            if key == "asha":
                f.goal = f"<= 1.0x Ray Tune's GPU-s and <= {SAVE_GOAL}x no pruner's; same best trial"
                if "ray" not in peers:  # the goal is against Ray Tune: without Ray's run it is not judged
                    f.met = None
                    f.note += "; against Ray Tune: not measured (Ray Tune did not run)"
                else:
                    f.met = f.median / peers["ray"].median <= 1.0 and saved and same
            else:
                f.goal = f"<= {SAVE_GOAL}x no pruner's GPU-s; same best trial"
                f.met = None if "none" not in peers else saved and same
    ordered = sorted(figures.items(), key=lambda item: item[0][0] != gpu_group)  # stable: one group, then the other
    return {"figures": [f.to_dict() for _, f in ordered], "size": size, "rows": rows,
            "expected_best": expected, "problems": problems,
            "sweeps": {k: [{x: v for x, v in s.items() if x != "records"} for s in runs] for k, runs in sweeps.items()}}



def run_ray_script(python: str, script: str, spec: dict[str, Any], prefix: str) -> tuple[dict[str, Any], float]:
    """bench/scripts/SCRIPT under Ray's interpreter with SPEC (its "storage" added) in a scratch folder: its
    output and wall seconds; RuntimeError if it failed or a trial did."""
    directory = scratch(prefix)
    try:
        spec_file, out = directory / "spec.json", directory / "out.json"
        spec_file.write_text(json.dumps({**spec, "storage": str(directory / "ray-results")}))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"RAY_USAGE_STATS_ENABLED": "0"}
        started = time.time()
        done = subprocess.run([python, str(SCRIPTS / script), str(spec_file), str(out)], cwd=directory,
                              env=env, capture_output=True, text=True, timeout=900)
        wall = time.time() - started
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"Ray Tune exited {done.returncode}: {done.stderr.strip()[-400:]}")
        result = json.loads(out.read_text())
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    failed = [r for r in result["records"] if "error" in r]
    if failed:
        raise RuntimeError(f"{len(failed)} Ray Tune trials failed: {failed[0]['error']}")
    return result, wall


if __name__ == "__main__":
    sys.exit(main())
