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
from hpc_garage.core.progress_text import progress_text
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

    from hpc_garage.cluster.handoff import announce_trials
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
                # a finished trial leaves its record only (a 300,000-trial sweep's scheduler holds 300,000)
                assert not progress.pending and not progress.sampled, (progress.pending, progress.sampled)
                # a flow's runner says how many trials its map holds back (status's total, waiting and ETA)
                def announce() -> None:  # as the flow's runner does: its own, synchronous client
                    with Client(s.address) as flow_client:
                        announce_trials(flow_client, "runner-a", 12)
                        announce_trials(flow_client, "runner-b", 1)

                await asyncio.to_thread(announce)
                await until(lambda: progress.figures()["total"] == 13)
                told = progress.figures()
                assert (told["done"], told["failed"], told["waiting"]) == (3, 2, 8) and told["eta"] > 0, told

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


# ------------------------------------------------------------------ what the trials reported (trial.report)


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
