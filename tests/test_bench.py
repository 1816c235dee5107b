"""bench/: its arithmetic (lower bound, GPU overlaps, ratios, goals), its report, and one quick run of the
whole thing (`python -m bench --quick`) so that it cannot rot. Nothing here asserts a timing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import common
from bench.common import Figure, compare, ratio_to_best
from bench.packing import gpu_overlaps, lower_bound
from bench.report import markdown

ROOT = Path(__file__).resolve().parent.parent


def trial(node: str, gpu: str, start: float, end: float) -> dict[str, object]:
    return {"kind": "gpu", "node": node, "gpu": gpu, "start": start, "end": end}


def test_lower_bound_is_the_busier_of_gpus_and_threads_plus_the_aggregation() -> None:
    assert lower_bound(48, 16, 1.0, 0.1, gpus=8, threads=16) == pytest.approx(6.1)  # GPUs bind
    assert lower_bound(8, 56, 1.0, 0.0, gpus=8, threads=16) == pytest.approx(4.0)  # threads bind


def test_gpu_overlaps_counts_trials_sharing_one_physical_gpu() -> None:
    back_to_back = [trial("n1", "0", 0, 1), trial("n1", "0", 1, 2), trial("n2", "0", 0, 2)]
    assert gpu_overlaps(back_to_back) == (0, 1)  # same id on another node is another GPU
    crowded = [trial("n1", "0", 0, 2), trial("n1", "0", 0.5, 1.5), trial("n1", "0", 1, 3), trial("n1", "1", 0, 3)]
    assert gpu_overlaps(crowded) == (3, 3)
    assert gpu_overlaps([{"kind": "cpu", "node": "n1", "gpu": None, "start": 0, "end": 1}] * 2) == (0, 0)


def test_ratios_and_goals_are_against_peers_of_the_same_group() -> None:
    figures = [Figure("g", "ours", "s", [1.0, 2.0, 3.0], ours=True), Figure("g", "a", "s", [4.0]),
               Figure("g", "b", "s", [2.5]), Figure("other", "c", "s", [0.1])]
    compare(figures, "<= 0.8x the best peer", lambda o, peers: ratio_to_best(o, peers) <= 0.8)
    assert figures[0].ratios == {"a": 0.5, "b": 0.8}
    assert figures[0].met is True and figures[0].goal == "<= 0.8x the best peer"
    faster = [Figure("g", "ours", "tasks/s", [50], ours=True, higher_is_better=True),
              Figure("g", "plain", "tasks/s", [10], higher_is_better=True)]
    compare(faster, ">= 5x", lambda o, peers: o.ratios["plain"] >= 5)
    assert faster[0].ratios == {"plain": 5.0} and faster[0].met is True


def test_report_shows_every_figure_with_its_goal_and_misses_in_bold() -> None:
    ours = Figure("start-up", "hpc-garage", "s", [5.0, 6.0, 7.0], ours=True)
    peer = Figure("start-up", "peer", "s", [2.0])
    compare([ours, peer], "<= 0.8x the best peer", lambda o, peers: ratio_to_best(o, peers) <= 0.8)
    report = {"machine": {"date": "today", "cpu": "x"}, "quick": False, "runs": 3, "seconds": 12.0,
              "benchmarks": {"startup": {"figures": [ours.to_dict(), peer.to_dict()]},
                             "packing": {"skipped": "no SLURM"}}}
    text = markdown(report)
    assert "| start-up | **hpc-garage** | 6.00 s | 5.00 s – 7.00 s | 3.00× peer | <= 0.8x the best peer | **no** |" in text
    assert "|  | peer | 2.00 s |" in text
    assert "skipped: no SLURM" in text and "- cpu: x" in text
    report["benchmarks"]["startup"]["phases"] = {"submit -> sample": 40.0, "ending the job": 4.04}
    assert "- wall time by phase: submit -> sample 40 s, ending the job 4 s" in markdown(report)


def test_phases_add_up_each_phase_over_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([0.0, 2.0, 10.0, 10.5, 20.0, 23.0])
    monkeypatch.setattr(common.time, "monotonic", lambda: next(clock))
    phases = common.Phases()
    for name in ("wait", "end", "wait"):
        with phases(name):
            pass
    assert phases.to_dict() == {"wait": 5.0, "end": 0.5}
    assert phases.since({"wait": 2.0}) == "wait 3.0 s, end 0.5 s"


def test_read_json_when_ready_waits_for_a_whole_file_and_gives_up_when_its_writer_ends(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    path.write_text(json.dumps({"first_task": 1.5}))
    assert common.read_json_when_ready(path, timeout=5) == {"first_task": 1.5}
    with pytest.raises(TimeoutError, match="ended"):
        common.read_json_when_ready(tmp_path / "never.json", timeout=60, alive=lambda: False, check_every=0)


QUICK = ("cli", "overhead", "faults", "trials", "reports", "ui", "packing", "pruning", "search", "startup",
         "deployment", "scale")  # scale: only named (`--quick --only scale`: 200 trials, 2 rows)


def test_the_quick_bench_tests_cover_every_benchmark_but_those_left_out_of_quick() -> None:
    from bench.__main__ import ORDER

    assert set(QUICK) == set(ORDER) - {"scaling", "workers", "server"}  # a 16-node SLURM, 1,024 workers, 3 servers


@pytest.mark.slow
@pytest.mark.slurm
# each benchmark with its own cluster and Prefect server, one test each so that the SLURM shards share them
# (tests/conftest.py: SHARDS); the pruning one adds 2 small SLURM jobs (Ray Tune only where its environment is
# built already: `--no-ray-build`)
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", QUICK)
def test_quick_bench_runs_every_benchmark(name: str, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "bench", "--quick", "--only", name, "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=850)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "latest.json").read_text())
    assert set(report["benchmarks"]) == {name}
    section = report["benchmarks"][name]
    assert section.get("figures"), section
    ours = [f for f in section["figures"] if f["ours"]]
    assert ours and all(f["values"] for f in ours), ours
    groups = {f["group"] for f in section["figures"]}
    if name == "startup":
        assert any(g.startswith("start-up, 1 node") for g in groups) and any("login node" in g for g in groups)
        if shutil.which("ch-run"):  # issue 33: the same submit inside a container, beside the one without
            inside = [f for f in ours if "inside a Charliecloud image" in f["label"]]
            assert len(inside) == 2 and all("the same without a container" in f["ratios"] for f in inside), inside
    if name == "overhead":
        recorded = section["recorded_in_api"]
        assert recorded and all(r["completed"] == r["submitted"] for r in recorded)
    assert "| benchmark | who | median |" in (tmp_path / "latest.md").read_text()
    stored = {json.loads(p.read_text())["name"] for p in (tmp_path / "runs").glob("*.json")}
    assert stored == {name}  # the benchmark's own output, kept beside the run's table
    assert f"## {name}" in (tmp_path / "index.md").read_text()


def test_each_benchmark_run_is_stored_with_its_machine_load_and_command_and_the_index_shows_every_run(
        tmp_path: Path) -> None:
    from bench.report import store_run, write_index

    def section(median: float, met: bool | None) -> dict:
        ours = Figure("deployment run vs submit", "deployment", "s", [median], ours=True, met=met)
        ours.ratios = {"submit": median / 10}
        return {"figures": [ours.to_dict(), Figure("deployment run vs submit", "submit", "s", [10.0]).to_dict()],
                "seconds": 30.0}

    for date, median, met in (("2026-11-26 10:00:00 UTC", 13.6, False), ("2026-11-27 09:30:00 UTC", 10.3, True)):
        machine = {"date": date, "load_average_at_start": 2.5, "cpu": "x"}
        stored = store_run(tmp_path, "deployment", section(median, met), machine,
                           "python -m bench --only deployment --runs 5", 3.25, 5, False)
        record = json.loads(stored.read_text())
        assert record["command"] == "python -m bench --only deployment --runs 5" and record["date"] == date
        assert record["load_average"] == {"start": 2.5, "end": 3.25} and record["machine"]["cpu"] == "x"
        page = stored.with_suffix(".md").read_text()
        assert "`python -m bench --only deployment --runs 5`" in page and f"- date: {date}" in page
    index = write_index(tmp_path).read_text().splitlines()
    rows = [line for line in index if "deployment run vs submit: deployment" in line]
    assert len(rows) == 2  # every set of runs, the newest first, the one that missed its goal too
    assert "2026-11-27 09:30:00" in rows[0] and "1.03× submit" in rows[0] and rows[0].endswith("| yes |")
    assert "2026-11-26 10:00:00" in rows[1] and "1.36× submit" in rows[1] and rows[1].endswith("| **no** |")


def test_per_task_overhead_is_idle_gpu_time_per_trial() -> None:
    from bench.packing import idle_per_trial

    run = {"start": 0.0, "trials": [trial("n1", "0", 1, 2), trial("n1", "0", 1.5, 3), trial("n1", "1", 0, 3)]}
    # 2 GPUs x 3 s span = 6 GPU-s; busy: GPU 0 from 1 to 3 (overlap counted once), GPU 1 all 3 s -> 1 s idle / 3 trials
    assert idle_per_trial(run, 2) == pytest.approx(1 / 3)


def test_scaling_model_reads_the_probe_samples_and_fits_cpu_per_worker() -> None:
    from bench.scaling import analyse, fit

    samples = [[100.0, 1.0, 1.0, 0], [101.0, 1.5, 2.0, 1], [102.0, 1.8, 2.5, 3], [102.5, 2.0, 3.0, 4]]
    one = analyse({"registered": 102.4, "samples": samples}, job_start=99.0, nodes=2, per_node=2)
    assert one["first_worker"] == pytest.approx(2.0) and one["registered"] == pytest.approx(3.4)
    assert one["window_cpu"] == pytest.approx(0.5) and one["cpu_per_worker"] == pytest.approx(0.5 / 3)
    assert fit([(3, 0.5), (7, 0.9), (15, 1.7)]) == (pytest.approx(0.2), pytest.approx(0.1))


@pytest.mark.slurm
@pytest.mark.slow  # starts a second SLURM cluster (about 20 s)
@pytest.mark.skipif(common.slurm_problem() is not None, reason="no local SLURM (scripts/local-slurm up)")
def test_local_slurm_brings_up_a_second_named_cluster_beside_the_default(tmp_path: Path) -> None:
    """README: `scripts/local-slurm up --name NAME --nodes N` is a separate cluster reached through SLURM_CONF;
    the default cluster (its controller, its nodes) is left exactly as it was."""
    import os

    import shutil
    import tempfile

    script, name = str(ROOT / "scripts" / "local-slurm"), "bt"
    lab = Path(tempfile.mkdtemp(prefix="hg-ls-", dir="/tmp"))  # short: slurmd's socket paths must fit 108 bytes
    env = {**os.environ, "LAB": str(lab), "FAKE_GPUS": "1"}
    default_nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True).stdout
    ctld = (Path("/tmp/hpc-garage-slurm/run/slurmctld.pid").read_text().strip()
            if Path("/tmp/hpc-garage-slurm/run/slurmctld.pid").exists() else None)
    try:
        up = subprocess.run(["bash", script, "up", "--name", name, "--nodes", "1"], env=env, capture_output=True,
                            text=True, timeout=120)
        assert up.returncode == 0, up.stderr[-500:]
        conf = lab / "etc" / "slurm.conf"
        assert f"SLURM_CONF={conf}" in up.stderr and "ClusterName=bt" in conf.read_text()
        ran = subprocess.run(["srun", "-N1", "-p", "gpu", "--gres=gpu:1", "printenv", "SLURMD_NODENAME"],
                             env={**env, "SLURM_CONF": str(conf)}, capture_output=True, text=True, timeout=60)
        assert ran.stdout.strip() == "bt1", ran.stderr
    finally:
        down = subprocess.run(["bash", script, "down", "--name", name], env=env, capture_output=True, text=True,
                              timeout=120)
        shutil.rmtree(lab, ignore_errors=True)
    assert down.returncode == 0, down.stderr[-500:]
    assert subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True).stdout == default_nodes
    if ctld is not None:
        assert Path("/tmp/hpc-garage-slurm/run/slurmctld.pid").read_text().strip() == ctld


def test_peers_and_servers_start_the_environments_own_interpreter() -> None:
    """A venv's python is a link to its base interpreter: resolved, it lacks the venv's packages (the managed
    server's keeper then failed with "No module named prefect" in a fresh venv)."""
    assert common.PYTHON == sys.executable
    assert common.BIN == Path(sys.executable).parent


def sweep(gpu_seconds: float, makespan: float, pruned: int, best: int, expected: int = 3) -> dict[str, object]:
    return {"gpu_seconds": gpu_seconds, "makespan": makespan, "pruned": pruned, "best": {"trial": best},
            "expected_best": {"trial": expected}}


def test_pruning_judges_asha_against_ray_tune_and_the_unpruned_sweep_with_the_same_best_trial() -> None:
    from bench.tune_peer import LABELS, summarize

    size = {"trials": 32, "steps": 30, "step_seconds": 0.2}
    sweeps = {"none": [sweep(200.0, 30.0, 0, 3)], "asha": [sweep(60.0, 12.0, 24, 3)],
              "median": [sweep(130.0, 20.0, 10, 5)], "ray": [sweep(50.0, 10.0, 25, 3) | {"ray": "2.60.0", "init_seconds": 8.0, "fit_seconds": 20.0, "ray_best_trial": 3}]}
    out = summarize(sweeps, {}, size)
    gpu = {f["label"]: f for f in out["figures"] if f["group"].endswith("GPU-seconds")}
    asha, median = gpu[LABELS["asha"]], gpu[LABELS["median"]]
    assert asha["ratios"] == {LABELS["none"]: 0.3, LABELS["ray"]: 1.2} and asha["met"] is False  # 1.2x Ray Tune's
    assert median["met"] is False and "the full curves: 3" in median["note"]  # 0.65x, and another best trial
    assert [f["group"].endswith("GPU-seconds") for f in out["figures"]] == [True] * 4 + [False] * 4  # one group, then the other
    sweeps["asha"] = [sweep(45.0, 12.0, 26, 3)]
    assert next(f for f in summarize(sweeps, {}, size)["figures"] if f["label"] == LABELS["asha"])["met"] is True
    skipped = summarize({k: v for k, v in sweeps.items() if k != "ray"}, {"ray": "skipped: no pip"}, size)
    ray = next(f for f in skipped["figures"] if f["label"] == LABELS["ray"])
    assert ray["values"] == [] and ray["note"] == "skipped: no pip"
    asha_alone = next(f for f in skipped["figures"] if f["label"] == LABELS["asha"])
    assert asha_alone["met"] is None and "against Ray Tune: not measured" in asha_alone["note"]  # no Ray, no verdict
    text = markdown({"machine": {"date": "today"}, "quick": False, "runs": 1, "seconds": 1.0,
                     "benchmarks": {"pruning": skipped | {"seconds": 60}}})
    assert "| skipped |" in text and f"| {LABELS['asha']} | 45.0 s | 12.0 s | 26 | – | 3 |" in text


def ran(start: float, end: float, loss: float, complete: bool = True) -> dict[str, object]:
    return {"start": start, "end": end, "loss": loss, "complete": complete}


def test_search_figures_count_the_gpu_time_used_until_a_loss_was_first_reached_and_within_a_budget() -> None:
    from bench.search_peer import gpu_times, used_by

    records = [ran(0, 4, 0.5), ran(0, 1, 0.2, complete=False), ran(1, 3, 0.3), ran(4, 9, 0.1)]
    assert used_by(records, 2) == 4 and used_by(records, float("inf")) == 12
    # best 0.1 (a pruned trial's 0.2 is no final loss): reached when the last trial ended, all 12 GPU-s used
    assert gpu_times(records) == {"gpu_seconds": 12, "best": 0.1, "target": 0.1, "to_target": 12,
                                  "seconds_to_target": 9, "best_within_budget": None}
    # 0.3 first: the trial ending at 3 (GPU-s by then: 3 + 1 + 2), not the 0.5 one ending later
    common = gpu_times(records, target=0.3, budget=7)
    assert common["to_target"] == 6 and common["seconds_to_target"] == 3
    assert common["best_within_budget"] == 0.3  # 7 GPU-s by t = 4: the trials ended by then, 0.5 and 0.3
    assert gpu_times(records, target=0.05)["to_target"] is None  # never reached
    assert gpu_times([ran(0, 1, 0.4, complete=False)])["best"] is None


def search_run(run: int, records: list[dict[str, object]], **extra: object) -> dict[str, object]:
    return {"run": run, "records": records, "pruned": 1, **extra}


def test_search_judges_hpc_garage_against_ray_tune_at_each_runs_common_best_and_the_resume_against_the_whole() -> None:
    from bench.search_peer import LABELS, summarize

    size = {"trials": 4, "steps": 10, "step_seconds": 0.1, "budget": 5.0}
    ray = {"ray": "2.60.0", "optuna": "5.0.0", "init_seconds": 5.0, "fit_seconds": 20.0}
    ours = [search_run(0, [ran(0, 2, 0.3), ran(0, 1, 0.9, False), ran(2, 4, 0.2)], study_gpu_seconds=5.0,
                       study_best=0.2, wall=30.0),
            search_run(1, [ran(0, 3, 0.25), ran(0, 1, 0.9, False)], study_gpu_seconds=4.0, study_best=0.25, wall=28.0)]
    rays = [search_run(0, [ran(0, 3, 0.3), ran(0, 4, 0.25)], **ray),  # run 0's common best: 0.25 (Ray's)
            search_run(1, [ran(0, 2, 0.2), ran(0, 2, 0.6)], **ray)]   # run 1's: 0.25 (ours)
    resumed = [search_run(0, [], study_gpu_seconds=6.0, study_best=0.2, wall=70.0, told_at_cancel=2, told=4,
                          cancel_seconds=12.4, study_gpu_seconds_at_cancel=3.5)]
    out = summarize({"ours": ours, "ray": rays, "resumed": resumed}, {}, size)
    figures = {(f["group"].split(": ", 2)[2], f["label"]): f for f in out["figures"]}
    to_best = figures[("GPU-seconds to the run's common best loss", LABELS["ours"])]
    # ours reach 0.25 at t = 4 (0.2 <= 0.25; 5 GPU-s used) and at t = 3 (4 GPU-s); Ray at t = 4 (7) and t = 2 (4)
    assert to_best["values"] == [5.0, 4.0] and to_best["ratios"] == {LABELS["ray"]: 4.5 / 5.5}
    assert to_best["met"] is True and to_best["goal"] == "<= 1.0x Ray Tune's GPU-seconds"
    assert figures[("GPU-seconds to the run's common best loss", LABELS["ray"])]["values"] == [7.0, 4.0]
    assert figures[("GPU-seconds in all", LABELS["ours"])]["values"] == [5.0, 4.0]
    within = figures[("best final loss after 5 GPU-seconds", LABELS["ours"])]
    assert within["values"] == [0.2, 0.25] and within["unit"] == "loss" and within["met"] is None
    ray_within = figures[("best final loss after 5 GPU-seconds", LABELS["ray"])]
    assert ray_within["values"] == [0.2] and "within 5 GPU-seconds in 1 run(s)" in ray_within["note"]  # 7 GPU-s at t = 3
    resume = figures[("GPU-seconds the study counts, all jobs", LABELS["resumed"])]
    assert resume["values"] == [6.0] and resume["ratios"] == {LABELS["whole"]: 1.2} and resume["met"] is False
    assert "cancelled once 2 trials were told, the job gone 12 s after `cancel`, the study counting 4 GPU-s" in \
        resume["note"]
    at_end = figures[("best final loss at the search's end", LABELS["ray"])]
    assert at_end["values"] == [0.25, 0.2] and at_end["ratios"] == {}  # Ray's, the peer: ours has the ratio
    assert figures[("best final loss at the search's end", LABELS["ours"])]["ratios"] == {LABELS["ray"]: 1.0}
    assert out["runs"]["ours"][0]["trials"][1] == [0, 1, 0.9, False]  # what each figure is read from, kept
    slower = summarize({"ours": ours, "ray": [search_run(0, [ran(0, 1, 0.3), ran(0, 1.5, 0.25)], **ray),
                                               rays[1]]}, {}, size)
    assert next(f for f in slower["figures"] if f["ours"])["met"] is False  # 4.5 against Ray's 2.75
    alone = summarize({"ours": ours}, {"ray": "skipped: no pip"}, size)
    first = alone["figures"][0]
    assert first["met"] is None and "against Ray Tune: not measured" in first["note"]  # no Ray, no verdict
    assert [f["values"] for f in alone["figures"] if f["label"] == LABELS["ray"]][0] == []
    text = markdown({"machine": {"date": "today"}, "quick": False, "runs": 2, "seconds": 1.0,
                     "benchmarks": {"search": out | {"seconds": 60}}})
    assert f"| **{LABELS['ours']}** | 0.2250 | 0.2000 – 0.2500 |" in text  # a loss, not "225 ms"
    assert "| 1 | ours | 0.2000 | 0.2500 | 5.0 | 4.0 | 5.0 | 1 |" in text  # each run's pair, at its common best


def test_ray_tunes_search_script_computes_the_examples_learning_curves() -> None:
    """bench/scripts/ray_tune_search.py runs where hpc-garage is not installed: it executes the source of
    examples/pruned_sweep.learning_curve that the bench hands it, which must give the very same curves."""
    import math
    import random

    from bench.search_peer import curve_source
    from examples.pruned_sweep import learning_curve

    namespace: dict[str, object] = {"math": math, "random": random}
    exec(curve_source(), namespace)
    assert namespace["learning_curve"](0.003, 0.25, 12) == learning_curve(0.003, 0.25, 12)


def test_report_cost_is_per_call_against_the_loop_that_never_reports_and_latency_by_window() -> None:
    from bench.report_cost import IDLE, MEDIAN, NEVER, PLAIN, summarize

    def run(seconds: float) -> list[dict[str, object]]:
        return [{"seconds": seconds, "pruned": False}, {"seconds": seconds, "pruned": False}]

    samples = {NEVER: [run(0.01)], PLAIN: [run(0.21)], MEDIAN: [run(0.51)]}
    windows = [(IDLE, -1, 0.0, 10.0), (NEVER, 0, 20.0, 21.0), (PLAIN, 0, 30.0, 33.0), (MEDIAN, 0, 40.0, 45.0)]
    latencies = [[t, 0.002] for t in range(0, 10)] + [[31.0, 0.03], [32.0, 0.2], [41.0, 0.01]]
    out = summarize(10_000, 2, 1, samples, windows, latencies)
    figures = {f["label"]: f for f in out["figures"]}
    assert figures[PLAIN]["values"] == [pytest.approx(20.0)] and figures[PLAIN]["met"] is True  # µs per call
    assert figures[MEDIAN]["values"] == [pytest.approx(50.0)]
    assert figures[f"while {PLAIN}"]["values"] == [0.2] and figures[f"while {PLAIN}"]["met"] is False  # p95 over 100 ms
    assert figures[f"while {MEDIAN}"]["met"] is True and figures[IDLE]["values"] == [0.002]
    assert out["latency"][PLAIN]["samples"] == 2 and NEVER not in out["latency"]


def test_workers_bench_reads_registration_cpu_heartbeat_lags_and_removals_from_the_schedulers_record() -> None:
    from bench.workers import analyse, refit, summarize

    stats = {"added": [100.0, 101.0, 104.0], "cpu": [[1.0, 2.0], [1.5, 2.5], [2.0, 4.0]],
             "lag": [[100.5, 0.1], [102.0, 0.3], [103.0, 0.2], [110.0, 2.0], [111.0, -0.1]],
             "removed": [[120.0, "check-worker-ttl-120"], [121.0, "handle-worker-cleanup-121"]], "ttl_s": 300}
    one = analyse(stats, 3, started=98.0)
    assert one["registration_s"] == 4.0 and one["from_start_s"] == 6.0
    assert one["cpu_per_worker_s"] == 0.5 and one["window_cpu_s"] == 1.0 and one["process_cpu_s"] == 2.0
    assert one["registering"]["heartbeats"] == 3 and one["registering"]["lag_median_s"] == 0.2
    assert one["registering"]["lag_max_s"] == 0.3 and one["after"]["lag_max_s"] == 2.0
    assert one["removed"] == 2 and one["removed_for_heartbeats"] == 1
    sizes = [{"workers": w, "registration_s": 1 + 0.01 * w, "window_cpu_s": 0.002 * (w - 1)} for w in (128, 256, 512)]
    model = refit(sizes)
    assert model is not None and abs(model["per_worker_s"] - 0.01) < 1e-9 and abs(model["intercept_s"] - 1) < 1e-9
    assert abs(model["cpu_per_worker_s"] - 0.002) < 1e-9 and model["largest"] == 512
    assert abs(model["predicted_s"] - 0.002 * model["target"]) < 1e-6  # the serial part: scheduler CPU
    assert refit(sizes[:1]) is None  # one size is no line
    noisy = [{"workers": w, "registration_s": 60 - 0.04 * w, "window_cpu_s": c} for w, c in ((512, 3.0), (1024, 2.0))]
    model = refit(noisy)  # a falling line (load, not size): the model still grows with the workers, never below 0
    assert model is not None and model["cpu_per_worker_s"] > 0 and model["predicted_s"] > 0 and model["points"] == 2
    sample = one | {"load": 1.0, "settings": {"distributed.comm.timeouts.connect": "30s"}, "rss": {"scheduler_mb": 1.0, "worker_process_mb": 2.0},
                    "tasks": {"tasks": 10, "seconds": 2.0, "rate": 5.0, "held_s": 3.0, "right": True, "workers_after": 3}}
    result = summarize([sample, {"workers": 1024, "error": "TimeoutError: registered not written"}], 10, 3.0, 128)
    groups = [f["group"] for f in result["figures"]]
    assert any(g.startswith("3 workers on one scheduler") for g in groups)
    assert any(g.startswith("1,024 workers") and not f["values"] for g, f in zip(groups, result["figures"]))
    assert [f["values"] for f in result["figures"] if f["unit"] == "tasks/s"] == [[5.0]]


def test_the_benchmarks_page_shows_figures_only_from_stored_outputs() -> None:
    """docs/benchmarks.md includes bench/results/ files for its figures: no table or ratio of its own."""
    page = (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
    includes = [line.split('"')[1].split(":")[0] for line in page if line.startswith("--8<--")]
    assert includes and all(path.startswith("bench/results/") and (ROOT / path).is_file() for path in includes)
    assert "bench/results/index.md" in includes and "bench/results/latest.md" in includes
    typed = [line for line in page if not line.startswith("--8<--") and (line.startswith("|") or "×" in line)]
    assert typed == []


def test_scale_bench_reads_the_time_per_thousand_and_the_process_kinds_and_renders_its_rows() -> None:
    """bench/scale.py (issue 32): its arithmetic, no timing asserted."""
    from bench.report import markdown
    from bench.scale import Job, Sampler, kind_of, per_thousand, section

    ends = [i * 0.01 for i in range(2000)] + [20 + i * 0.02 for i in range(1, 1001)]  # 3,000, slower at the end
    found = per_thousand(list(reversed(ends)), 3000)
    assert found == {"per_1000_start_s": pytest.approx(10.0), "per_1000_end_s": pytest.approx(20.0, abs=0.1)}
    assert per_thousand([i * 0.01 for i in range(200)], 200) == {"per_1000_start_s": 10.0, "per_1000_end_s": 10.0}
    assert per_thousand([1.0], 1) == {"per_1000_start_s": None, "per_1000_end_s": None}
    assert kind_of(7, 7, "hpc-garage run --site local -- python -m bench.scale_flow 10") == "scheduler"
    assert kind_of(8, 7, "python -m bench.scale_flow 10 out.json") == "flow"
    assert kind_of(9, 7, "python3 -B -c from multiprocessing.forkserver import main; main(6, 8, "
                         "['distributed', 'hpc_garage.prefect.worker'])") == "workers"
    assert kind_of(10, 7, "python3 -m prefect server start --host 127.0.0.1") == "server"
    assert kind_of(11, 7, "postgres -D /x") == "database"
    assert kind_of(12, 7, "python3 -m hpc_garage.prefect.server prefect server start --port 9") == "server"
    # a batch job's (--site): the bench's `submit --wait` is the root and follows it; `run` in the job holds the
    # scheduler, whatever its pid; the flow runs as a script; each node's process hosts that node's workers
    assert kind_of(7, 7, "/v/bin/hpc-garage submit --site lab-cpu -N 2 --wait /r/bench/scale_flow.py 10 o") == "other"
    assert kind_of(20, 7, "python3 -m hpc_garage run --site /r/lab-cpu.yaml -- python3 /r/bench/scale_flow.py 10") \
        == "scheduler"
    assert kind_of(21, 7, "python3 /r/bench/scale_flow.py 10 /h/flow.json hpc-garage") == "flow"
    assert kind_of(22, 7, "python3 -m hpc_garage.launchers.mpi /h/runs/5/ranks.json 1") == "workers"
    assert kind_of(23, 7, "srun --nodes=1 --ntasks=1 python3 -m hpc_garage.launchers.mpi /h/ranks.json 1") == "other"
    sampler = Sampler(7, "/nonexistent")  # cores busy by kind: first tenth and last tenth of the samples
    sampler.cpu = [(float(t), {"server": 0.5 * t if t < 90 else 45 + 0.9 * (t - 90), "flow": 0.2 * t})
                   for t in range(101)]
    assert sampler.cores_by_kind() == {"flow": "0.20 → 0.20", "server": "0.50 → 0.90"}
    row = {"kind": "hpc-garage", "n": 3000, "right": True, "seconds": 20.0, "trials_per_s": 150.0,
           "per_1000_start_s": 6.0, "per_1000_end_s": 6.5, "peak_rss_mib": {"flow": 200, "scheduler": 300},
           "server_cpu_ms_per_trial": 3.5, "cores_start_end": {"server": "0.50 → 0.90"}, "database_mib": 512.0,
           "ui": {"caught_up_s": 9.0, "flow_run_page_s": 0.8, "task_runs_tab_s": 2.5, "screenshot": "x.png"}}
    slow = row | {"per_1000_end_s": 9.0}
    peer = row | {"kind": "dask", "trials_per_s": 500.0}
    for rows, met in (([row, peer], True), ([slow, peer], False),
                      ([row | {"trials_per_s": 90.0}, peer], False)):
        ours = [f for f in section(rows)["figures"] if f["ours"]]
        assert [f["met"] for f in ours] == [met]
    result = section([row, peer, {"kind": "threads", "n": 3000, "right": False, "error": "exit code 1"}])
    assert [f["values"] for f in result["figures"]] == [[150.0], [500.0], []]
    assert result["figures"][0]["group"].endswith("2 workers")  # SQLite: as every earlier row
    on_postgres = section([row | {"database": "postgresql (managed)"}, peer])["figures"]
    assert on_postgres[0]["group"].endswith(", Prefect's database postgresql (managed)") and on_postgres[0]["ours"]
    job = Job("lab-cpu", 2)
    assert job.argv(["10", "o.json", "hpc-garage"])[1:10] == ["submit", "--site", "lab-cpu", "-N", "2", "--time",
                                                              "01:00:00", "--wait", str(ROOT / "bench/scale_flow.py")]
    as_job = section([row | {"job": job.says()}])["figures"][0]
    assert as_job["group"] == "issue 32 scale: 3,000 trivial tagged trials, `hpc-garage submit --site lab-cpu -N 2`, " \
        "the local SLURM"
    text = markdown({"machine": {"date": "today"}, "quick": False, "runs": 1, "seconds": 1.0,
                     "benchmarks": {"scale": result}})
    assert "| hpc-garage | 3,000 | 150.0 | 6.0 s → 6.5 s | flow 200, scheduler 300 | 3.5 ms | 512 MiB | " \
        "server 0.50 → 0.90 |" in text
    assert ("- the UI after 3,000 trials (chromium, SQLite): flow-run page 0.8 s, Task Runs tab 2.5 s, once the "
            "server had caught up (9.0 s after the run); `x.png`") in text
    assert "| threads | 3,000 | failed: exit code 1 |" in text


def test_scale_bench_measures_the_servers_database_on_disk(tmp_path: Path) -> None:
    from bench.scale import database_mib

    state = tmp_path / ".hpc-garage" / "prefect" / "host"
    assert database_mib(tmp_path) is None  # no server ran under this HOME
    (state / "home").mkdir(parents=True)
    (state / "home" / "prefect.db").write_bytes(b"x" * 2**20)
    (state / "home" / "prefect.db-wal").write_bytes(b"x" * 2**19)
    (state / "server.log").write_bytes(b"x" * 2**20)  # not the database
    assert database_mib(tmp_path) == 1.5
    data = state / "postgres" / "data"
    (data / "base" / "1").mkdir(parents=True)
    for mark in (data / "PG_VERSION", data / "base" / "1" / "PG_VERSION"):
        mark.write_text("15\n")
    (data / "base" / "1" / "16384").write_bytes(b"x" * 2**20)
    assert database_mib(tmp_path) == 2.5  # the data directory (from its top PG_VERSION) counted once


def test_scale_bench_counts_the_events_the_server_dropped_and_stored_and_keeps_a_failed_rows_logs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sqlite3

    from bench import scale
    from hpc_garage.prefect.server.serve import DROP_LINES, DroppedEvents

    MEMORY = "prefect.server.utilities.messaging.memory"  # noqa: N806
    state = tmp_path / ".hpc-garage" / "prefect" / "host"
    assert scale.server_events(tmp_path) == {}  # no server ran under this HOME
    (state / "home").mkdir(parents=True)
    line = "19:32:18.227 | WARNING | prefect.server.utilities.messaging.memory - {} for topic='events'\n"
    (state / "server.log").write_text(line.format("Subscription queue is full, dropping message") * 3
                                      + line.format("Delivered message") + "Event queue full (5/5), dropping event\n"
                                      + line.format(DroppedEvents.SAYS % (DROP_LINES[MEMORY], 12, 16)))
    db = sqlite3.connect(state / "home" / "prefect.db")
    db.execute("CREATE TABLE events (id TEXT)")
    db.executemany("INSERT INTO events VALUES (?)", [("a",), ("b",)])
    db.commit()
    db.close()
    assert scale.server_events(tmp_path) == {"events_dropped": 16, "events_stored": 2}

    monkeypatch.setattr(scale, "ROOT", tmp_path / "repo")
    (tmp_path / ".hpc-garage" / "runs").mkdir()
    (tmp_path / ".hpc-garage" / "runs" / "64.out").write_text("the job's log\n")
    (state / "server.log").write_text("".join(f"{i}\n" for i in range(1000)))
    kept = scale.keep_logs(tmp_path, "row")
    assert kept == tmp_path / "repo" / "bench" / "results" / "failed" / "row"
    assert (kept / "64.out").read_text() == "the job's log\n"
    assert (kept / "server-host.log").read_text().splitlines() == [str(i) for i in range(600, 1000)]


def test_server_cost_bench_subtracts_the_idle_servers_cpu_and_judges_the_managed_figure_only() -> None:
    from bench.server_cost import VARIANTS, cpu_per_task, summarize

    assert cpu_per_task(10.0, 0.02, 100.0, 1000) == pytest.approx(0.008)  # 10 s less 2 s idle, over 1,000
    assert cpu_per_task(1.0, 0.02, 100.0, 1000) == 0.0  # never below 0
    run = {"cpu_ms_per_task": 6.0, "raw_cpu_ms_per_task": 6.8, "flow_s": 40.0, "seconds": 47.0, "server_cpu_s": 6.8,
           "idle_cpu_per_s": 0.018, "database_mb_per_100k": 950.0, "load": 15.0}
    result = summarize({"managed": [run], "prefect": [run | {"cpu_ms_per_task": 29.0}]}, 1000)
    cpu = [f for f in result["figures"] if f["unit"] == "ms"]
    assert [f["values"] for f in cpu] == [[6.0], [29.0]]
    assert [f["met"] for f in cpu] == [False, None]  # the goal (<= 4 ms) is the managed server's only
    assert cpu[0]["label"] == VARIANTS["managed"][0] and cpu[0]["ours"] and not cpu[1]["ours"]
    assert [f["values"] for f in result["figures"] if f["unit"] == "MB"] == [[950.0], [950.0]]


def test_process_cpu_bench_judges_each_kind_with_hooks_on_against_bypassed_from_the_same_runs() -> None:
    from bench.process_cpu import KINDS, section

    def row(hooks: str, seconds: float, workers: float, right: bool = True) -> dict:
        return {"hooks": hooks, "right": right, "seconds": seconds,
                "cpu_s": {"workers": workers, "server": 40.0, "scheduler": 17.0, "flow": 12.0}}

    rows = [row("on", 47.0, 39.0), row("bypassed", 56.0, 49.0), row("on", 50.0, 41.0), row("bypassed", 54.0, 47.0),
            row("on", 1.0, 1.0, right=False)]  # a run whose result was wrong counts for nothing
    figures = {(f["group"].split(": ", 1)[1], f["label"]): f for f in section(rows, 3000)["figures"]}
    assert len(figures) == 2 * (1 + len(KINDS))
    workers = figures[("CPU of the workers", "hpc-garage (worker hooks on)")]
    assert workers["values"] == [39.0, 41.0] and workers["median"] == 40.0 and workers["met"] is True
    assert workers["ratios"] == {"Prefect's own path (bypassed)": 40.0 / 48.0}
    server = figures[("CPU of the server", "hpc-garage (worker hooks on)")]
    assert server["met"] is False  # the same: not less


def test_a_failed_benchmark_says_why_where_the_caller_sees_it(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str],
                                                               tmp_path: Path) -> None:
    """A CI run keeps no benchmark log: its traceback's last lines come out on stderr with the failure."""
    import bench.__main__ as bench_main

    monkeypatch.setattr(bench_main, "_module", lambda name: "no_such_benchmark")
    assert bench_main.main(["--quick", "--only", "cli", "--out", str(tmp_path)]) == 1
    said = capsys.readouterr().err
    assert any(line.startswith("bench: cli| ") and "No module named bench.no_such_benchmark" in line
               for line in said.splitlines()), said
    assert "bench: failed: cli" in said
