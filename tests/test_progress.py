"""A run's progress (cluster/progress.py) as the scheduler counts it, and as `status` and `submit --wait`
show it (schedulers/submission/, cli/status_text.py): a real Dask scheduler and worker in this process, and a real SLURM sweep
read mid-way."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hpc_garage.cluster.progress import prefect_ui_url
from hpc_garage.cli.status_text import progress_links
from hpc_garage.schedulers.submission import progress_text
from tests.conftest import outside_job_env

PY = sys.executable
SWEEP = Path(__file__).resolve().parent.parent / "examples" / "sweep.py"


def hold(seconds: float) -> str:
    time.sleep(seconds)
    return "ok"


def fail() -> None:
    raise ValueError("trial failed")


def prefect_failed() -> Any:
    from prefect.states import Failed

    return Failed(message="a Prefect trial that failed")  # a Dask success, a failed trial


async def until(check: Any, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not reached in time"
        await asyncio.sleep(0.05)


@pytest.mark.slow
def test_scheduler_counts_done_running_failed_waiting_and_busy_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    from distributed import Client, Scheduler, Worker

    from hpc_garage.cluster.progress import install

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")  # the in-process worker's GPU id (no GPU: no NVML figures)
    writes: list[dict[str, Any]] = []

    async def main() -> None:
        async with Scheduler(port=0, dashboard_address=":0") as s:
            progress = await install(s, writes.append)
            async with Worker(s.address, name="w0", resources={"GPU": 1}, nthreads=1), \
                    Client(s.address, asynchronous=True) as c:
                bad = [c.submit(fail, key="bad"), c.submit(prefect_failed, key="prefect-failed")]
                await c.gather(bad, errors="skip")
                held = [c.submit(hold, 1.0, key=f"t-{i}", resources={"GPU": 1}) for i in range(3)]
                await until(lambda: progress.figures()["running"] == 1)
                mid = progress.figures()
                # `running` comes from the worker's heartbeats, which may lag the first trial's end by a beat
                assert mid["failed"] == 2 and mid["done"] + mid["running"] + mid["waiting"] == 3, mid
                assert mid["done"] <= 1 and mid["waiting"] >= 1, mid
                assert (mid["gpus_busy"], mid["gpus"]) == (1, 1) and mid["eta"] > 0 and mid["elapsed"] > 0
                await c.gather(held)
                await until(lambda: progress.figures()["done"] == 3 and not progress.figures()["running"])
                end = progress.figures()
                assert (end["failed"], end["waiting"], end["eta"]) == (2, 0, None)
                assert end["dashboard"]["port"] == s.services["dashboard"].port
                await until(lambda: len(writes) >= 1, 5)  # every 2 s, without being asked
                record = progress.record()
                assert record["workers"][0]["gpu_ids"] == ["2"]
                trials = {t["key"]: t for t in record["trials"]}
                assert trials["bad"]["failed"] and trials["prefect-failed"]["failed"] and not trials["t-0"]["failed"]
                assert all(0.95 < trials[f"t-{i}"]["stop"] - trials[f"t-{i}"]["start"] < 1.5 for i in range(3))

    asyncio.run(main())


def test_prefect_ui_url_of_a_server_and_of_prefect_cloud() -> None:
    assert prefect_ui_url("http://10.0.0.5:4200/api", "abc") == "http://10.0.0.5:4200/runs/flow-run/abc"
    assert prefect_ui_url("https://api.prefect.cloud/api/accounts/A/workspaces/W", "abc") == \
        "https://app.prefect.cloud/account/A/workspace/W/runs/flow-run/abc"


def test_progress_text_and_links() -> None:
    progress = {"done": 12, "running": 4, "failed": 1, "waiting": 20, "gpus_busy": 4, "gpus": 4, "elapsed": 65.2,
                "eta": 130, "dashboard": {"host": "10.1.2.3", "port": 8790, "bokeh": True},
                "prefect": {"api": "http://10.1.2.3:4200/api", "ui": False,
                            "flow_runs": [{"id": "f1", "url": "http://10.1.2.3:4200/runs/flow-run/f1"}]}}
    assert progress_text(progress) == "12 done, 4 running, 1 failed, 20 waiting; GPUs 4/4 busy; 1m05s, ETA 2m10s"
    links = progress_links(progress, login="me@login1")
    assert links[0].startswith("Prefect flow run f1 (the Prefect server at http://10.1.2.3:4200/api runs without its UI")
    assert links[1:] == ["Dask dashboard: http://10.1.2.3:8790/status",
                         "  from a laptop: ssh -N -L 8787:10.1.2.3:8790 me@login1  then open http://localhost:8787/status"]
    progress["prefect"]["ui"] = True
    assert progress_links(progress, login="me@login1")[0] == "Prefect UI: http://10.1.2.3:4200/runs/flow-run/f1"


def hpcg(args: list[str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "hpc_garage", *args], capture_output=True, text=True, cwd=cwd,
                          env=clean_env(), timeout=timeout)


def clean_env() -> dict[str, str]:
    return outside_job_env()


@pytest.mark.slow
@pytest.mark.slurm
def test_status_mid_sweep_shows_progress_that_moves(tmp_path: Path) -> None:
    """`submit --wait` (piped: one line per change) of a 12-trial sweep on 2 GPUs, while `status JOB --json`,
    `status JOB` and `status` are read mid-sweep: done and running counts above zero that change, the Prefect
    flow run, the dashboard's ssh line."""
    waiter = subprocess.Popen([PY, "-m", "hpc_garage", "submit", "--site", "lab-gpu", "--gpus-per-node", "2", "--wait",
                               str(SWEEP), "--gpu", "yes", "--seeds", "6", "--duration", "3", "--out",
                               str(tmp_path / "r.json")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=tmp_path, env=clean_env())
    try:
        job = waiter.stdout.readline().split()[2]  # "submitted job N (site lab-gpu)"
        seen: list[tuple[int, int]] = []
        text = table = ""
        serves_ui = False
        deadline = time.monotonic() + 300
        while waiter.poll() is None and time.monotonic() < deadline:
            run = json.loads(hpcg(["status", job, "--json"], tmp_path).stdout)["run"] or {}
            progress = run.get("progress") or {}
            if run.get("phase") == "running" and progress.get("done") and progress.get("running"):
                seen.append((progress["done"], progress["running"]))
                if len(set(seen)) == 2 and not text:  # it moved; now the other two views, still mid-sweep
                    text = hpcg(["status", job], tmp_path).stdout
                    serves_ui = (progress.get("prefect") or {}).get("ui") is not False
                    table = hpcg(["status"], tmp_path).stdout
            time.sleep(0.2)
        out, err = waiter.communicate(timeout=300)
    finally:
        if waiter.poll() is None:
            waiter.kill()
            subprocess.run(["scancel", job])
    assert waiter.returncode == 0, out + err
    assert len(set(seen)) >= 2, seen  # moved while we watched
    assert f"job {job} running: " in text and "done, " in text and "GPUs " in text, text
    # the flow run: a UI link where the server serves its UI (Prefect's wheel carries it built), else its id
    flow_run = "Prefect UI: " if serves_ui else "Prefect flow run "
    assert flow_run in text and "ssh -N -L 8787:" in text, text
    assert any(line.startswith(job) and "running: " in line for line in table.splitlines()), table
    lines = out.splitlines()
    assert sum(1 for line in lines if line.startswith(f"job {job} running: ")) >= 2, out  # appended, not rewritten
    assert any(line.startswith(flow_run) for line in lines) and "\r" not in out, out
    final = json.loads(hpcg(["status", job, "--json"], tmp_path).stdout)["run"]["progress"]
    assert (final["done"], final["failed"], final["running"], final["waiting"]) == (13, 0, 0, 0)  # 12 + aggregate


def test_wait_line_is_rewritten_on_a_terminal_and_appended_when_piped() -> None:
    import io

    from hpc_garage.cli.status_text import progress_line

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for stream, expected in ((Terminal(), "\r\x1b[Kjob 1 running: a\r\x1b[Knote\n\r\x1b[Kjob 1 running: b"),
                             (io.StringIO(), "job 1 running: a\nnote\njob 1 running: b\n")):
        line = progress_line(stream)
        line("job 1 running: a")
        line.note("note")
        line("job 1 running: b")
        assert stream.getvalue() == expected


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
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.api = {"PREFECT_API_URL": f"http://127.0.0.1:{self.server.server_port}/api"}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_cpu_only_trials_or_unread_gpus_attach_nothing_and_ask_nothing() -> None:
    from hpc_garage.cluster.progress import attach_gpu_figures

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

    from hpc_garage.cluster.progress import ATTACH_CALL_SECONDS, ATTACH_SECONDS, attach_gpu_figures

    silent = socket.socket()  # accepts connections (the kernel's backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))  # bound, not listening: connection refused
    hung = CountingApi()
    silent_url, refused_url = (f"http://127.0.0.1:{s.getsockname()[1]}/api" for s in (silent, refused))
    try:
        for url, budget, most, expected in (  # most: what it may cost (one call's timeout; the budget)
                (silent_url, ATTACH_SECONDS, ATTACH_CALL_SECONDS, "did not answer"),
                (refused_url, ATTACH_SECONDS, 0.5, "did not answer"),
                (hung.api["PREFECT_API_URL"], 2.0, 2.0, "0 Prefect task runs")):
            started = time.monotonic()
            line = attach_gpu_figures(gpu_report(40), {"PREFECT_API_URL": url}, budget=budget)
            took = time.monotonic() - started
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
    from hpc_garage.cluster.progress import ARTIFACT_KEY
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


def test_progress_shows_what_the_trials_reported_and_never_fails_for_it(tmp_path: Path) -> None:
    """state.json's progress carries trials.json's counts and best trial once a trial reported; a missing,
    half-written or foreign file leaves it out, and the figures still come."""
    from types import SimpleNamespace

    from hpc_garage.cluster.progress import RunProgress

    path = tmp_path / "metrics" / "trials.json"
    progress = RunProgress(lambda figures: None, metrics=path)
    progress.scheduler = SimpleNamespace(workers={}, services={}, address="tcp://127.0.0.1:1")
    assert "metrics" not in progress.figures() and progress.figures()["done"] == 0
    path.parent.mkdir()
    summary = {"metric": "loss", "trials": {"t1": {"task": "train", "state": "pruned", "best": {"loss": 0.5}},
                                            "t2": {"task": "train", "state": "running", "best": {"loss": 0.29}}},
               "reporting": 2, "pruned": 1, "best": {"trial": "t2", "value": 0.29, "step": 11}}
    for broken in (json.dumps(summary)[:40], "[]", json.dumps({"trials": "no"})):
        path.write_text(broken)
        assert "metrics" not in progress.figures(), broken
    path.write_text(json.dumps(summary))
    assert progress.figures()["metrics"] == {"reporting": 2, "pruned": 1, "best": {
        "trial": "t2", "task": "train", "metric": "loss", "value": 0.29, "step": 11}}


def test_trial_metrics_ask_nothing_without_an_api_or_a_reporting_trial() -> None:
    import uuid

    from hpc_garage.cluster.progress import attach_trial_metrics

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

    from hpc_garage.cluster.progress import SWEEP_METRICS_KEY, TRIAL_METRICS_KEY, attach_trial_metrics
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
