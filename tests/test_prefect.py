"""HpcTaskRunner with real Prefect and real Dask: placement by tags, Prefect's view of runs, TLS handoff."""

from __future__ import annotations

import gc

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import cloudpickle
import dask
import pytest
from distributed import Client, Nanny, Scheduler, SpecCluster, get_worker
from distributed.security import Security
from prefect import flow, task, tags
from prefect_dask import DaskTaskRunner

import hpc_garage
from hpc_garage.core.errors import UserError
from hpc_garage.cluster.handoff import Handoff
from hpc_garage.rundir import RunDir
from hpc_garage.prefect.task_runner import HpcTaskRunner, task_runner
from tests.conftest import task_runs

ROOT = Path(__file__).resolve().parent.parent
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # worker processes cannot import this file

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------------------------------- tasks


@task(tags=hpc_garage.resources(gpu=1))
def on_gpu(i: int, seconds: float = 0.0) -> tuple[str, float, float]:
    start = time.time()
    time.sleep(seconds)
    return str(get_worker().name), start, time.time()


@task
def anywhere(i: int) -> str:
    return str(get_worker().name)


@task(tags=hpc_garage.resources(cpu=1))
def one_cpu(i: int) -> str:
    return str(get_worker().name)


@task(retries=1)
def always_fails() -> None:
    raise RuntimeError("no luck")


@task(retries=1)
def fails_once() -> int:
    from prefect.runtime import task_run

    if task_run.run_count < 2:
        raise RuntimeError("first attempt fails")
    return int(task_run.run_count)


def load_example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)
    return module


# ------------------------------------------------------------------------------------------- placement


def test_tagged_tasks_land_only_on_a_worker_with_the_resource(runner: HpcTaskRunner) -> None:
    @flow(task_runner=runner)
    def placed() -> tuple[list[Any], list[str]]:
        return on_gpu.map(range(8), seconds=0.05).result(), anywhere.map(range(8)).result()

    gpu_runs, free_runs = placed()
    assert {name for name, _, _ in gpu_runs} == {"gpu"}
    assert set(free_runs) <= {"gpu", "cpu"}


def test_gpu_tasks_never_overlap_on_a_one_gpu_worker(runner: HpcTaskRunner) -> None:
    @flow(task_runner=runner)
    def exclusive() -> list[Any]:
        return [f.result() for f in [on_gpu.submit(i, 0.3) for i in range(5)]]

    intervals = sorted((start, end) for _, start, end in exclusive())
    for (_, end), (start, _) in zip(intervals, intervals[1:]):
        assert start >= end, f"GPU tasks overlapped: {intervals}"


def test_dask_annotate_still_works_and_merges_with_tags(runner: HpcTaskRunner) -> None:
    @flow(task_runner=runner)
    def annotated() -> tuple[list[str], list[str]]:
        with dask.annotate(resources={"GPU": 1}):
            untagged = anywhere.map(range(6)).result()  # the annotation alone
            tagged = one_cpu.map(range(6)).result()  # CPU=1 from the tag plus GPU=1 from the annotation
        return untagged, tagged

    untagged, tagged = annotated()
    assert set(untagged) == {"gpu"} and set(tagged) == {"gpu"}


def test_prefect_tags_context_counts(runner: HpcTaskRunner) -> None:
    @flow(task_runner=runner)
    def in_context() -> list[str]:
        with tags(*hpc_garage.resources(gpu=1)):
            return anywhere.map(range(6)).result()

    assert set(in_context()) == {"gpu"}


def test_malformed_tag_fails_the_flow_naming_the_tag(runner: HpcTaskRunner) -> None:
    @flow(task_runner=runner)
    def malformed() -> None:
        anywhere.with_options(tags=["dask-resource:GPU=abc"]).submit(0).result()

    with pytest.raises(UserError, match=r"task 'anywhere'.*'dask-resource:GPU=abc'"):
        malformed()


def test_a_resource_no_worker_has_is_refused_not_left_waiting(runner: HpcTaskRunner) -> None:
    @flow(task_runner=runner)
    def unplaceable() -> None:
        anywhere.with_options(tags=["dask-resource:gpu=1"]).submit(0).result()

    with pytest.raises(UserError, match=r"asks for gpu=1 but no worker.*CPU=2, GPU=1"):
        unplaceable()


# ------------------------------------------------------------------------------- what Prefect records


def test_diamond_total_and_every_task_run_completed_in_prefect(runner: HpcTaskRunner) -> None:
    diamond = load_example("diamond").diamond.with_options(task_runner=runner)
    state = diamond(10, return_state=True)
    assert state.result() == 10 * 9
    runs = task_runs(state.state_details.flow_run_id)
    assert len(runs) == 3 * 10 + 1
    assert {r.state.type.value for r in runs} == {"COMPLETED"}


def test_retries_behave_as_in_plain_prefect_dask(runner: HpcTaskRunner, cluster: SpecCluster) -> None:
    def run(task_runner_: Any, settled: int = 0) -> dict[str, tuple[str, int]]:
        @flow(task_runner=task_runner_)
        def retried() -> None:
            always_fails.submit().wait()
            fails_once.submit().wait()

        state = retried(return_state=True)
        return {r.name.rsplit("-", 1)[0]: (r.state.type.value, r.run_count)
                for r in task_runs(state.state_details.flow_run_id, settled=settled)}

    ours = run(runner)  # read at once: the runner waited for the API to record them
    assert ours == {"always_fails": ("FAILED", 2), "fails_once": ("COMPLETED", 2)}
    assert ours == run(DaskTaskRunner(address=cluster.scheduler_address), settled=2)


# ----------------------------------------------------------------------------------------- TLS handoff


def test_handoff_file_with_tls(api: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rundir = RunDir(tmp_path / "job-7").create()
    tls = rundir.write_credentials()
    security = Security(require_encryption=True, **tls)
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": ":0",
                                                "security": security, "protocol": "tls"}}
    workers = {"w0": {"cls": Nanny, "options": {"nthreads": 1, "security": security, "host": "127.0.0.1",
                                                 "protocol": "tls", "resources": {"GPU": 1}}}}
    with SpecCluster(workers=workers, scheduler=scheduler, security=security) as tls_cluster:
        address = tls_cluster.scheduler_address
        assert address.startswith("tls://")
        path = rundir.publish(Handoff(address=address, job_id="job-7", tls=tls, workers=["w0"]))
        monkeypatch.setenv("HPC_GARAGE_SCHEDULER_FILE", str(path))
        monkeypatch.setenv("HPC_GARAGE_JOB_ID", "job-7")

        runner = task_runner()
        assert runner.address == address and runner.client_kwargs["security"] is not None

        @flow(task_runner=runner)
        def through_handoff() -> list[Any]:
            return on_gpu.map(range(3)).result()

        assert {name for name, _, _ in through_handoff()} == {"w0"}

        with pytest.raises(TypeError, match="TLS expects"):  # no credentials: not even attempted
            Client(address, timeout=3)
        for stranger in (address.replace("tls://", "tcp://"), address):  # plain tcp; another job's certificate
            gc.collect()  # a failed Client collected while the next holds distributed's LoopRunner lock can hang
            with pytest.raises((OSError, TimeoutError)):
                Client(stranger, timeout=3, security=Security.temporary() if "tls" in stranger else None)


# ------------------------------------------------------------------ scripts: local fallback and guards


def script_env(api: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, **api}
    env.pop("HPC_GARAGE_SCHEDULER_FILE", None)
    return env


def local_site_cluster_works() -> str | None:
    try:
        from hpc_garage.cluster.local import LocalSiteCluster  # noqa: F401
    except ImportError as exc:
        return f"hpc_garage.cluster.local.LocalSiteCluster is not importable: {exc}"
    return None


def test_unguarded_flow_call_is_refused_before_workers_start(api: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent("""
        from prefect import flow, task
        import hpc_garage

        @task
        def one():
            return 1

        @flow(task_runner=hpc_garage.task_runner())
        def main():
            return one.submit().result()

        main()
    """))
    done = subprocess.run([sys.executable, str(script)], env=script_env(api), capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode != 0
    assert f"{script}, line 13" in done.stderr and 'if __name__ == "__main__":' in done.stderr
    assert "Nanny failed to start" not in done.stderr


@pytest.mark.skipif(bool(local_site_cluster_works()), reason=str(local_site_cluster_works()))
def test_sweep_example_on_the_local_fallback(api: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "sweep.py"), "--seeds", "2", "--lrs", "0.1,0.01",
         "--duration", "0.2", "--out", str(out)],
        env=script_env(api), capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["result"] == result["expected"] == round(3 * 0.11, 9)
    assert len(result["records"]) == 4 and all(r["pid"] != os.getpid() for r in result["records"])
    assert "Starting temporary server" not in done.stdout + done.stderr  # one API, not one per worker
    assert "sweep: 4 experiments" in done.stdout


SIGNALLED_FLOW = """
import os, signal, sys, time
from pydantic import BaseModel, field_serializer
from prefect import flow, task
from hpc_garage.prefect import fast
from hpc_garage.prefect.task_runner import task_runner

class Hook(BaseModel):
    value: int = 0

    @field_serializer("value")
    def _signalled(self, value: int) -> int:  # SIGTERM lands while pydantic serializes (issue 31)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # Prefect's handler raises TerminationSignal here, inside the serializer
        return value

settings = fast.Submitter._settings
fast.Submitter._settings = lambda self: (Hook().model_dump(), settings(self))[1]

@task
def one() -> int:
    return 1

@flow(task_runner=task_runner(address=sys.argv[1]))
def signalled() -> int:
    return one.submit().result()

signalled()
"""


def test_a_termination_signal_inside_a_submissions_serialization_crashes_the_flow_run(
        cluster: SpecCluster, tmp_path: Path) -> None:
    """Prefect ends a flow run that SIGTERM stops as Crashed (a wind-down's follow-up job depends on it),
    even when the signal lands inside pydantic, which wraps it in a PydanticSerializationError."""
    from prefect import get_client

    script = tmp_path / "signalled.py"
    script.write_text(SIGNALLED_FLOW)
    done = subprocess.run([sys.executable, str(script), cluster.scheduler_address], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == -15, done.stdout + done.stderr  # Prefect re-sends SIGTERM to end the process
    with get_client(sync_client=True) as client:
        runs = [r for r in client.read_flow_runs() if r.name and r.flow_id and r.state is not None]
        signalled = [r for r in runs if client.read_flow(r.flow_id).name == "signalled"]
    assert [r.state.type.value for r in signalled] == ["CRASHED"], (signalled, done.stderr[-3000:])
    assert "PydanticSerializationError" not in done.stderr, done.stderr[-3000:]
