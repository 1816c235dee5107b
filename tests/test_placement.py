"""Resource-aware placement (hpc_garage.cluster.placement) on real in-process Dask clusters: a task asking for GPU=1
is assigned only to a worker whose GPU is free, waits on the scheduler otherwise, and everything Dask
already did (tags, retries, failures, workers coming and going, plain clients) still works."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import dask
import pytest
from distributed import Client, Event, Scheduler, Worker, get_worker, wait
from distributed.diagnostics.plugin import SchedulerPlugin

from hpc_garage.cluster.placement import NAME, FreeResourcePlacement, fits, in_use, install
from tests.conftest import outside_job_env

GPU = {"GPU": 1}


# ------------------------------------------------------------------------------------------ pure parts


def test_fits_counts_what_is_in_use() -> None:
    assert fits({"GPU": 1}, {"GPU": 1, "CPU": 2}, {})
    assert not fits({"GPU": 1}, {"GPU": 1}, {"GPU": 1})
    assert fits({"GPU": 1}, {"GPU": 2}, {"GPU": 1})
    assert not fits({"GPU": 1}, {"CPU": 8}, {})  # a resource the worker lacks
    assert fits({"MEMORY": 0.1}, {"MEMORY": 0.3}, {"MEMORY": 0.2})  # float sums
    assert not fits({"GPU": 1, "CPU": 4}, {"GPU": 1, "CPU": 8}, {"CPU": 6})  # every resource must fit


# --------------------------------------------------------------------------------------------- helpers


class Watch(SchedulerPlugin):
    """Records every moment the scheduler had more resource-restricted work processing on a worker than
    the worker supplies: must stay empty."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.oversubscribed: list[tuple[str, dict[str, float]]] = []

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        ts = self.scheduler.tasks.get(key)
        ws = ts.processing_on if ts is not None else None
        if finish == "processing" and ws is not None:
            used = in_use(ws)
            if any(v > ws.resources.get(r, 0) + 1e-9 for r, v in used.items()):
                self.oversubscribed.append((ws.address, used))


@contextlib.asynccontextmanager
async def cluster(shapes: list[dict[str, Any]], *, placement: bool = True
                  ) -> AsyncIterator[tuple[Scheduler, list[Worker], Client, Watch]]:
    """A scheduler (with hpc-garage's placement unless told not to), one in-process worker per shape
    (`nthreads`, `resources`, `name`), and an asynchronous client."""
    async with Scheduler(host="127.0.0.1", port=0, dashboard_address=":0") as s:
        if placement:
            install(s)
        watch = Watch(s)
        s.add_plugin(watch, name="test-watch")
        workers = [await Worker(s.address, nthreads=shape.get("nthreads", 2), resources=shape.get("resources"),
                                name=shape.get("name", f"w{i}"))
                   for i, shape in enumerate(shapes)]
        try:
            async with Client(s.address, asynchronous=True) as client:
                yield s, workers, client, watch
        finally:
            await asyncio.gather(*(w.close() for w in workers))


def run(coro: Callable[[], Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro(), 60))


async def until(condition: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.01)


def blocked(event: str) -> str:
    Event(event).wait()
    return str(get_worker().name)


def napping(seconds: float) -> str:
    time.sleep(seconds)
    return str(get_worker().name)


def states(s: Scheduler, futures: list[Any]) -> Counter[str]:
    return Counter(s.tasks[f.key].state if f.key in s.tasks else "not yet" for f in futures)


# --------------------------------------------------------------------------------------- the behaviour


@pytest.mark.slow  # a Dask scheduler (and workers) in this process
def test_restricted_tasks_wait_on_the_scheduler_until_their_resource_frees() -> None:
    async def main() -> None:
        async with cluster([{"resources": GPU}, {"resources": GPU}]) as (s, workers, c, watch):
            futures = [c.submit(blocked, "go", resources=GPU, pure=False) for _ in range(6)]
            await until(lambda: states(s, futures)["processing"] == 2 and states(s, futures)["no-worker"] == 4)
            on = Counter(s.tasks[f.key].processing_on.name for f in futures if s.tasks[f.key].processing_on)
            assert on == {"w0": 1, "w1": 1}  # one per GPU; the other four are held on the scheduler
            assert all(sum(k in w.state.tasks for k in (f.key for f in futures)) == 1 for w in workers)
            await Event("go", client=c).set()
            ran = await c.gather(futures)
            # all six ran, on both GPUs, one at a time each; the split is whichever freed first (4/2 seen in CI)
            assert len(ran) == 6 and set(ran) == {"w0", "w1"}, ran
            assert not watch.oversubscribed

    run(main)


@pytest.mark.slow  # a Dask scheduler (and workers) in this process
def test_a_busy_gpu_keeps_no_task_from_a_free_one() -> None:
    """The benchmark's failure in small: trials of one name were short so far (a warm-up), one of them now
    runs long. Plain Dask, going by the short estimate, assigns every other trial submitted with it to the
    same worker, where they wait behind it (stealing ignores so little estimated work) while the other GPU
    idles. Held on the scheduler, they all run on the free GPU meanwhile."""

    async def main() -> None:
        async with cluster([{"resources": GPU}, {"resources": GPU}]) as (s, _, c, _w):
            await c.gather([c.submit(napping, 0.01, resources=GPU, key=f"trial-warm{i}") for i in range(4)])
            long = c.submit(blocked, "release", resources=GPU, key="trial-99")
            short = [c.submit(napping, 0.05, resources=GPU, key=f"trial-{i}") for i in range(6)]
            await until(lambda: states(s, [long])["processing"] == 1)
            busy = s.tasks[long.key].processing_on.name
            await wait(short, timeout=10)
            assert busy not in set(await c.gather(short))
            assert s.tasks[long.key].state == "processing"
            await Event("release", client=c).set()
            assert await long == busy

    run(main)


@pytest.mark.slow  # a Dask scheduler (and workers) in this process
def test_equal_trials_spread_evenly_after_a_misleading_warm_up() -> None:
    """The packing benchmark's shape: 8 one-GPU workers, a warm-up of short trials of the same name (wrong
    duration estimates), then 48 trials submitted one by one next to 16 unrestricted ones."""

    async def main() -> None:
        async with cluster([{"resources": GPU, "nthreads": 2} for _ in range(8)]) as (s, _, c, watch):
            warm = [c.submit(napping, 0.01, resources=GPU, pure=False, key=f"trial-warm{i}") for i in range(8)]
            await c.gather(warm)
            gpu, cpu = [], []
            for i in range(48):
                gpu.append(c.submit(napping, 0.2, resources=GPU, pure=False, key=f"trial-{i}"))
                if i % 3 == 0:
                    cpu.append(c.submit(napping, 0.2, pure=False, key=f"cpu-{i}"))
                await asyncio.sleep(0)
            per_worker = Counter(await c.gather(gpu))
            await c.gather(cpu)
            # an even share is 6; a worker slowed by the 2-core machine may leave one or two to the others
            # (Dask's own placement gave 2 to 11 per worker here, packing benchmark)
            assert len(per_worker) == 8 and max(per_worker.values()) <= 8, per_worker
            assert not watch.oversubscribed

    run(main)


@pytest.mark.slow  # a Dask scheduler (and workers) in this process
def test_tags_still_decide_which_workers_may_take_a_task() -> None:
    async def main() -> None:
        shapes = [{"resources": {"GPU": 1, "MEMORY": 4e9}, "name": "big"}, {"resources": GPU, "name": "gpu"},
                  {"resources": {"CPU": 2}, "name": "cpu"}]
        async with cluster(shapes) as (s, _, c, watch):
            gpu = [c.submit(napping, 0.02, resources=GPU, pure=False) for _ in range(10)]
            big = [c.submit(napping, 0.02, resources={"GPU": 1, "MEMORY": 3e9}, pure=False) for _ in range(4)]
            plain = [c.submit(napping, 0.02, pure=False) for _ in range(10)]
            cpu = [c.submit(napping, 0.02, resources={"CPU": 1}, pure=False) for _ in range(6)]
            assert set(await c.gather(gpu)) <= {"big", "gpu"}
            assert set(await c.gather(big)) == {"big"}
            assert set(await c.gather(cpu)) == {"cpu"}
            assert len(await c.gather(plain)) == 10
            assert not watch.oversubscribed

    run(main)


@pytest.mark.slow  # a Dask scheduler (and workers) in this process
def test_failures_and_retries_still_work_and_free_the_resource(tmp_path: Path) -> None:
    marker = str(tmp_path / "tried")

    def flaky() -> str:
        if not os.path.exists(marker):
            Path(marker).touch()
            raise RuntimeError("first attempt fails")
        return "second attempt"

    def broken() -> None:
        raise ValueError("always")

    async def main() -> None:
        async with cluster([{"resources": GPU}]) as (s, _, c, watch):
            bad = c.submit(broken, resources=GPU, pure=False)
            retried = c.submit(flaky, resources=GPU, retries=1, pure=False)
            rest = [c.submit(napping, 0.02, resources=GPU, pure=False) for _ in range(3)]
            with pytest.raises(ValueError, match="always"):
                await bad
            assert await retried == "second attempt"
            assert len(await c.gather(rest)) == 3
            assert not watch.oversubscribed

    run(main)


@pytest.mark.slow  # a Dask scheduler (and workers) in this process
def test_held_tasks_go_to_workers_that_join_and_leave_with_workers_that_go() -> None:
    async def main() -> None:
        async with cluster([{"resources": {"CPU": 2}}]) as (s, workers, c, _):
            futures = [c.submit(napping, 0.05, resources=GPU, pure=False) for _ in range(4)]
            await until(lambda: states(s, futures)["no-worker"] == 4)
            async with Worker(s.address, nthreads=2, resources=GPU, name="late") as late:
                assert set(await c.gather(futures)) == {"late"}
                held = c.submit(blocked, "late-go", resources=GPU, pure=False)
                queued = c.submit(napping, 0.01, resources=GPU, pure=False)
                await until(lambda: states(s, [queued])["no-worker"] == 1)
                async with Worker(s.address, nthreads=2, resources=GPU, name="spare"):
                    assert await queued == "spare"
                    await late.close(executor_wait=False)  # the blocked task's worker goes: it is placed again
                    await until(lambda: s.tasks[held.key].state == "processing")
                    await Event("late-go", client=c).set()
                    assert await held == "spare"

    run(main)


@pytest.mark.slow  # a Dask scheduler (and workers) in this process
def test_waiting_for_a_busy_gpu_is_not_a_no_workers_timeout() -> None:
    """`no-workers-timeout` fails tasks no worker can take; a task only waiting its turn must not fail."""

    async def main() -> None:
        with dask.config.set({"distributed.scheduler.no-workers-timeout": "1s"}):
            async with cluster([{"resources": GPU}]) as (s, _, c, _w):
                first = c.submit(napping, 3.0, resources=GPU, pure=False)
                second = c.submit(napping, 0.01, resources=GPU, pure=False)
                impossible = c.submit(napping, 0.01, resources={"TPU": 1}, pure=False)
                assert await second == "w0" and await first == "w0"
                with pytest.raises(Exception, match="TPU|no worker|NoValidWorker"):
                    await impossible

    run(main)


@pytest.mark.slow  # a Dask scheduler (and workers) in this process
def test_installing_twice_keeps_one_plugin() -> None:
    async def main() -> None:
        async with Scheduler(host="127.0.0.1", port=0, dashboard_address=":0") as s:
            first, second = install(s), install(s)
            assert first is second and isinstance(s.plugins[NAME], FreeResourcePlacement)
            assert s.periodic_callbacks[NAME].is_running()

    run(main)


@pytest.mark.slow  # a Dask scheduler (and workers) in this process
def test_the_local_cluster_scheduler_has_it() -> None:
    from hpc_garage.cluster.local import cluster_specs

    async def main() -> None:
        spec, _ = cluster_specs([])
        async with spec["cls"](**spec["options"]) as s:
            assert isinstance(s.plugins.get(NAME), FreeResourcePlacement)
            assert s.periodic_callbacks[NAME].is_running()

    run(main)


@pytest.mark.slow
def test_hpc_garage_run_schedulers_hold_gpu_tasks(tmp_path: Path) -> None:
    """`hpc-garage run` (the scheduler of the mpi, local and jobqueue launchers): 4 one-GPU workers, 8 GPU
    tasks: 4 run, 4 wait on the scheduler, none on a worker."""
    check = tmp_path / "check.py"
    check.write_text(textwrap.dedent("""
        import time
        from distributed import Client
        from hpc_garage.cluster.handoff import handoff_from_env

        def states(dask_scheduler=None):
            return sorted(ts.state for k, ts in dask_scheduler.tasks.items() if str(k).startswith("nap-"))

        if __name__ == "__main__":
            h = handoff_from_env()
            with Client(h.address, security=h.security(), timeout=30) as c:
                assert c.run_on_scheduler(lambda dask_scheduler: "%s" in dask_scheduler.plugins)
                futures = [c.submit(time.sleep, 1.0, resources={"GPU": 1}, key=f"nap-{i}") for i in range(8)]
                deadline = time.monotonic() + 20
                while c.run_on_scheduler(states) != ["no-worker"] * 4 + ["processing"] * 4:
                    assert time.monotonic() < deadline, c.run_on_scheduler(states)
                    time.sleep(0.02)
                c.gather(futures)
    """ % NAME))
    env = outside_job_env()
    done = subprocess.run([sys.executable, "-m", "hpc_garage", "run", "--site", "lab-gpu", "--",
                           sys.executable, str(check)], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
