"""Prefect's semantics that hpc-garage's runner must keep where plain prefect-dask keeps them (issue 12):
tasks that submit tasks, asset lineage, a failed upstream, Prefect's test harness, and prefect-dask's
`cluster_kwargs` for its default cluster. prefect-dask's own suite runs against the runner in
scripts/prefect-dask-suite; these are hpc-garage's own tests of the same behaviours."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
from distributed import Nanny, Scheduler, SpecCluster
from distributed.security import Security
from prefect import flow, task
from prefect.assets import Asset, materialize
from prefect.context import FlowRunContext
from prefect_dask.task_runners import PrefectDaskFuture

from hpc_garage.cluster.handoff import Handoff
from hpc_garage.rundir import RunDir
from hpc_garage.core.errors import UserError
from hpc_garage.prefect import recorded
from hpc_garage.prefect.task_runner import HpcTaskRunner, task_runner
from tests.conftest import task_runs

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # worker processes cannot import this file

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------------------------------- tasks


@task
def child(i: int) -> int:
    return i * 10


@task
def parent(n: int) -> tuple[list[int], bool, int]:
    """Submits `n` tasks from inside a task, as Prefect allows: they go through the runner's copy on the
    worker, to the same cluster."""
    futures = [child.submit(i) for i in range(n)]
    return [f.result() for f in futures], all(isinstance(f, PrefectDaskFuture) for f in futures), os.getpid()


@task
def trial(i: int) -> int:
    if i == 2:
        raise RuntimeError(f"trial {i} failed")
    return i


@task
def summarize(value: int) -> int:
    return value + 1


RAW, CLEAN = Asset(key="file://hpc-garage-test/raw"), Asset(key="file://hpc-garage-test/clean")


@materialize(RAW)
def extract() -> dict[str, int]:
    return {"rows": 3}


@materialize(CLEAN)
def transform(raw: dict[str, int]) -> dict[str, int]:
    return {"rows": raw["rows"] * 2}


# ------------------------------------------------------------------------------------------ helpers


def nested(runner: HpcTaskRunner) -> tuple[list[int], bool, int]:
    @flow(task_runner=runner)
    def umbrella() -> tuple[list[int], bool, int]:
        return parent.submit(3).result()

    return umbrella()


@pytest.fixture(scope="module")
def tls_handoff(api: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A TLS cluster published as `hpc-garage run` publishes it: the scheduler file and the job's credentials."""
    rundir = RunDir(tmp_path_factory.mktemp("run") / "job-12").create()
    tls = rundir.write_credentials()
    security = Security(require_encryption=True, **tls)
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": ":0",
                                                "security": security, "protocol": "tls"}}
    workers = {f"w{i}": {"cls": Nanny, "options": {"nthreads": 2, "security": security, "host": "127.0.0.1",
                                                    "protocol": "tls"}} for i in range(2)}
    with SpecCluster(workers=workers, scheduler=scheduler, security=security) as cluster:
        yield rundir.publish(Handoff(address=cluster.scheduler_address, job_id="job-12", tls=tls,
                                     workers=list(workers)))


def asset_events(flow_run_id: Any, expected: int, timeout: float = 30) -> list[dict[str, Any]]:
    """The asset events Prefect's API holds for a flow run, once `expected` of them have arrived (events
    are persisted in batches, after the flow returns)."""
    from prefect.client.orchestration import get_client

    query = {"filter": {"event": {"prefix": ["prefect.asset."]},
                        "related": {"id": [f"prefect.flow-run.{flow_run_id}"]}}}
    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            response = client.request("POST", "/events/filter", json=query)
            response.raise_for_status()
            events = response.json().get("events", [])
            if len(events) >= expected or time.monotonic() > deadline:
                return events
            time.sleep(0.5)


# --------------------------------------------------------------------------------- nested submission


def test_a_task_submits_tasks_on_the_local_tls_cluster(api: dict[str, str]) -> None:
    runner = task_runner()  # no scheduler file: the local cluster, TLS with credentials of its own
    assert runner.cluster_kwargs["security"].require_encryption
    values, wrapped, pid = nested(runner)
    assert values == [0, 10, 20] and wrapped and pid != os.getpid()


def test_a_task_submits_tasks_under_hpc_garage_run(tls_handoff: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPC_GARAGE_SCHEDULER_FILE", str(tls_handoff))
    monkeypatch.setenv("HPC_GARAGE_JOB_ID", "job-12")
    runner = task_runner()
    assert runner.address.startswith("tls://")
    values, wrapped, _ = nested(runner)
    assert values == [0, 10, 20] and wrapped


# ------------------------------------------------------------------------------------------- assets


def test_a_downstream_materialization_names_its_upstream_asset(runner: HpcTaskRunner) -> None:
    @flow(task_runner=runner)
    def pipeline() -> tuple[Any, Any]:
        raw = extract.submit()
        plain = trial.map(range(2))  # no assets: nothing kept for them (a 300,000-trial flow kept 300,000)
        clean = transform.submit(raw)
        clean.wait()
        plain.wait()
        submitter = FlowRunContext.get().task_runner._submitter  # None: not yet decided; False: prefect-dask's
        noted = dict(FlowRunContext.get().task_run_assets)
        return clean.state.type.value, submitter not in (None, False), noted, raw.task_run_id

    state = pipeline(return_state=True)
    outcome, fast, noted, raw_id = state.result()
    assert outcome == "COMPLETED" and fast  # the fast path ran it, not prefect-dask's own
    assert raw_id in noted and all(noted.values()), noted  # the upstream asset kept; no empty set kept
    events = asset_events(state.state_details.flow_run_id, expected=3)
    made = {e["resource"]["prefect.resource.id"]: e for e in events
            if e["event"] == "prefect.asset.materialization.succeeded"}
    referenced = [e["resource"]["prefect.resource.id"] for e in events if e["event"] == "prefect.asset.referenced"]
    assert set(made) == {RAW.key, CLEAN.key} and referenced == [RAW.key], events
    upstream = [r["prefect.resource.id"] for r in made[CLEAN.key]["related"]
                if r.get("prefect.resource.role") == "asset"]
    assert upstream == [RAW.key]


# ------------------------------------------------------------------------------------ failed upstream


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_flow_with_a_failed_trial_ends_soon_after_its_last_task(runner: HpcTaskRunner,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(HpcTaskRunner, "RECORD_TIMEOUT", 30.0)  # the old wait ran it out: fails in 30 s, not 120
    records = Records()
    logger = logging.getLogger("prefect.task_runner")
    logger.addHandler(records)
    ended: list[float] = []

    @flow(task_runner=runner)
    def sweep() -> list[Any]:
        trials = [trial.submit(i) for i in range(4)]
        summaries = [summarize.submit(t) for t in trials]  # the failed trial's summary ends NotReady
        for f in trials + summaries:
            f.wait()
        ended.append(time.monotonic())
        return [f.task_run_id for f in trials + summaries]

    try:
        state = sweep(return_state=True)
        returned = time.monotonic()
    finally:
        logger.removeHandler(records)
    ids = state.result()
    assert returned - ended[0] < 8, f"the flow returned {returned - ended[0]:.1f} s after its last task"
    assert not [line for line in records.lines if "had not recorded" in line], records.lines
    runs = {r.id: r for r in task_runs(state.state_details.flow_run_id)}  # read at once: the runner waited
    states = sorted((r.name.rsplit("-", 1)[0], r.state.name) for r in runs.values() if r.id in ids)
    assert states == [*[("summarize", "Completed")] * 3, ("summarize", "NotReady"),
                      *[("trial", "Completed")] * 3, ("trial", "Failed")]
    # and the count it would warn with is of the runs the API lacks, not of their batch
    assert recorded.await_recorded([*ids, uuid.uuid4()], timeout=0.5) == 1


# ----------------------------------------------------------------------------- Prefect's test harness


HARNESS_SCRIPT = """
    import json, os, sys
    from pathlib import Path
    from prefect import flow, task
    from prefect.testing.utilities import prefect_test_harness
    from prefect.settings import PREFECT_API_URL
    import hpc_garage

    @task
    def square(i):
        return i * i

    if __name__ == "__main__":
        with prefect_test_harness(server_startup_timeout=180):  # a busy machine is slow to start it
            runner = hpc_garage.task_runner()
            env_during = os.environ.get("PREFECT_API_URL")

            @flow(task_runner=runner)
            def squares():
                return [f.result() for f in square.map(range(3))]

            state = squares(return_state=True)
            from prefect.client.orchestration import get_client
            with get_client(sync_client=True) as client:
                run = client.read_flow_run(state.state_details.flow_run_id)
            print(json.dumps({"harness": PREFECT_API_URL.value(), "result": state.result(),
                              "recorded": run.state.type.value, "workers_env": runner.cluster_kwargs["env"],
                              "env_during": env_during, "env_after": os.environ.get("PREFECT_API_URL"),
                              "hpc_garage_server": (Path.home() / ".hpc-garage" / "prefect").exists()}))
"""


def test_prefect_test_harness_api_is_used_and_no_server_started(tmp_path: Path) -> None:
    script = tmp_path / "harnessed.py"
    script.write_text(textwrap.dedent(HARNESS_SCRIPT))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "HPC_GARAGE_"))}
    env["HOME"] = str(tmp_path)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["result"] == [0, 1, 4] and seen["recorded"] == "COMPLETED"  # in the harness's database
    assert seen["workers_env"] == {"PREFECT_API_URL": seen["harness"]}
    assert seen["env_during"] is None and seen["env_after"] is None  # the test process's environment untouched
    assert not seen["hpc_garage_server"]


# ---------------------------------------------------------------------- prefect-dask's cluster_kwargs


@pytest.mark.parametrize("key", ["n_workers", "threads_per_worker", "worker_class"])
def test_localcluster_arguments_that_describe_workers_are_refused_in_one_line(api: dict[str, str], key: str) -> None:
    with pytest.raises(UserError, match=rf"cluster_kwargs=\{{'{key}': ...\}}\): hpc-garage's local cluster has the "
                                        r"workers of one node of site 'local'.*distributed.LocalCluster") as caught:
        task_runner(cluster_kwargs={key: 2, "dashboard_address": None})
    assert "\n" not in str(caught.value)


def test_processes_and_dashboard_address_are_honoured(api: dict[str, str]) -> None:
    import socket

    @task
    def where(i: int) -> int:
        return os.getpid()

    def run(**cluster_kwargs: Any) -> tuple[set[int], str]:
        @flow(task_runner=task_runner(cluster_kwargs=cluster_kwargs))
        def pids() -> tuple[set[int], str]:
            return {f.result() for f in where.map(range(4))}, FlowRunContext.get().task_runner.client.dashboard_link

        return pids()

    in_processes, _ = run(processes=True, dashboard_address=None)  # prefect-dask's documented defaults
    assert os.getpid() not in in_processes
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    in_threads, link = run(processes=False, dashboard_address=f"127.0.0.1:{port}")
    assert in_threads == {os.getpid()} and link.startswith(f"http://127.0.0.1:{port}/")
