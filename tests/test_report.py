"""The efficiency report (cluster/report.py) and the worker's GPU sampler (launchers/gpu_sampler.py): the
interval arithmetic, the summary and the plot on a built report, the CLI, NVML where a GPU is, and a real
SLURM run whose report agrees with the trials' own timings."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from hpc_garage.cluster.report import build, busy_and_gaps, summary
from hpc_garage.cluster.report_plot import plot
from hpc_garage.launchers.gpu_sampler import TrialFigures, open_reader
from tests.conftest import outside_job_env

PY = sys.executable
TRIALS = Path(__file__).resolve().parent / "data" / "timed_trials.py"

spans = st.lists(st.tuples(st.floats(0, 100), st.floats(0, 20)).map(lambda p: (p[0], p[0] + p[1])), max_size=30)


@given(spans, st.floats(0, 50), st.floats(0, 120))
def test_busy_and_idle_gaps_add_up_to_the_window(trials: list[tuple[float, float]], start: float, length: float) -> None:
    window = (start, start + length)
    busy, gaps = busy_and_gaps(trials, window)
    assert busy + sum(b - a for a, b in gaps) == pytest.approx(length, abs=1e-6)
    assert all(window[0] <= a < b <= window[1] for a, b in gaps)
    for a, b in gaps:  # a gap overlaps no trial
        assert all(min(b, t1) - max(a, t0) <= 1e-9 for t0, t1 in trials)


def test_overlapping_trials_count_once_and_gaps_are_listed() -> None:
    busy, gaps = busy_and_gaps([(1, 3), (2, 4), (6, 7), (9, 12)], (0, 10))
    assert busy == 5 and gaps == [(0, 1), (4, 6), (7, 9)]


def record(gpu_figures: bool = True) -> dict:
    t0 = 1000.0
    trial = {"asked_gpu": True, "failed": False}
    figures = {"gpu_util_mean": 50.0, "gpu_util_peak": 90.0, "gpu_memory_peak": 2.0 * 2**30} if gpu_figures else {}
    return {"started": t0, "ended": t0 + 10, "flow_runs": [],
            "workers": [{"name": "w0", "gpus": 1.0, "gpu_ids": ["3"], "nthreads": 1, "memory_limit": 2**32,
                         "memory_peak": 2**30, "joined": t0 + 1, "left": t0 + 10},
                        {"name": "w1", "gpus": 1.0, "gpu_ids": [], "nthreads": 1, "memory_limit": 2**32,
                         "memory_peak": 2**29, "joined": t0 + 1, "left": t0 + 10}],
            "trials": [{"key": "a", "worker": "w0", "start": t0 + 2, "stop": t0 + 5, **trial, **figures},
                       {"key": "b", "worker": "w0", "start": t0 + 6, "stop": t0 + 8, **trial, "failed": True},
                       {"key": "c", "worker": "w1", "start": t0 + 2, "stop": t0 + 9, **trial}]}


def test_report_per_gpu_worker_and_trial_and_five_summary_lines(tmp_path: Path) -> None:
    report = build(record())
    gpu = {g["gpu"]: g for g in report["gpus"]}
    assert set(gpu) == {"3", "#0"}  # w1 never said its GPU's id
    assert gpu["3"] | {"gaps": None} == {"gpu": "3", "worker": "w0", "allocated_s": 9.0, "busy_s": 5.0, "idle_s": 4.0,
                                         "gaps": None, "gap_count": 3, "trials": 2}
    assert gpu["3"]["gaps"] == [[1.0, 2.0], [5.0, 6.0], [8.0, 10.0]]
    w0 = report["workers"][0]
    assert (w0["memory_peak"], w0["memory_limit"], w0["gpus"]) == (2**30, 2**32, ["3"])
    a = report["trials"][0]
    assert (a["worker"], a["gpus"], a["duration_s"], a["gpu_util_peak"]) == ("w0", ["3"], 3.0, 90.0)
    assert "gpu_util_mean" not in report["trials"][1]
    lines = summary(report)
    assert len(lines) == 5
    assert lines[0] == "3 trials (2 done, 1 failed) on 2 workers with 2 GPUs in 10.0 s"
    assert lines[1] == "GPU-seconds: 18.0 allocated, 12.0 busy (67 %), 6.0 idle in 5 gaps (longest 2.0 s); least busy GPU 3 of w0 56 %"
    assert "GPU utilisation mean 50 %, peak 90 %, memory peak 2.0 GiB" in lines[4]
    assert "GPU utilisation not read" in summary(build(record(gpu_figures=False)))[4]
    out = tmp_path / "t.png"
    plot(report, out)
    assert out.read_bytes().startswith(b"\x89PNG")


def test_gpu_figures_mean_and_peaks_over_samples() -> None:
    figures = TrialFigures()
    for sample in ([(10.0, 1e9), (30.0, 2e9)], [(50.0, 3e9), (None, None)]):
        figures.add(sample)
    assert figures.to_dict() == {"gpu_util_mean": 22.5, "gpu_util_peak": 50.0, "gpu_memory_peak": 3e9, "gpu_samples": 2}


def test_no_gpu_library_or_gpu_means_no_reader() -> None:
    assert open_reader("nvidia", []) is None
    assert open_reader("intel", ["0"]) is None
    if not shutil.which("nvidia-smi"):
        assert open_reader("nvidia", ["0"]) is None  # NVML absent or no driver: no GPU columns, no error


def hpcg(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = outside_job_env()
    return subprocess.run([PY, "-m", "hpc_garage", *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=timeout)


def test_report_of_an_unknown_or_unfinished_job_is_one_line(tmp_path: Path) -> None:
    done = hpcg(["report", "999999"], tmp_path)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "999999" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
@pytest.mark.slurm
def test_slurm_run_report_matches_the_trials_own_timings(tmp_path: Path) -> None:
    """8 one-GPU trials of 1.5 s on 2 GPUs: per GPU, busy seconds within 5 % of what the trials timed
    themselves, and idle gaps adding up to allocated minus busy; `report JOB` prints it again, with a plot."""
    out = tmp_path / "trials.json"
    done = hpcg(["submit", "--site", "lab-gpu", "--gpus-per-node", "2", "--wait", str(TRIALS), str(out), "8", "1.5"],
                tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    job = done.stdout.split()[2]
    own: dict[str, float] = defaultdict(float)
    for trial in json.loads(out.read_text()):
        own[trial["worker"]] += trial["end"] - trial["start"]
    shown = hpcg(["report", job, "--json"], tmp_path)
    assert shown.returncode == 0, shown.stderr
    report = json.loads(shown.stdout)
    assert len(report["gpus"]) == 2 and len(report["trials"]) == 8
    for gpu in report["gpus"]:
        assert gpu["busy_s"] == pytest.approx(own[gpu["worker"]], rel=0.05), (gpu, dict(own))
        idle = sum(b - a for a, b in gpu["gaps"])
        assert idle == pytest.approx(gpu["allocated_s"] - gpu["busy_s"], abs=0.01)
        assert gpu["gpu"] in ("0", "1", "2", "3")  # the id its worker is pinned to
    assert {t["worker"] for t in report["trials"]} == set(own)
    log = Path(json.loads(hpcg(["status", job, "--json"], tmp_path).stdout)["log"]).read_text()
    summary_lines = [line for line in log.splitlines() if line.startswith("hpc-garage: report: ")]
    assert len(summary_lines) == 6 and "8 trials (8 done, 0 failed) on 2 workers with 2 GPUs" in summary_lines[0]
    png = tmp_path / "timeline.png"
    again = hpcg(["report", job, "--plot", str(png)], tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[:5] == [line.removeprefix("hpc-garage: report: ") for line in summary_lines[:5]]
    assert png.read_bytes().startswith(b"\x89PNG")


needs_nvidia = pytest.mark.skipif(not shutil.which("nvidia-smi"), reason="no nvidia-smi here (no NVIDIA GPU)")


@needs_nvidia
def test_nvml_reads_a_gpu_busy_with_a_real_kernel() -> None:
    """Where a GPU exists: the worker's reader sees utilisation rise while a kernel runs on GPU 0."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    reader = open_reader("nvidia", ["0"])
    assert reader is not None, "nvidia-smi works but NVML did not open: pip install 'hpc-garage[gpu]'"
    figures = TrialFigures()
    a = torch.randn(8192, 8192, device="cuda:0")
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        for _ in range(20):
            a = a @ a
            a = a / a.norm()
        figures.add(reader.sample())
    torch.cuda.synchronize()
    reader.close()
    got = figures.to_dict()
    assert got["gpu_util_peak"] > 0 and got["gpu_memory_peak"] > 8192 * 8192 * 4, got


def reported_run(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """Job 4343 of a site whose runs are in tmp_path: its report.json as `run` wrote it before the trials'
    metrics were known, and what trials reported (trials.json and the curves, hand-written in the shape
    prefect/metrics.py writes): two ran to the end, two were pruned. The environment that finds the site."""
    from hpc_garage.rundir import RunDir

    sites = tmp_path / "sites"
    sites.mkdir()
    (sites / "metrics-lab.yaml").write_text(f"scheduler: slurm\nnode: {{cores: 4, memory: 8GiB}}\n"
                                            f"run_directory: {tmp_path / 'runs'}\n")
    rundir = RunDir(tmp_path / "runs" / "4343")
    rundir.metrics_dir.mkdir(parents=True)
    rundir.write_submit_record({"job_id": "4343", "scheduler": "slurm", "submitted": time.time(), "site": "metrics-lab"})
    t0, runs = 1000.0, [f"{i}" * 32 for i in range(1, 5)]
    trials, states, durations = {}, ["done", "done", "pruned", "pruned"], [20.0, 20.0, 5.0, 8.0]
    for i, (run, state, seconds) in enumerate(zip(runs, states, durations)):
        steps = 20 if state == "done" else 5 + i
        losses = [1.0 + i / 4 + 2.0 / (s + 1) for s in range(steps)]
        rundir.trial_metrics(f"key-{i}").write_text("".join(
            json.dumps({"step": s, "time": t0 + s, "values": {"loss": v}}) + "\n" for s, v in enumerate(losses)))
        trials[f"key-{i}"] = {"task": "train", "run": run, "reports": steps, "last_step": steps - 1,
                              "last": {"loss": losses[-1]}, "best": {"loss": min(losses)}, "state": state}
    rundir.metrics_summary.write_text(json.dumps({
        "metric": "loss", "mode": "min", "pruner": "MedianPruner", "trials": trials, "reporting": 4, "pruned": 2,
        "best": {"trial": "key-0", "value": trials["key-0"]["best"]["loss"], "step": 19}}))
    report = build({"started": t0, "ended": t0 + 30, "flow_runs": [],
                    "workers": [{"name": f"w{g}", "gpus": 1.0, "gpu_ids": [str(g)], "nthreads": 1,
                                 "memory_limit": 2**32, "memory_peak": 2**30, "joined": t0, "left": t0 + 30}
                                for g in range(2)],
                    "trials": [{"key": f"train-{run}", "worker": f"w{i % 2}", "start": t0 + (i // 2) * 20,
                                "stop": t0 + (i // 2) * 20 + seconds, "failed": False, "asked_gpu": True}
                               for i, (run, seconds) in enumerate(zip(runs, durations))]})
    rundir.report_file.write_text(json.dumps(report))
    return {**outside_job_env(), "HPC_GARAGE_SITES_PATH": str(sites)}, rundir.path


def test_report_counts_pruned_trials_estimates_the_saving_and_plots_the_curves(tmp_path: Path) -> None:
    """`report JOB`: the five lines, then the best trial, the pruned ones, the GPU-seconds saved (an estimate,
    said so); --json has it under "metrics"; --plot adds the curves below the timeline; a trials.json gone
    bad leaves the report as it was."""
    env, run_dir = reported_run(tmp_path)

    def report(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([PY, "-m", "hpc_garage", "report", "4343", "--site", "metrics-lab", *args],
                              capture_output=True, text=True, env=env, timeout=120)

    shown = report()
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert len(lines) == 7, lines
    assert lines[0].startswith("4 trials (2 done, 0 failed, 2 pruned) on 2 workers with 2 GPUs"), lines
    assert lines[5] == ("trial metrics: 4 trials reported; best loss 1.1 (trial key-0 step 19); 2 ran to the end, "
                        "2 pruned (MedianPruner)")
    # (20 - 5) + (20 - 8), one GPU each
    assert lines[6].startswith("pruning saved about 27.0 GPU-s (an estimate: for each of the 2 pruned trials"), lines
    data = json.loads(report("--json").stdout)
    assert data["metrics"]["saved"]["seconds"] == 27.0 and data["metrics"]["pruned"] == 2
    png, plain = tmp_path / "curves.png", tmp_path / "timeline.png"
    drawn = report("--plot", str(png))
    assert drawn.returncode == 0 and drawn.stdout.splitlines()[-1] == f"timeline: {png}", drawn.stdout + drawn.stderr
    plot(data | {"metrics": None}, plain)
    assert png.read_bytes().startswith(b"\x89PNG") and _png_height(png) > _png_height(plain) + 300  # a second panel
    (run_dir / "metrics" / "trials.json").write_text('{"trials": {"key-0": ')  # mid-write, or broken
    again = report()
    assert again.returncode == 0 and again.stdout.splitlines()[1:] == lines[1:5], again.stdout + again.stderr
    assert again.stdout.startswith("4 trials (4 done, 0 failed) on")  # which ended early is no longer known


def test_the_report_of_a_recycled_job_id_is_not_the_earlier_jobs(tmp_path: Path) -> None:
    """A job submitted after report.json was written (its id recycled, not yet started): `report JOB` says it
    has no report yet, not the earlier job's."""
    from hpc_garage.rundir import RunDir

    env, run_dir = reported_run(tmp_path)
    rundir = RunDir(run_dir)
    rundir.write_submit_record({**rundir.submit_record(), "submitted": time.time() + 60})
    shown = subprocess.run([PY, "-m", "hpc_garage", "report", "4343", "--site", "metrics-lab"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert shown.returncode == 2 and shown.stdout == "", shown.stdout + shown.stderr
    assert shown.stderr.startswith("hpc-garage: error: job 4343 has no report yet") and len(shown.stderr.splitlines()) == 1


def _png_height(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[20:24], "big")  # the IHDR chunk: width, then height


def test_a_search_in_the_run_directory_adds_its_line_to_the_report(tmp_path: Path) -> None:
    from hpc_garage.cluster.report import with_metrics
    from hpc_garage.rundir import RunDir

    rundir = RunDir(tmp_path / "42")
    rundir.path.mkdir()
    search = {"study": "search", "metric": "loss", "stopped": "trials: all 8 trials asked", "told": 8, "complete": 3,
              "pruned": 5, "failed": 0, "running": 0, "gpu_hours": 0.01, "budget_gpu_hours": None,
              "best": {"number": 2, "params": {"lr": 0.1}, "value": 0.5}}
    (rundir.search_summary).write_text(json.dumps(search))
    report = with_metrics(build(record()), rundir)
    assert report["search"] == search
    assert summary(report)[-1] == ("search search: 8 trials told (3 complete, 5 pruned, 0 failed), 0.01 GPUh; best #2 "
                                   "loss 0.5 {'lr': 0.1}; stopped: trials: all 8 trials asked")
    assert "search" not in with_metrics(build(record()), RunDir(tmp_path / "43"))


def test_a_report_walked_from_its_record_is_the_one_built_from_a_list(tmp_path: Path) -> None:
    from hpc_garage.cluster.report import Trials, write

    listed = record()
    walked = dict(listed, trials=Trials(lambda: iter(listed["trials"]), len(listed["trials"])))
    expected, found = build(listed), build(walked)
    write(tmp_path / "report.json", found)  # its trials written one at a time
    assert json.loads((tmp_path / "report.json").read_text()) == json.loads(json.dumps(expected))
    assert summary(found) == summary(expected) and len(found["trials"]) == 3
    assert oct((tmp_path / "report.json").stat().st_mode & 0o777) == "0o600"


def test_a_worker_with_many_gaps_keeps_the_longest_and_counts_them_all() -> None:
    from hpc_garage.cluster.report import GAPS_KEPT

    t0, n = 1000.0, 3 * GAPS_KEPT
    trials = [{"key": f"t{i}", "worker": "w0", "start": t0 + i, "stop": t0 + i + (0.5 if i % 3 else 0.9),
               "failed": False, "asked_gpu": False} for i in range(n)]  # gaps of 0.5 s, every third 0.1 s
    report = build({"started": t0, "ended": t0 + n, "flow_runs": [], "trials": trials,
                    "workers": [{"name": "w0", "gpus": 0.0, "gpu_ids": [], "nthreads": 1, "memory_limit": 2**32,
                                 "memory_peak": 2**20, "joined": t0, "left": t0 + n}]})
    w0 = report["workers"][0]
    assert w0["gap_count"] == n and len(w0["gaps"]) == GAPS_KEPT
    assert all(b - a == pytest.approx(0.5) for a, b in w0["gaps"]) and w0["gaps"] == sorted(w0["gaps"])
    assert w0["idle_s"] == pytest.approx(n / 3 * (0.5 + 0.5 + 0.1))  # all of them, the short ones too
    assert f"idle in {n} gaps (longest 0.5 s)" in summary(report)[1]


def test_the_report_of_many_trials_is_made_in_memory_that_does_not_hold_them(tmp_path: Path) -> None:
    import tracemalloc

    from hpc_garage.cluster.report import Trials, write

    t0, n = 1000.0, 100_000

    def walk() -> object:
        return ({"key": f"trial-{i:032x}", "worker": f"w{i % 2}", "start": t0 + i / 100, "stop": t0 + i / 100 + 0.005,
                 "failed": i % 1000 == 0, "asked_gpu": False} for i in range(n))

    workers = [{"name": f"w{w}", "gpus": 0.0, "gpu_ids": [], "nthreads": 1, "memory_limit": 2**32,
                "memory_peak": 2**20, "joined": t0, "left": t0 + n / 100 + 1} for w in range(2)]
    tracemalloc.start()
    try:
        report = build({"started": t0, "ended": t0 + n / 100 + 1, "flow_runs": [], "workers": workers,
                        "trials": Trials(walk, n)})  # type: ignore[arg-type]
        write(tmp_path / "report.json", report)
        lines = summary(report)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # a list of the trials' dicts alone would take over 50 MB; spans of one worker at a time, a float or two each
    assert peak < 20 * 2**20, peak
    assert lines[0].startswith(f"{n} trials ({n - n // 1000} done, {n // 1000} failed)")
    assert len(json.loads((tmp_path / "report.json").read_text())["trials"]) == n
