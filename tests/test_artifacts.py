"""What a run leaves on its trials in Prefect (cluster/artifacts.py): GPU figures and what the trials reported
as table artifacts on their task runs and flow runs; nothing asked where there is nothing to attach, and an API
that is down or hangs costs at most the budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.test_progress import PY, SWEEP, clean_env, hpcg


# ------------------------------------------------------------------ GPU figures on Prefect's task runs


def gpu_report(n: int, *, figures: bool = True, gpus: bool = True) -> dict[str, Any]:
    """A report (cluster/report.build's shape) of n Prefect trials, keyed as prefect/fast.py keys them."""
    import uuid

    gpu = {"gpu_util_mean": 50.0, "gpu_util_peak": 90.0, "gpu_memory_peak": 2.0**30} if figures else {}
    return {"trials": [{"key": f"experiment-{uuid.uuid4().hex}", "worker": "w0", "gpus": ["1"] if gpus else [],
                        "start": 1.0, "duration_s": 2.0, "failed": False, **gpu} for _ in range(n)]}


class CountingApi:
    """A local HTTP endpoint standing in for an API in the ways a real one cannot be made to behave on cue:
    it counts calls, answers `/task_runs/filter` with the ids asked for, and never answers `/artifacts/`
    (a hung server)."""

    def __init__(self) -> None:
        import http.server
        import threading

        calls = self.calls = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                calls.append(self.path)
                if self.path.endswith("/task_runs/filter"):
                    runs = [{"id": i, "flow_run_id": "5" * 32} for i in body["task_runs"]["id"]["any_"]]
                    answer = json.dumps(runs).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(answer)))
                    self.end_headers()
                    self.wfile.write(answer)
                else:
                    time.sleep(30)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()  # shutdown(): 0.05 s
        self.api = {"PREFECT_API_URL": f"http://127.0.0.1:{self.server.server_port}/api"}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_cpu_only_trials_or_unread_gpus_attach_nothing_and_ask_nothing() -> None:
    from hpc_garage.cluster.artifacts import attach_gpu_figures

    api = CountingApi()
    try:
        assert attach_gpu_figures(gpu_report(2000, figures=False, gpus=False), api.api) is None  # a CPU sweep
        assert attach_gpu_figures(gpu_report(50, figures=False), api.api) is None  # GPU workers, no NVML/amdsmi
        assert attach_gpu_figures({"trials": [{"key": "plain-dask-key", "worker": "w0", "gpus": ["0"],
                                               "duration_s": 1.0, "gpu_util_mean": 1.0}]}, api.api) is None
        assert attach_gpu_figures(gpu_report(3), {}) is None  # no Prefect API
        assert api.calls == []
    finally:
        api.close()


def test_an_api_that_is_down_or_hangs_costs_at_most_the_cap() -> None:
    import socket

    from hpc_garage.cluster.artifacts import ATTACH_CALL_SECONDS, ATTACH_SECONDS, attach_gpu_figures

    silent = socket.socket()  # accepts connections (the kernel's backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))  # bound, not listening: connection refused
    hung = CountingApi()
    silent_url, refused_url = (f"http://127.0.0.1:{s.getsockname()[1]}/api" for s in (silent, refused))
    cases = ((silent_url, ATTACH_SECONDS, ATTACH_CALL_SECONDS, "did not answer"),  # most: what it may cost
             (refused_url, ATTACH_SECONDS, 0.5, "did not answer"),  # (one call's timeout; the budget)
             (hung.api["PREFECT_API_URL"], 2.0, 2.0, "0 Prefect task runs"))

    def timed(url: str, budget: float) -> tuple[str | None, float]:
        started = time.monotonic()
        line = attach_gpu_figures(gpu_report(40), {"PREFECT_API_URL": url}, budget=budget)
        return line, time.monotonic() - started

    try:
        with ThreadPoolExecutor(len(cases)) as pool:  # the three waits at once: each is timed on its own
            answers = list(pool.map(lambda case: timed(case[0], case[1]), cases))
        for (url, _, most, expected), (line, took) in zip(cases, answers):
            assert took < most + 0.5, (url, took)
            assert line is not None and expected in line, line
        assert "40 not attached within 2 s" in line, line
        assert hung.calls.count("/api/task_runs/filter") == 1 and "/api/artifacts/" in hung.calls
    finally:
        silent.close()
        refused.close()
        hung.close()


@pytest.mark.slow
@pytest.mark.slurm
def test_gpu_figures_reach_each_trials_prefect_task_run(tmp_path: Path) -> None:
    """A real sweep on the local SLURM's fake GPUs, whose workers read their GPUs through a test reader
    (tests/data/fake_gpu_reader.py, preloaded in every worker: this machine has no GPU for NVML): every trial
    gets exactly one artifact on its task run and flow run, with its worker, its GPU and the figures that
    reader gave that GPU, read back from Prefect's API; the job log says how many."""
    import uuid

    sys.path.insert(0, str(Path(__file__).resolve().parent / "data"))
    try:
        from fake_gpu_reader import figures
    finally:
        sys.path.pop(0)
    from hpc_garage.cluster.artifacts import ARTIFACT_KEY
    from hpc_garage.prefect_api import PrefectApi
    from hpc_garage.prefect.server import ensure_api

    tests = Path(__file__).resolve().parent  # the job imports the reader from tests/data, and this checkout
    env = clean_env() | {"HPC_GARAGE_WORKER_PRELOAD": "distributed,hpc_garage.prefect.worker,fake_gpu_reader",
                         "PYTHONPATH": os.pathsep.join(filter(None, [str(tests / "data"), str(tests.parent),
                                                                     os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([PY, "-m", "hpc_garage", "submit", "--site", "lab-gpu", "--gpus-per-node", "2", "--wait",
                           str(SWEEP), "--gpu", "yes", "--seeds", "2", "--duration", "1", "--out",
                           str(tmp_path / "r.json")], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    job = done.stdout.split()[2]
    status = json.loads(hpcg(["status", job, "--json"], tmp_path).stdout)
    api = status["run"]["progress"]["prefect"]["api"]
    server = ensure_api(env=env)  # the managed server the job used (this user's): its URL and auth string
    assert server["PREFECT_API_URL"] == api, (server["PREFECT_API_URL"], api)
    report = json.loads(hpcg(["report", job, "--json"], tmp_path).stdout)
    trials = report["trials"]
    assert len(trials) == 5 and all("gpu_util_mean" in t for t in trials), trials  # 4 experiments + aggregate
    client = PrefectApi.from_env(server, timeout=10)
    assert client is not None
    artifacts = client.post("/artifacts/filter", {"artifacts": {"key": {"any_": [ARTIFACT_KEY]}, "task_run_id": {
        "any_": [str(uuid.UUID(hex=t["key"][-32:])) for t in trials]}}})
    assert len(artifacts) == len(trials), artifacts
    # the flow run the task runner noted at its first submission: progress names it from then on (it used to
    # learn it only from a finished trial's task run, which a short sweep could end before)
    flow_runs = {run["id"] for run in status["run"]["progress"]["prefect"]["flow_runs"]}
    assert len(flow_runs) == 1, status["run"]["progress"]["prefect"]
    for trial in trials:
        mine = [a for a in artifacts if a["task_run_id"] == str(uuid.UUID(hex=trial["key"][-32:]))]
        assert len(mine) == 1, (trial["key"], artifacts)
        assert mine[0]["type"] == "table" and mine[0]["flow_run_id"] in flow_runs, mine[0]
        [row] = json.loads(mine[0]["data"])
        [gpu] = trial["gpus"]
        util, memory = figures(gpu)  # what the reader gave this trial's GPU
        assert row == {"worker": trial["worker"], "gpus": gpu, "duration_s": trial["duration_s"],
                       "gpu_util_mean": util, "gpu_util_peak": util, "gpu_memory_peak": memory}, (row, trial)
    log = Path(status["log"]).read_text()
    line = f"hpc-garage: report: GPU figures attached to 5 Prefect task runs as artifacts (key {ARTIFACT_KEY})"
    assert f"{line}\n" in log, log


# ------------------------------------------------------------------ what the trials reported (trial.report)


def metrics_report(runs: list[str], states: list[str]) -> dict[str, Any]:
    """A report (cluster/report.build's shape) of Prefect trials that reported, with its "metrics" as
    cluster/trial_metrics.section makes it from a trials.json."""
    from hpc_garage.cluster.report import by_task_run
    from hpc_garage.cluster.trial_metrics import section

    trials = {f"key-{i}": {"task": "train", "run": run, "reports": 12, "last_step": 11, "last": {"loss": 0.3 + i},
                           "best": {"loss": 0.29 + i, "acc": 0.9}, "state": state, "started": 0.0, "ended": 1.0}
              for i, (run, state) in enumerate(zip(runs, states))}
    summary = {"metric": "loss", "mode": "min", "pruner": "MedianPruner", "trials": trials, "reporting": len(runs),
               "pruned": states.count("pruned"), "best": {"trial": "key-0", "value": 0.29, "step": 11}}
    report = {"trials": [{"key": f"train-{run}", "worker": "w0", "gpus": ["0"], "start": 0.0,
                          "duration_s": 10.0 if state == "done" else 4.0, "failed": False}
                         for run, state in zip(runs, states)]}
    report["metrics"] = section(summary, by_task_run(report))
    return report


def test_trial_metrics_ask_nothing_without_an_api_or_a_reporting_trial() -> None:
    import uuid

    from hpc_garage.cluster.artifacts import attach_trial_metrics

    api = CountingApi()
    try:
        assert attach_trial_metrics({"trials": []}, api.api) is None  # no trial reported
        assert attach_trial_metrics(metrics_report([uuid.uuid4().hex], ["done"]), {}) is None  # no Prefect API
        plain = metrics_report([uuid.uuid4().hex], ["done"])
        plain["metrics"]["trials"][0]["run"] = "not-a-task-run"  # a plain Dask task's report
        assert attach_trial_metrics(plain, api.api) is None
        assert api.calls == []
        started = time.monotonic()
        line = attach_trial_metrics(metrics_report([uuid.uuid4().hex for _ in range(8)], ["done"] * 8), api.api,
                                    budget=1.5)  # it never answers /artifacts/: the budget caps it
        assert time.monotonic() - started < 2.0 and line is not None and "9 artifacts not attached within 1.5 s" in line
    finally:
        api.close()


@pytest.mark.slow
def test_trial_metrics_reach_each_trials_task_run_and_the_sweeps_its_flow_run() -> None:
    """Against a real Prefect server (the managed one, started if none runs): three task runs of one flow run
    that reported get one table each (last and best of each metric, state, steps), the flow run one with the
    sweep's counts, best trial and the GPU-seconds saved; read back from the API."""
    import uuid

    from hpc_garage.cluster.artifacts import SWEEP_METRICS_KEY, TRIAL_METRICS_KEY, attach_trial_metrics
    from hpc_garage.prefect.server import ensure_api
    from hpc_garage.prefect_api import PrefectApi

    env = ensure_api(env=clean_env())
    client = PrefectApi.from_env(env, timeout=10)
    assert client is not None
    flow = client.post("/flows/", {"name": f"hpc-garage-test-metrics-{uuid.uuid4().hex[:8]}"})
    flow_run = client.post("/flow_runs/", {"flow_id": flow["id"], "name": "metrics"})
    runs = [client.post("/task_runs/", {"flow_run_id": flow_run["id"], "task_key": "train", "dynamic_key": str(i),
                                        "name": f"train-{i}"})["id"] for i in range(3)]
    report = metrics_report([uuid.UUID(run).hex for run in runs], ["done", "done", "pruned"])
    line = attach_trial_metrics(report, env)
    assert line == (f"trial metrics attached to 3 Prefect task runs as artifacts (key {TRIAL_METRICS_KEY}), the "
                    f"sweep's to their flow run (key {SWEEP_METRICS_KEY})"), line
    found = client.post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run["id"]]},
                                                            "key": {"any_": [TRIAL_METRICS_KEY, SWEEP_METRICS_KEY]}}})
    mine = {a["task_run_id"]: a for a in found if a["key"] == TRIAL_METRICS_KEY}
    assert set(mine) == set(runs), found
    rows = json.loads(mine[runs[2]]["data"])
    assert rows == [{"metric": "loss", "last": 2.3, "best": 2.29, "state": "pruned", "reports": 12, "last_step": 11},
                    {"metric": "acc", "last": None, "best": 0.9, "state": "pruned", "reports": 12, "last_step": 11}]
    assert mine[runs[2]]["type"] == "table" and "stopped early by the pruner" in mine[runs[2]]["description"]
    [sweep] = [a for a in found if a["key"] == SWEEP_METRICS_KEY]
    assert sweep["task_run_id"] is None and sweep["flow_run_id"] == flow_run["id"]
    assert json.loads(sweep["data"]) == [{"reporting": 3, "done": 2, "pruned": 1, "did_not_end": 0,
                                          "pruner": "MedianPruner", "metric": "loss", "best_trial": "key-0",
                                          "best_task": "train", "best_value": 0.29, "best_step": 11,
                                          "GPU-s saved (estimate)": 6.0}]
    assert "pruning saved about 6.0 GPU-s" in sweep["description"]
