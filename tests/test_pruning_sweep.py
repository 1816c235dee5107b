"""Trials that report and a pruner that stops the poor ones (issue 25), end to end: examples/pruned_sweep.py
(32 seeded learning curves) on the real local SLURM with and without pruning, cancelled and resumed, and
examples/optuna_ask_tell.py (a TPE sampler driving the sweep). The curves themselves, and what ASHA does with
them, are checked without a cluster first. Trial attempts are counted from the files the example writes
under --marks (`start-<i>-<pid>-<ns>`, holding the task run id; `end-<i>-<pid>-<ns>`, holding its record)."""

from __future__ import annotations

import json
import re
import subprocess
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.slurm_jobs import wait_gone
from tests.test_durable import hpcg, site_file

SWEEP = ROOT / "examples" / "pruned_sweep.py"
ASK_TELL = ROOT / "examples" / "optuna_ask_tell.py"
slurm = [pytest.mark.slurm, pytest.mark.slow]

TRIALS, STEPS = 32, 30


def gpu_use(records: list[dict[str, Any]], gpus: int) -> list[float]:
    """examples/optuna_ask_tell.py's records of a fresh search: the search had as many trials in flight at once
    as GPUs, never more; its first `gpus` trials went one to each worker (each holds one GPU), none of which ran
    two at once. Returns each span a worker sat idle between trials while trials were still starting (a trial's
    end -> its worker's next start, or the last start on any worker).

    How many trials *ran* at once across workers is not asserted: it depends on the machine's load, not on the
    search. Under CI's load the first wave's workers started their first trial (Prefect's first task in each
    process) so far apart that the median pruner had stopped one at its second step before the last one began:
    proof 24 saw at most 7 of 8 running at once."""
    held = sorted([(r["in_flight"][0], 1) for r in records] + [(r["in_flight"][1], -1) for r in records])
    busy, most = 0, 0
    for _, step in held:  # an end before a start at the same instant: a freed GPU's next trial
        busy += step
        most = max(most, busy)
    assert most == gpus, (most, held)
    by_worker: dict[str, list[dict[str, Any]]] = {}
    for record in sorted(records, key=lambda r: r["start"]):
        by_worker.setdefault(record["worker"], []).append(record)
    assert sorted(runs[0]["number"] for runs in by_worker.values()) == list(range(gpus)), by_worker  # first wave
    last_start, gaps = max(r["start"] for r in records), []
    for worker, runs in by_worker.items():
        for before, after in zip(runs, [*runs[1:], None]):
            assert after is None or after["start"] >= before["end"], (worker, before, after)  # one at a time
            idle_until = last_start if after is None else after["start"]
            if idle_until > before["end"]:
                gaps.append(idle_until - before["end"])
    print(f"{len(records)} trials on {gpus} GPUs; a GPU idle between trials: max {max(gaps, default=0):.2f} s, "
          f"mean {sum(gaps) / max(1, len(gaps)):.2f} s")  # shown with -s: what the bounds below are held to
    return gaps


def curves_module() -> Any:
    from examples import pruned_sweep  # as bench/tune_peer.py imports it

    return pruned_sweep


def sweep_args(tmp_path: Path, name: str, pruner: str, step_seconds: float, *extra: str) -> list[str]:
    return [str(SWEEP), "--trials", str(TRIALS), "--steps", str(STEPS), "--step-seconds", str(step_seconds),
            "--pruner", pruner, "--gpu", "yes", "--out", str(tmp_path / f"{name}.json"), *extra]


def job_of(done: subprocess.CompletedProcess) -> str:
    job = re.search(r"submitted job (\S+)", done.stdout)
    assert job, done.stdout + done.stderr
    return job.group(1)


def marks_of(marks: Path, prefix: str) -> list[tuple[int, str]]:
    """(trial, what the file holds) of every attempt that reached `prefix` (start or end), oldest first."""
    found = []
    for p in marks.glob(f"{prefix}-*"):
        _, i, _pid, ns = p.name.split("-")
        found.append((int(ns), int(i), p.read_text()))
    return [(i, text) for _, i, text in sorted(found)]


def ended(marks: Path) -> dict[int, dict[str, Any]]:
    """Each trial's record as its last attempt that returned wrote it."""
    found = {}
    for i, text in marks_of(marks, "end"):
        try:
            found[i] = json.loads(text)
        except ValueError:  # written as the job was killed
            continue
    return found


def hex_id(run: str) -> str:
    return uuid.UUID(run).hex


def artifacts(status: dict[str, Any], keys: list[str]) -> list[dict[str, Any]]:
    """The artifacts with these keys on the job's flow runs, read back from the Prefect API the job used."""
    from hpc_garage.prefect.server import ensure_api
    from hpc_garage.prefect_api import PrefectApi
    from tests.conftest import outside_job_env

    prefect = status["run"]["progress"]["prefect"]
    server = ensure_api(env=outside_job_env())
    assert server["PREFECT_API_URL"] == prefect["api"], (server, prefect)
    flow_runs = [run["id"] for run in prefect["flow_runs"]]
    client = PrefectApi.from_env(server, timeout=10)
    assert client is not None
    return client.post("/artifacts/filter", {"artifacts": {"key": {"any_": keys}, "flow_run_id": {"any_": flow_runs}}})


# ------------------------------------------------------------------------------------ the curves alone


def test_the_curves_are_seeded_and_a_few_converge_well() -> None:
    sweep = curves_module()
    params = sweep.sweep_params(TRIALS)
    assert params == sweep.sweep_params(TRIALS) and params != sweep.sweep_params(TRIALS, seed=1)
    curves = [sweep.learning_curve(p["lr"], p["dropout"], STEPS) for p in params]
    assert curves == [sweep.learning_curve(p["lr"], p["dropout"], STEPS) for p in params]  # noise seeded too
    finals = sorted(c[-1] for c in curves)
    assert finals[0] < 0.1 and sum(f < 0.2 for f in finals) <= 8 and finals[len(finals) // 2] > 0.5, finals
    best = min(range(TRIALS), key=lambda i: curves[i][-1])
    for step in (0, 3, 15):  # ASHA's rungs (steps 1, 4, 16): the best trial leads at each
        assert curves[best][step] == min(c[step] for c in curves), step


def test_asha_on_the_curves_keeps_the_best_trial_within_60_percent_of_the_steps() -> None:
    """The sweep as 8 GPUs run it, simulated step by step in Optuna alone, with a pruning decision that takes
    effect up to 5 steps late and workers that lag at random: what the SLURM test below measures for real."""
    import random

    optuna = pytest.importorskip("optuna")
    from hpc_garage.pruning import make_pruner  # the named pruner task_runner(pruner="asha") uses

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sweep = curves_module()
    for lag in range(3):
        curves = [sweep.learning_curve(p["lr"], p["dropout"], STEPS) for p in sweep.sweep_params(TRIALS)]
        study, rng = optuna.create_study(pruner=make_pruner(sweep.make_pruner("asha"))), random.Random(lag)
        waiting, running, used, finished = list(range(TRIALS)), {}, 0, set()
        while waiting or running:
            while waiting and len(running) < 8:
                running[waiting.pop(0)] = [study.ask(), 0, None]
            for i, run in list(running.items()):
                if rng.random() < 0.2:
                    continue
                t, step, stop_at = run
                t.report(curves[i][step], step + 1)
                used += 1
                if stop_at is None and t.should_prune():
                    run[2] = stop_at = step + rng.randint(0, 5)
                if stop_at is not None and step >= stop_at:
                    study.tell(t, state=optuna.trial.TrialState.PRUNED)
                    del running[i]
                elif step == STEPS - 1:
                    study.tell(t, curves[i][-1])
                    finished.add(i)
                    del running[i]
                else:
                    run[1] = step + 1
        assert used <= 0.6 * TRIALS * STEPS, used
        assert min(finished, key=lambda i: curves[i][-1]) == min(range(TRIALS), key=lambda i: curves[i][-1])


# ------------------------------------------------------------ every named pruner, on a local Dask cluster

WAVE_TRIALS, WAVE_WORKERS, WAVE_STEP_SECONDS = 16, 4, 0.1


@pytest.fixture(scope="module")
def four_gpus(api: dict[str, str]) -> Any:
    """Four workers with one GPU each (one thread): the issue-31 sweep's 4 GPU workers."""
    from distributed import Nanny, Scheduler, SpecCluster

    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": ":0"}}
    workers = {f"gpu{i}": {"cls": Nanny, "options": {"nthreads": 1, "resources": {"GPU": 1}}}
               for i in range(WAVE_WORKERS)}
    with SpecCluster(workers=workers, scheduler=scheduler) as c:
        yield c


@pytest.mark.slow
@pytest.mark.parametrize("pruner", ["median", "percentile", "asha", "hyperband"])
def test_every_named_pruner_prunes_in_the_first_wave_and_never_the_best_trial(
        pruner: str, four_gpus: Any, tmp_path: Path) -> None:
    """Issue 31: examples/pruned_sweep.py, 16 trials of 30 steps on 4 GPU workers, whose best trial is the best at
    every step. Each named pruner stops a trial before any trial ran to the end (the first wave), uses at most
    0.6x the steps of the unpruned sweep (16 x 30: every trial to the end) and keeps its best trial (the best of
    the full curves, which the unpruned sweep finds: the SLURM test above checks that)."""
    import cloudpickle

    import hpc_garage

    sweep = curves_module()
    curves = [sweep.learning_curve(p["lr"], p["dropout"], STEPS) for p in sweep.sweep_params(WAVE_TRIALS)]
    best = min(range(WAVE_TRIALS), key=lambda i: curves[i][-1])
    assert all(curves[best][s] == min(c[s] for c in curves) for s in range(STEPS))  # the curves never cross it
    cloudpickle.register_pickle_by_value(sweep)  # worker processes need not import examples/
    out = tmp_path / "out.json"
    runner = hpc_garage.task_runner(address=four_gpus.scheduler_address, pruner=pruner, metric="loss")
    began = time.monotonic()
    sweep.pruned_sweep.with_options(task_runner=runner)(
        trials=WAVE_TRIALS, steps=STEPS, step_seconds=WAVE_STEP_SECONDS, gpu="yes", pruner=pruner, out=str(out))
    summary = json.loads(out.read_text())
    records = summary["records"]
    used = sum(r["steps"] for r in records)
    first_end = min(r["end"] for r in records if not r["pruned"])
    early = [r["trial"] for r in records if r["pruned"] and r["end"] < first_end]
    print(f"{pruner}: {summary['pruned']} pruned, {used} steps of {WAVE_TRIALS * STEPS} "
          f"({used / (WAVE_TRIALS * STEPS):.2f}), {len(early)} pruned before a first trial ended; "
          f"{time.monotonic() - began:.1f} s")
    assert early, f"{pruner} pruned nothing before a first trial ran to the end: {records}"
    assert used <= 0.6 * WAVE_TRIALS * STEPS, (pruner, used)
    [kept] = [r for r in records if r["trial"] == best]
    assert not kept["pruned"] and kept["steps"] == STEPS, kept
    assert summary["best"]["trial"] == summary["expected_best"]["trial"] == best, summary["best"]


# -------------------------------------------------------------------------------------- on the local SLURM


@pytest.mark.slurm
@pytest.mark.slow
def test_pruning_uses_at_most_60_percent_of_the_gpu_seconds_and_finds_the_same_best_trial(tmp_path: Path) -> None:
    """32 trials on 2 nodes x 4 fake GPUs with ASHA, and the same sweep without a pruner (submitted at the same
    time: it waits for the nodes). Pruned trials are counted in `status --json`, the report and Prefect."""
    site = site_file(tmp_path)
    began = time.monotonic()

    def submit(name: str, pruner: str) -> subprocess.CompletedProcess:
        return hpcg(["submit", "--site", str(site), "--nodes", "2", "--gpus-per-node", "4", "--time", "10", "--wait",
                     *sweep_args(tmp_path, name, pruner, 0.2)], tmp_path, timeout=900)

    with ThreadPoolExecutor(2) as pool:
        pruning, full_run = pool.submit(submit, "pruned", "asha"), pool.submit(submit, "full", "none")
        done, full_done = pruning.result(), full_run.result()
    print(done.stdout, full_done.stdout, f"both sweeps: {time.monotonic() - began:.0f} s", sep="\n")
    assert done.returncode == 0, done.stdout + done.stderr
    assert full_done.returncode == 0, full_done.stdout + full_done.stderr
    pruned, full = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("pruned", "full"))
    assert full["pruned"] == 0 and 0 < pruned["pruned"] < TRIALS, (full["pruned"], pruned["pruned"])
    ratio = pruned["gpu_seconds"] / full["gpu_seconds"]
    print(f"GPU-seconds: {pruned['gpu_seconds']:.1f} with ASHA ({pruned['pruned']} pruned), {full['gpu_seconds']:.1f}"
          f" without: {ratio:.2f}; makespan {pruned['makespan']:.1f} s vs {full['makespan']:.1f} s")
    assert ratio <= 0.6, ratio
    assert pruned["best"]["trial"] == full["best"]["trial"] == full["expected_best"]["trial"], \
        (pruned["best"], full["best"], full["expected_best"])
    index = {hex_id(r["run"]): r["trial"] for r in pruned["records"]}
    assert {r["trial"] for r in pruned["records"] if r["pruned"]} == \
        {r["trial"] for r in pruned["records"] if r["steps"] < STEPS}

    job = job_of(done)
    report = json.loads(hpcg(["report", job, "--json", "--site", str(site)], tmp_path).stdout)["metrics"]
    assert (report["pruned"], report["done"]) == (pruned["pruned"], TRIALS - pruned["pruned"]), report
    rows = {r["trial"]: r for r in report["trials"]}  # hpc-garage's trial ids -> their task runs
    assert index[hex_id(rows[report["best"]["trial"]]["run"])] == pruned["best"]["trial"], report["best"]
    status = json.loads(hpcg(["status", job, "--json", "--site", str(site)], tmp_path).stdout)
    live = status["run"]["progress"]["metrics"]
    assert live["pruned"] == pruned["pruned"] and live["best"]["trial"] == report["best"]["trial"], live
    assert {index[hex_id(r["run"])] for r in report["trials"] if r["state"] == "pruned"} == \
        {r["trial"] for r in pruned["records"] if r["pruned"]}
    text = hpcg(["report", job, "--site", str(site)], tmp_path).stdout
    print(text)
    timed = [json.loads(hpcg(["report", j, "--json", "--site", str(site)], tmp_path).stdout)["trials"]
             for j in (job, job_of(full_done))]  # task runs as the scheduler timed them: with Prefect's set-up
    by_report = [sum(t["duration_s"] * len(t.get("gpus") or ()) for t in trials) for trials in timed]
    print(f"GPU-seconds as the reports time the task runs: {by_report[0]:.1f} with ASHA, {by_report[1]:.1f} "
          f"without: {by_report[0] / by_report[1]:.2f}")
    assert f"{TRIALS - pruned['pruned']} ran to the end, {pruned['pruned']} pruned" in text, text
    assert re.search(r"pruning saved about [\d.]+ GPU-s", text), text

    found = artifacts(status, ["hpc-garage-sweep-metrics", "hpc-garage-trial-metrics"])
    [sweep_table] = [json.loads(a["data"]) for a in found if a["key"] == "hpc-garage-sweep-metrics"]
    assert (sweep_table[0]["pruned"], sweep_table[0]["done"]) == (pruned["pruned"], TRIALS - pruned["pruned"]), \
        sweep_table
    trial_tables = {uuid.UUID(a["task_run_id"]).hex: json.loads(a["data"]) for a in found
                    if a["key"] == "hpc-garage-trial-metrics"}
    assert set(trial_tables) == set(index), (len(trial_tables), len(index))
    assert {index[run] for run, rows in trial_tables.items() if rows[0]["state"] == "pruned"} == \
        {r["trial"] for r in pruned["records"] if r["pruned"]}


@pytest.mark.slurm
@pytest.mark.slow
def test_cancel_and_resume_of_a_pruned_sweep_runs_no_pruned_and_no_finished_trial_again(tmp_path: Path) -> None:
    """The ASHA sweep on 2 GPUs (0.4 s steps: a trial that runs to the end takes 12 s, while the other GPU
    goes through pruned ones; on 4, most of the sweep is done by then), cancelled once some trials were pruned
    and one ran to the end, then resumed: no trial that returned (pruned or finished) starts again, and a
    trial the pruner had stopped but that had not returned yet is stopped at its first report."""
    site = site_file(tmp_path)
    marks = tmp_path / "marks"
    done = hpcg(["submit", "--site", str(site), "--nodes", "1", "--gpus-per-node", "2", "--time", "10",
                 *sweep_args(tmp_path, "out", "asha", 0.4, "--marks", str(marks))], tmp_path)
    job = job_of(done)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        records = ended(marks)
        if sum(r["pruned"] for r in records.values()) >= 4 and any(not r["pruned"] for r in records.values()):
            break
        time.sleep(0.2)
    cancelled = hpcg(["cancel", job, "--site", str(site)], tmp_path, timeout=200)
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    wait_gone(job, 120)
    before = ended(marks)  # after the job is gone: nothing returns any more
    assert len(before) < TRIALS and not (tmp_path / "out.json").exists(), "the sweep ended before the cancel"
    from hpc_garage.rundir import RunDir

    summary = json.loads(RunDir(tmp_path / "runs" / job).metrics_summary.read_text())
    runs = {hex_id(text): i for i, text in marks_of(marks, "start")}
    stopped = {runs[t["run"]] for t in summary["trials"].values() if t["state"] == "pruned" and t["run"] in runs}
    starts_before = Counter(i for i, _ in marks_of(marks, "start"))
    print(f"at the cancel: {len(before)} trials returned ({sum(r['pruned'] for r in before.values())} pruned), "
          f"{len(stopped - set(before))} pruned but not returned, {len(starts_before)} started")

    resumed = hpcg(["resume", job, "--site", str(site), "--wait"], tmp_path, timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    starts = Counter(i for i, _ in marks_of(marks, "start"))
    again = {i: starts[i] - 1 for i in before if starts[i] > 1}
    assert not again, f"trials that returned before the cancel and ran again: {again}"
    after = ended(marks)
    assert set(after) == set(range(TRIALS)) and len(out["records"]) == TRIALS
    logs = "".join(p.read_text() for p in (tmp_path / "runs").glob("*.out"))
    for i in stopped - set(before):  # pruned by the study, interrupted before it returned: stopped at once
        if starts[i] > starts_before[i]:
            assert after[i]["pruned"] and after[i]["steps"] < STEPS, (i, after[i])
            assert f"task run {hex_id(after[i]['run'])}): the study has it as pruned" in logs, (i, after[i])
    assert {i for i, r in before.items() if r["pruned"]} <= {r["trial"] for r in out["records"] if r["pruned"]}
    assert out["best"]["trial"] == out["expected_best"]["trial"], out["best"]


@pytest.mark.slurm
@pytest.mark.slow
def test_an_optuna_sampler_drives_the_sweep_through_ask_and_tell_with_every_gpu_busy(tmp_path: Path) -> None:
    """examples/optuna_ask_tell.py on 1 node x 4 GPUs: as many trials in flight as GPUs, never two at once on a
    GPU, all four busy while trials were left to ask, and the study in its journal under the sweep's results
    has every trial, told."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    site = site_file(tmp_path)
    trials, out = 16, tmp_path / "search.json"
    done = hpcg(["submit", "--site", str(site), "--nodes", "1", "--gpus-per-node", "4", "--time", "10", "--wait",
                 str(ASK_TELL), "--trials", str(trials), "--steps", "15", "--step-seconds", "0.2", "--out", str(out)],
                tmp_path, timeout=600)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(out.read_text())
    assert summary["gpus"] == 4 and summary["trials"] == trials, summary
    assert sum(summary["states"].get(s, 0) for s in ("COMPLETE", "PRUNED")) == trials, summary["states"]
    records = summary["records"]
    assert len(records) == trials
    gaps = gpu_use(records, 4)  # while trials were left to ask, a freed GPU got the next one promptly
    assert max(gaps, default=0) < 3.0, gaps
    [journal] = (tmp_path / "runs" / "sweeps").glob("*/*/search.journal")
    study = optuna.load_study(study_name="search", storage=JournalStorage(JournalFileBackend(str(journal))))
    assert len(study.trials) == trials and all(t.state.is_finished() for t in study.trials)
