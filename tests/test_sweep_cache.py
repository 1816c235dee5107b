"""Trials cached per sweep epoch (prefect/sweep_cache.py): which tasks get the sweep's caching, and, with real
flows run twice in the same epoch, which run again: Prefect's own opt-outs are honoured."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from prefect import task
from prefect.cache_policies import DEFAULT, INPUTS, NO_CACHE

from hpc_garage.prefect.sweep_cache import SweepScope, SweepTasks
from hpc_garage.core.sweep import SOURCES_DIR
from hpc_garage.sweeps import source_changes
from hpc_garage.variables import RESULTS_ENV, SWEEP_ENV


@pytest.fixture
def swept(tmp_path: Path) -> SweepTasks:
    return SweepTasks({SWEEP_ENV: "s@1", RESULTS_ENV: str(tmp_path)})


def _scope(policy: object) -> list[str]:
    return [p.sweep for p in getattr(policy, "policies", []) if isinstance(p, SweepScope)]


def test_a_task_without_a_policy_of_its_own_is_keyed_to_the_sweep_and_persisted(swept: SweepTasks,
                                                                                   tmp_path: Path) -> None:
    @task
    def plain(x: int) -> int:
        return x

    out = swept(plain)
    assert _scope(out.cache_policy) == ["s@1"] and out.persist_result is True
    assert out.result_storage == tmp_path
    assert swept(plain) is out  # once per task object


@pytest.mark.parametrize("options", [{"cache_policy": NO_CACHE}, {"persist_result": False}],
                         ids=["NO_CACHE", "persist_result=False"])
def test_tasks_that_opt_out_are_left_alone(swept: SweepTasks, options: dict) -> None:
    @task(**options)
    def opted_out(x: int) -> int:
        return x

    assert swept(opted_out) is opted_out


def test_a_policy_of_the_users_own_is_kept_and_stored_with_the_sweep(swept: SweepTasks, tmp_path: Path) -> None:
    @task(cache_policy=INPUTS)
    def mine(x: int) -> int:
        return x

    @task(cache_policy=DEFAULT)  # asked for by name: the flow-run scope is the user's choice
    def explicit(x: int) -> int:
        return x

    for t in (mine, explicit):
        out = swept(t)
        assert out.cache_policy == t.cache_policy and not _scope(out.cache_policy)
        assert out.result_storage == tmp_path


def test_outside_a_sweep_nothing_changes() -> None:
    @task
    def plain(x: int) -> int:
        return x

    assert SweepTasks({})(plain) is plain


FLOW = '''
import os, sys, uuid
from pathlib import Path
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
import hpc_garage

MARKS = Path(sys.argv[1])

def mark(kind):
    (MARKS / f"{kind}-{uuid.uuid4().hex}").touch()

@task
def cached(i: int) -> int:
    mark("cached")
    return i * SOURCE_MARK

@task(cache_policy=NO_CACHE)
def uncached(i: int) -> int:
    mark("uncached")
    return i

@task(refresh_cache=True)
def refreshed(i: int) -> int:
    mark("refreshed")
    return i

@flow(task_runner=hpc_garage.task_runner())
def sweep() -> int:
    a = cached.map(range(3))
    b = uncached.map(range(2))
    c = refreshed.map(range(2))
    return sum(f.result() for f in [*a, *b, *c])

if __name__ == "__main__":
    print("RESULT", sweep())
'''


def _run_flow(script: Path, marks: Path, results: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPC_GARAGE", "SLURM", "PBS_"))}
    env |= {SWEEP_ENV: "flow-test@1", RESULTS_ENV: str(results), "HPC_GARAGE_SITE": "local"}
    done = subprocess.run([sys.executable, str(script), str(marks)], capture_output=True, text=True, env=env,
                          timeout=300, cwd=script.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_in_one_epoch_finished_trials_are_read_back_and_opt_outs_run_again(tmp_path: Path) -> None:
    script, marks, results = tmp_path / "flow.py", tmp_path / "marks", tmp_path / "results"
    marks.mkdir()
    results.mkdir()
    script.write_text(FLOW.replace("SOURCE_MARK", "1"))
    first = _run_flow(script, marks, results)
    second = _run_flow(script, marks, results)
    assert "RESULT 5" in first and "RESULT 5" in second  # the same result, read back

    def runs(kind: str) -> int:
        return len(list(marks.glob(f"{kind}-*")))

    assert (runs("cached"), runs("uncached"), runs("refreshed")) == (3, 4, 4)
    assert source_changes(results) == {}  # ran again by choice (refresh_cache), not because its source changed
    noted = sorted(p.name for p in (results / SOURCES_DIR).iterdir())  # one file per task name, none per trial
    assert 1 <= len(noted) <= 2 and all(name.startswith("task-") for name in noted), noted
    script.write_text(FLOW.replace("SOURCE_MARK", "2"))  # the task's source changed: its cache misses
    assert "RESULT 8" in _run_flow(script, marks, results)
    assert runs("cached") == 6
    assert source_changes(results) == {"cached": 3}  # what `status` says: 3 ran again, source changed
