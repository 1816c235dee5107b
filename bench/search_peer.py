"""(issue 34) Adaptive search: `hpc_garage.search` (Optuna's TPE sampler, the task runner's ASHA pruner) against
Ray Tune (`Tuner` with its `OptunaSearch` searcher and `ASHAScheduler`) on the same synthetic objective: the
seeded learning curves of examples/pruned_sweep.py over (lr, dropout), 8 fake GPUs each.

    python -m bench.search_peer --runs 5 --out search.json [--trials 32 --steps 20 --step-seconds 0.25]

Contenders, interleaved (run i: hpc-garage, Ray Tune, then the resumed search while i < --resume-runs), each
run's sampler seeded with i on both sides:
- hpc-garage: examples/optuna_ask_tell.py (`hpc_garage.search(..., sampler="tpe")`: TPESampler(constant_liar=True),
  one trial per GPU worker) with `--pruner asha` (Optuna's successive halving, min resource 1, reduction 4:
  rungs at steps 1, 4, 16), `hpc-garage submit --nodes 2 --gpus-per-node 4`, one job each (a run directory of
  its own: a fresh study).
- Ray Tune (scripts/ray_tune_search.py): `OptunaSearch(sampler=TPESampler(constant_liar=True, seed=i))`,
  `ASHAScheduler(grace_period=1, reduction_factor=4, max_t=steps)`, `max_concurrent_trials=8`,
  `ray.init(num_cpus=2, num_gpus=8)`, each trial `{"cpu": 0.25, "gpu": 1}`, on the login node, in the pruning
  bench's Ray environment (bench/tune_peer.find_ray) with the same Optuna as hpc-garage's.
- hpc-garage resumed: the same search, cancelled (`hpc-garage cancel`, its checkpoint grace) once half its
  trials are told, then `hpc-garage resume`; against the uninterrupted one of the same run.
Figures per run, from each trial's start and end (inside its function; under Ray to the report it was stopped
at), 1 GPU each: GPU-seconds until the run's common best loss (the worse of the two sides' best final losses:
both reached it) was first reached (the GPU time all trials had used when the first trial reaching it ended),
GPU-seconds in all, and the best final loss once --budget GPU-seconds were used. Resumed: the GPU-seconds the
study counts over its jobs (hpc_garage.search's ledger, the same count for the uninterrupted search). Goals
(issue 34): <= 1.0x Ray Tune's GPU-seconds to the common best loss; resumed <= 1.1x the uninterrupted search.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import BIN, ROOT, Figure, Jobs, compare, read_json_when_ready, say, scratch, \
    wait_for_free_nodes
from bench.tune_peer import GRACE, GPUS, RAY_CPU_PER_TRIAL, RAY_CPUS, REDUCTION, find_ray, run_ray_script
from hpc_garage.tuning.ledger import GPU_SECONDS  # the study's own count of its GPU-seconds (a user attribute)

EXAMPLE = ROOT / "examples" / "optuna_ask_tell.py"
SPACE = {"lr": (1e-5, 1.0, True), "dropout": (0.0, 0.6, False)}  # examples/optuna_ask_tell.py's space
LABELS = {
    "ours": f"hpc_garage.search, sampler='tpe', pruner='asha' (min resource {GRACE}, reduction {REDUCTION}), "
            "submit on 2 nodes x 4 GPUs",
    "ray": (f"Ray Tune Tuner, OptunaSearch (TPE, constant liar) + ASHAScheduler (grace {GRACE}, reduction "
            f"{REDUCTION}), ray.init(num_cpus={RAY_CPUS}, num_gpus={GPUS})"),
    "whole": "hpc_garage.search, uninterrupted",
    "resumed": "hpc_garage.search, cancelled at half its trials, then `hpc-garage resume`",
}
RAY_GOAL, RESUME_GOAL = 1.0, 1.1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--resume-runs", type=int, help="runs with a resumed search too (default: --runs)")
    parser.add_argument("--trials", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--step-seconds", type=float, default=0.25)
    parser.add_argument("--budget", type=float, default=30.0, help="GPU-seconds: the best loss once they are used")
    parser.add_argument("--ray-build-timeout", type=float, default=1800)
    parser.add_argument("--no-ray", action="store_true")
    parser.add_argument("--no-ray-build", action="store_true", help="Ray Tune only where its environment is built")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    size = {"trials": args.trials, "steps": args.steps, "step_seconds": args.step_seconds, "budget": args.budget}
    resume_runs = args.runs if args.resume_runs is None else args.resume_runs
    runs: dict[str, list[dict[str, Any]]] = {}
    problems: dict[str, str] = {}
    ray_python = None if args.no_ray else _ray_python(problems, args.ray_build_timeout, not args.no_ray_build)
    if args.no_ray:
        problems["ray"] = "skipped: --no-ray"
    jobs = Jobs()
    try:
        for i in range(args.runs):
            _attempt(runs, problems, "ours", i, lambda: _ours(size, i, jobs))
            if ray_python:
                _attempt(runs, problems, "ray", i, lambda: _ray(ray_python, size, i))
            if i < resume_runs:
                _attempt(runs, problems, "resumed", i, lambda: _ours(size, i, jobs, cancel_at=args.trials // 2))
    finally:
        jobs.cancel()
    Path(args.out).write_text(json.dumps(summarize(runs, problems, size), indent=2))
    return 0


def _attempt(runs: dict[str, list[dict[str, Any]]], problems: dict[str, str], key: str, i: int, run: Any) -> None:
    if key in problems:  # failed once: not again
        return
    try:
        result = run() | {"run": i, "load": os.getloadavg()[0]}  # the machine is shared: each run's own load
    except Exception as exc:  # noqa: BLE001 - reported in the table
        problems[key] = f"{type(exc).__name__}: {exc}"[:400]
        say(f"search: {key} failed: {problems[key]}")
        return
    runs.setdefault(key, []).append(result)
    times = gpu_times(result["records"])
    say(f"search run {i + 1}: {key}: {len(result['records'])} trials, {times['gpu_seconds']:.1f} GPU-s, best loss "
        f"{times['best']}, study {result.get('study_gpu_seconds', 0):.1f} GPU-s, load {result['load']:.1f}")


# ------------------------------------------------------------------------------------------- hpc-garage


def _ours(size: dict[str, Any], seed: int, jobs: Jobs, cancel_at: int | None = None) -> dict[str, Any]:
    """One search as one `submit` job; `cancel_at`: cancelled once that many trials are told, then resumed."""
    wait_for_free_nodes()
    directory = scratch("search-")
    try:
        site, out = directory / "lab-gpu-bench.yaml", directory / "out.json"
        site.write_text((ROOT / "site-configs" / "lab-gpu.yaml").read_text() + f"run_directory: {directory / 'runs'}\n")
        started = time.time()
        job = _hpcg(["submit", "--site", str(site), "--nodes", "2", "--gpus-per-node", "4", "--time", "10",
                     str(EXAMPLE), "--pruner", "asha", "--trials", str(size["trials"]), "--steps", str(size["steps"]),
                     "--step-seconds", str(size["step_seconds"]), "--seed", str(seed), "--out", str(out)],
                    directory, jobs)
        cancelled: dict[str, Any] = {}
        if cancel_at is not None:
            cancelled = _cancel_when_told(directory, job, site, cancel_at, jobs)
            job = _hpcg(["resume", job, "--site", str(site)], directory, jobs)
        result = read_json_when_ready(out, 900, alive=lambda: Jobs.queued(job))
        wall = time.time() - started
        jobs.end(job)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    records = [{"number": r["number"], "loss": r["loss"], "complete": r["state"] == "complete", "start": r["start"],
                "end": r["end"]} for r in result["records"]]
    return {"records": records, "told": result["told"], "complete": result["complete"], "pruned": result["pruned"],
            "failed": result["failed"], "stopped": result["stopped"], "wall": wall, **cancelled,
            "study_gpu_seconds": result["gpu_hours"] * 3600,
            "study_best": None if result["best"] is None else result["best"]["value"]}


def _hpcg(argv: list[str], cwd: Path, jobs: Jobs | None = None) -> str:
    """Run `hpc-garage ARGV`; with `jobs`, the job it submitted ("submitted job N", "resumed sweep S as job N")."""
    done = subprocess.run([str(BIN / "hpc-garage"), *argv], cwd=cwd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"hpc-garage {argv[0]}: {(done.stdout + done.stderr).strip()[-300:]}")
    if jobs is None:
        return ""
    found = re.search(r"(?:submitted job|as job) (\d+)", done.stdout)
    if not found:
        raise RuntimeError(f"hpc-garage {argv[0]}: no job id in {done.stdout.strip()[-300:]!r}")
    jobs.ids.append(found.group(1))
    return found.group(1)


def _cancel_when_told(directory: Path, job: str, site: Path, told: int, jobs: Jobs) -> dict[str, Any]:
    """`hpc-garage cancel` (its wind-down) once the study in the job's journal has `told` trials told: how many
    were, the seconds from the cancel to the job's end, and the GPU-seconds the study counted by then."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    def study() -> Any:
        for path in (directory / "runs" / "sweeps").glob("*/*/search.journal"):
            try:
                return optuna.load_study(study_name="search", storage=JournalStorage(JournalFileBackend(str(path))))
            except KeyError:  # the journal is there, its study not yet
                return None
        return None

    def finished() -> int:
        found = study()
        return 0 if found is None else sum(t.state.is_finished() for t in found.get_trials(deepcopy=False))

    deadline = time.monotonic() + 600
    while (count := finished()) < told:
        if time.monotonic() > deadline or not Jobs.queued(job):
            raise RuntimeError(f"job {job} ended or took over 600 s before {told} trials were told ({count} were)")
        time.sleep(0.5)
    begun = time.monotonic()
    _hpcg(["cancel", job, "--site", str(site)], directory)
    jobs.wait_gone(job, 180)
    ended = time.monotonic() - begun
    return {"told_at_cancel": count, "cancel_seconds": ended,
            "study_gpu_seconds_at_cancel": float(study().user_attrs.get(GPU_SECONDS, 0.0))}


# ----------------------------------------------------------------------------------------------- Ray Tune


def _ray_python(problems: dict[str, str], timeout: float, build: bool) -> str | None:
    """Ray's interpreter (the pruning bench's environment) with the Optuna hpc-garage uses, or None (a problem)."""
    from importlib.metadata import version

    try:
        python = find_ray(timeout, build=build)
        wanted = version("optuna")
        if subprocess.run([python, "-c", f"import optuna, sys; sys.exit(optuna.__version__ != {wanted!r})"],
                          capture_output=True, timeout=120).returncode != 0:
            if not build:
                raise RuntimeError(f"Ray's environment has no optuna=={wanted} and --no-ray-build installs none")
            say(f"search: pip install optuna=={wanted} into Ray's environment (OptunaSearch needs it)")
            done = subprocess.run([python, "-m", "pip", "install", "-q", f"optuna=={wanted}"], capture_output=True,
                                  text=True, timeout=timeout)
            if done.returncode != 0:
                raise RuntimeError(f"pip install optuna=={wanted} failed: {done.stderr.strip()[-300:]}")
        return python
    except RuntimeError as exc:
        problems["ray"] = f"skipped: {exc}"
        say(f"search: Ray Tune {problems['ray']}")
        return None


def curve_source() -> str:
    """The source of examples/pruned_sweep.py's `learning_curve`, which Ray's script (no hpc-garage there) runs."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from examples.pruned_sweep import learning_curve

    return inspect.getsource(learning_curve)


def _ray(python: str, size: dict[str, Any], seed: int) -> dict[str, Any]:
    spec = {"curve_source": curve_source(), "space": SPACE, "trials": size["trials"], "steps": size["steps"],
            "step_seconds": size["step_seconds"], "seed": seed, "gpus": GPUS, "num_cpus": RAY_CPUS,
            "cpu_per_trial": RAY_CPU_PER_TRIAL, "grace_period": GRACE, "reduction_factor": REDUCTION}
    result, wall = run_ray_script(python, "ray_tune_search.py", spec, "search-ray-")
    records = [{k: r[k] for k in ("loss", "complete", "start", "end")} for r in result["records"]]
    return {"records": records, "told": len(records), "complete": sum(r["complete"] for r in records),
            "pruned": sum(not r["complete"] for r in records), "wall": wall, "ray": result["ray"],
            "optuna": result["optuna"], "init_seconds": result["init_seconds"], "fit_seconds": result["fit_seconds"]}


# ------------------------------------------------------------------------------------------- analysis


def used_by(records: list[dict[str, Any]], t: float) -> float:
    """GPU-seconds all trials had used by time `t` (1 GPU each, from its start to its end)."""
    return sum(max(0.0, min(r["end"], t) - r["start"]) for r in records)


def gpu_times(records: list[dict[str, Any]], target: float | None = None, budget: float | None = None) -> dict[str, Any]:
    """One run's figures: GPU-seconds in all, the best final loss (trials that ran every step), the GPU-seconds
    and the seconds (from the first trial's start) until a trial reaching `target` (default: that best) ended
    first, and the best final loss among the trials ended once `budget` GPU-seconds were used (None: all)."""
    complete = sorted((r for r in records if r["complete"]), key=lambda r: r["end"])
    best = min((r["loss"] for r in complete), default=None)
    target = best if target is None else target
    first = next((r["end"] for r in complete if target is not None and r["loss"] <= target), None)
    begun = min((r["start"] for r in records), default=0.0)
    within = None
    if budget is not None:
        ended = [r["loss"] for r in complete if used_by(records, r["end"]) <= budget]
        within = min(ended, default=None)
    return {"gpu_seconds": used_by(records, float("inf")), "best": best, "target": target,
            "to_target": None if first is None else used_by(records, first),
            "seconds_to_target": None if first is None else first - begun, "best_within_budget": within}


def summarize(runs: dict[str, list[dict[str, Any]]], problems: dict[str, str], size: dict[str, Any]) -> dict[str, Any]:
    shape = (f"search: {size['trials']} trials x up to {size['steps']} steps of {size['step_seconds']:g} s, TPE + "
             "ASHA, 8 fake GPUs")
    groups = {"to": f"{shape}: GPU-seconds to the run's common best loss",
              "wall": f"{shape}: seconds (first trial's start) to the common best loss",
              "all": f"{shape}: GPU-seconds in all",
              "budget": f"{shape}: best final loss after {size['budget']:g} GPU-seconds",
              "best": f"{shape}: best final loss at the search's end",
              "resume": f"{shape}: GPU-seconds the study counts, all jobs"}
    per_run: dict[int, dict[str, Any]] = {}
    for key in ("ours", "ray"):
        for run in runs.get(key, []):
            per_run.setdefault(run["run"], {})[key] = run
    rows: dict[str, dict[str, list[Any]]] = {"ours": {}, "ray": {}}
    for i, pair in sorted(per_run.items()):
        target = max((gpu_times(r["records"])["best"] for r in pair.values() if gpu_times(r["records"])["best"]
                      is not None), default=None)  # the worse of the bests: both sides reached it
        for key, run in pair.items():
            figures = gpu_times(run["records"], target, size["budget"])
            run["figures"] = figures
            for name, value in figures.items():
                rows[key].setdefault(name, []).append(value)
    figures: list[Figure] = []
    for key in ("ours", "ray"):
        if key not in runs and key not in problems:
            continue
        got = rows[key]
        note = problems.get(key, "")
        for group, field, unit in (("to", "to_target", "s"), ("wall", "seconds_to_target", "s"),
                                   ("all", "gpu_seconds", "s"), ("budget", "best_within_budget", "loss"),
                                   ("best", "best", "loss")):
            values = [v for v in got.get(field, []) if v is not None]
            figures.append(Figure(groups[group], LABELS[key], unit, values, ours=key == "ours"))
        missed = sum(v is None for v in got.get("best_within_budget", []))
        if missed:  # no trial had run every step by then: no final loss to show (Optuna's best counts none either)
            figures[-2].note = f"no trial had finished within {size['budget']:g} GPU-seconds in {missed} run(s)"
        if key in runs:
            done = runs[key]
            bests = got["best"]
            note = (f"best final loss {min(bests):.4f}–{max(bests):.4f} (median {statistics.median(bests):.4f}); "
                    f"trials pruned {statistics.median(r['pruned'] for r in done):g}/{size['trials']} (median)"
                    + (f"; {note}" if note else ""))
            if key == "ray":
                note += (f"; Ray {done[0]['ray']}, Optuna {done[0]['optuna']}; ray.init "
                         f"{statistics.median(r['init_seconds'] for r in done):.1f} s, Tuner.fit "
                         f"{statistics.median(r['fit_seconds'] for r in done):.1f} s (median)")
        figures[-5].note = note
    measured = "ray" in runs
    compare([f for f in figures if f.group == groups["to"]], f"<= {RAY_GOAL}x Ray Tune's GPU-seconds",
            lambda o, peers: o.median / peers[0].median <= RAY_GOAL if measured else None)
    for group in ("wall", "all", "budget", "best"):
        compare([f for f in figures if f.group == groups[group]], "", lambda o, peers: None)
    if not measured:
        for f in figures:
            if f.ours and f.group == groups["to"]:
                f.note += "; against Ray Tune: not measured (Ray Tune did not run): the target is its own best"
    figures += _resumed(runs, problems, groups["resume"])
    return {"figures": [f.to_dict() for f in figures], "size": size, "problems": problems,
            "runs": {k: [{x: v for x, v in r.items() if x != "records"} | {"trials": _compact(r["records"])}
                         for r in done] for k, done in runs.items()}}


def _compact(records: list[dict[str, Any]]) -> list[list[Any]]:
    """Each trial as [start, end (s from the run's first start), loss, ran every step]: the stored run keeps
    what every figure is computed from, so that another figure can be read from it later."""
    begun = min((r["start"] for r in records), default=0.0)
    return [[round(r["start"] - begun, 3), round(r["end"] - begun, 3), r["loss"], r["complete"]]
            for r in sorted(records, key=lambda r: r["start"])]


def _resumed(runs: dict[str, list[dict[str, Any]]], problems: dict[str, str], group: str) -> list[Figure]:
    """The resumed search against the uninterrupted one of the same runs: the GPU-seconds each study counts."""
    if "resumed" not in runs and "resumed" not in problems:
        return []
    done = runs.get("resumed", [])
    whole = {r["run"]: r for r in runs.get("ours", [])}
    paired = [r for r in done if r["run"] in whole]
    ours = Figure(group, LABELS["resumed"], "s", [r["study_gpu_seconds"] for r in paired], ours=True,
                  note=problems.get("resumed", ""))
    peer = Figure(group, LABELS["whole"], "s", [whole[r["run"]]["study_gpu_seconds"] for r in paired])
    if paired:
        def listed(key: str, of: list[dict[str, Any]], form: str = "{}") -> str:
            return ", ".join(form.format(r[key]) for r in of)

        before = [whole[r["run"]] for r in paired]
        ours.note = (f"cancelled once {listed('told_at_cancel', paired)} trials were told, the job gone "
                     f"{listed('cancel_seconds', paired, '{:.0f}')} s after `cancel`, the study counting "
                     f"{listed('study_gpu_seconds_at_cancel', paired, '{:.0f}')} GPU-s by then; told in the end "
                     f"{listed('told', paired)}; best loss {listed('study_best', paired, '{:.4f}')} (uninterrupted: "
                     f"{listed('study_best', before, '{:.4f}')}); first submit to result "
                     f"{statistics.median(r['wall'] for r in paired):.0f} s (uninterrupted "
                     f"{statistics.median(r['wall'] for r in before):.0f} s), median" + (
                         f"; {ours.note}" if ours.note else ""))
    compare([ours, peer], f"<= {RESUME_GOAL}x the uninterrupted search's", lambda o, peers: o.ratios[peers[0].label]
            <= RESUME_GOAL)
    return [ours, peer]


if __name__ == "__main__":
    sys.exit(main())
