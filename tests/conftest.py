"""Shared test set-up: the `slurm` marker, helpers to build sites in tmp dirs, and the Prefect server, Dask
cluster and task runner that the Prefect tests share (fixtures `api`, `cluster`, `runner`)."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from bench.common import outside_job_env  # the one copy: bench and tests strip a job's environment alike

if TYPE_CHECKING:  # Prefect and Dask are imported only by the tests that use these fixtures
    from distributed import SpecCluster

    from hpc_garage.prefect.task_runner import HpcTaskRunner

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"


@functools.cache
def slurm_reachable() -> str | None:
    """None if a SLURM controller answers here, else why not."""
    if not shutil.which("sinfo"):
        return "sinfo is not installed"
    try:
        done = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return "sinfo timed out"
    if done.returncode != 0:
        return f"sinfo failed: {done.stderr.strip()}"
    return None


SERVER_FIXTURES = {"api", "cluster", "runner"}  # a Prefect server, a Dask cluster (below)


# `scripts/test` (no arguments) runs the SLURM tests in five shards side by side, each on a cluster of its own
# (shards 2-5 reached through SLURM_CONF); $HPC_GARAGE_SLURM_SHARD picks one. A test goes to the shard of the
# longest key here that its node id starts with (a module, or one test or parameter of it); the rest to shard 1,
# the default cluster, whose node names (node1, node2) some tests assert. Balanced by the durations CI printed
# (--durations): about 20 minutes each, `other` included.
SHARDS = {"test_long_trials.py": "2", "test_pruning_sweep.py": "2", "test_prefect_api.py": "2", "test_doctor.py": "2",
          "test_work_pool.py": "3", "test_bench.py": "3",
          "test_docs.py": "4", "test_durable.py": "4",
          "test_tuning_search.py": "5", "test_container_slurm.py": "5", "test_jobqueue_slurm.py": "5"}
QUICK_BENCH = "test_bench.py::test_quick_bench_runs_every_benchmark"
SHARDS |= {f"{QUICK_BENCH}[{name}]": shard for shard, names in
           {"1": ("cli", "scale"), "2": ("faults", "trials"), "3": ("ui", "packing"),
            "4": ("overhead", "reports"), "5": ("startup", "deployment", "pruning")}.items() for name in names}
# Tests without SLURM run in the sixth process, `other`, but for these: slow ones that fit beside a shard's
# waiting (each its own Prefect server or cluster, so that where they run does not matter)
BESIDE_SHARDS = {"test_prefect_server_idle.py": "1", "test_prefect_server_sweeps.py": "4",
                 "test_container_slurm.py": "5"}  # (with its SLURM tests: one image built, not two)
SHARD_ENV = "HPC_GARAGE_SLURM_SHARD"  # 1-5: that shard's SLURM tests and the others BESIDE_SHARDS gives it;
                                      # `other`: the tests without SLURM, but those; unset: all


def shard_of(nodeid: str, table: dict[str, str] = SHARDS, default: str | None = "1") -> str | None:
    """A test's shard: that of the longest key of `table` its node id (file name first) starts with."""
    name = nodeid.rsplit("/", 1)[-1]
    keys = [key for key in table if name == key or name.startswith((key + "::", key + "["))]
    return table[max(keys, key=len)] if keys else default


def _in_shard(item: pytest.Item, shard: str) -> bool:
    if "slurm" in item.keywords:
        return shard_of(item.nodeid) == shard
    return shard_of(item.nodeid, BESIDE_SHARDS, "other") == shard


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that starts a Prefect server or a Dask cluster is marked `slow`, so that the fast layer
    (`scripts/test --fast`: -m "not slow and not slurm") starts none; one that uses these fixtures unmarked
    is refused here rather than slowing every fast run. Under $HPC_GARAGE_SLURM_SHARD, the other shard's
    SLURM tests are deselected."""
    unmarked = [item.nodeid for item in items
                if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())) and "slow" not in item.keywords]
    if unmarked:
        raise pytest.UsageError("mark these tests `slow` (they start a Prefect server or a Dask cluster): "
                                + ", ".join(unmarked))
    shard = os.environ.get(SHARD_ENV)
    if shard:
        keep = [item for item in items if _in_shard(item, shard)]
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("slurm") and (why := slurm_reachable()):  # a marker, not a parameter's id
        if os.environ.get("CI") == "true":
            pytest.fail(f"SLURM test cannot run under CI: {why} (scripts/local-slurm up should have started it)")
        pytest.skip(f"no SLURM reachable: {why}; run scripts/local-slurm up")


@pytest.fixture(autouse=True)
def _no_prefect_server_outlives_its_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """A managed Prefect server that a test started under its own tmp_path (as HOME) ends with the test, not
    30 minutes later by its idle timeout: alive, each costs about 1 % of a core and 250 MB, and CI runs
    hundreds of such tests on 2 cores."""
    yield
    tmp = getattr(request.node, "funcargs", {}).get("tmp_path")
    if tmp is None:
        return
    records = [p for p in Path(tmp).rglob("server.json") if ".hpc-garage/prefect/" in str(p)]
    if records:
        from hpc_garage.prefect.server.processes import terminate
        from hpc_garage.prefect.server.state import ServerDir

        for record in records:
            if (state := ServerDir(record.parent).state()) is not None:
                terminate(state)


@pytest.fixture(autouse=True)
def _no_stop_outlives_its_test() -> Iterator[None]:
    """A stop told to this process (a wind-down reaching a Dask worker that a test runs in-process) is
    forgotten after the test: left set, every later test in the process would see `trial.should_stop()`."""
    yield
    if (stopping := sys.modules.get("hpc_garage.cluster.stopping")) is not None:
        stopping.reset()


@pytest.fixture
def site_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private site directory first on the search path."""
    d = tmp_path / "sites"
    d.mkdir()
    monkeypatch.setenv("HPC_GARAGE_SITES_PATH", str(d))
    return d


def read_env_dump(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    return env


# ------------------------------------------------------------------------ Prefect and Dask (test_prefect*)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """One hpc-garage Prefect server per test module, in a private HOME (results persist under it)."""
    from hpc_garage.prefect import fast as prefect_fast
    from hpc_garage.prefect.flow_api import use_api
    from hpc_garage.prefect.server import ensure_api, stop_server

    home = tmp_path_factory.mktemp("home")
    saved = dict(os.environ)
    os.environ["HOME"] = str(home)
    for name in ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_HOME", "HPC_GARAGE_SCHEDULER_FILE",
                 prefect_fast.DISABLE_ENV):
        os.environ.pop(name, None)
    env = ensure_api()
    use_api(env)
    yield env
    stop_server()
    os.environ.clear()
    os.environ.update(saved)
    import prefect.context

    prefect.context.refresh_global_settings_context()


@pytest.fixture(scope="module")
def cluster(api: dict[str, str]) -> Iterator[SpecCluster]:
    """One worker with a GPU, one without, two threads each: nothing but resources keeps tasks apart."""
    from distributed import Nanny, Scheduler, SpecCluster

    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": ":0"}}
    workers = {"gpu": {"cls": Nanny, "options": {"nthreads": 2, "resources": {"GPU": 1, "CPU": 2}}},
               "cpu": {"cls": Nanny, "options": {"nthreads": 2, "resources": {"CPU": 2}}}}
    with SpecCluster(workers=workers, scheduler=scheduler) as c:
        yield c


@pytest.fixture
def runner(cluster: SpecCluster) -> HpcTaskRunner:
    from hpc_garage.prefect.task_runner import task_runner

    return task_runner(address=cluster.scheduler_address)


def task_runs(flow_run_id: Any, *, settled: int = 0, timeout: float = 30) -> list[Any]:
    """The task runs Prefect's API holds for one flow run; with `settled=N`, once N of them are in a final
    state (plain prefect-dask returns before the server has recorded them: it records from events, in
    batches; hpc-garage's runner waits for that, so its runs are read at once)."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                                         limit=200)
            final = [r for r in runs if r.state is not None and r.state.is_final()]
            if len(final) >= settled or time.monotonic() > deadline:
                return runs
            time.sleep(0.2)


# ------------------------------------------------------------------------------------------ session end


_exit_status: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _exit_status.append(int(exitstatus))


def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave without running atexit handlers once pytest has reported.

    Prefect's API log and event workers drain at interpreter exit with no time limit; after a test module has
    stopped its Prefect server they retry for ever ("Still processing items"), and the finished run never exits.
    """
    import sys

    if _exit_status and "prefect" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[-1])
