"""cluster/node_loss.py's decisions, with a scheduler, a launcher and a layout of plain objects and the clock
shortened: which node is named lost, when it is started again, when the run stops and what it says. The real
thing (a node process SIGKILLed under SLURM) is tests/test_faults.py."""

from __future__ import annotations

import asyncio
import signal
from types import SimpleNamespace
from typing import Any

import pytest

from hpc_garage.cluster import node_loss
from hpc_garage.cluster.node_loss import NodeWatch, watch_nodes


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_loss, "POLL", 0.01)
    monkeypatch.setattr(node_loss, "NODE_GONE_AFTER", 0.05)
    monkeypatch.setattr(node_loss, "RESTART_WAIT", 0.5)


def two_nodes(on_node_loss: str = "continue", node_restarts: int = 1) -> Any:
    """Two nodes of two workers each (node2 has the workers w2, w3)."""
    workers = [SimpleNamespace(name=f"w{i}", node=i // 2) for i in range(4)]
    return SimpleNamespace(site=SimpleNamespace(mpi=SimpleNamespace(on_node_loss=on_node_loss,
                                                                    node_restarts=node_restarts)),
                           allocation=SimpleNamespace(nodes=[SimpleNamespace(host="node1"),
                                                             SimpleNamespace(host="node2")]),
                           workers=workers)


class Scheduler:
    def __init__(self, names: list[str]) -> None:
        self.workers = {n: SimpleNamespace(name=n) for n in names}


class Launcher:
    """One process per node (srun): it says which node's process ended; `restart_node` brings its workers back."""

    per_node = True
    nodes_watched = True

    def __init__(self, scheduler: Scheduler, losses: list[tuple[int, str]], restarts: bool = True) -> None:
        self.scheduler, self.losses, self.restarts, self.restarted = scheduler, losses, restarts, []

    def lost_nodes(self) -> list[tuple[int, str]]:
        events, self.losses = self.losses, []
        for node, _ in events:  # the node's workers leave with its process
            for name in [f"w{2 * node}", f"w{2 * node + 1}"]:
                self.scheduler.workers.pop(name, None)
        return events

    async def restart_node(self, node: int) -> bool:
        self.restarted.append(node)
        if self.restarts:
            self.scheduler.workers.update({n: SimpleNamespace(name=n) for n in (f"w{2 * node}", f"w{2 * node + 1}")})
        return self.restarts


def watch(launcher: Any, scheduler: Scheduler, layout_: Any, timeout: float = 2.0) -> tuple[list[dict], list[str]]:
    """Run the watch until it stops the run or `timeout`; what it recorded last, and why it stopped."""
    records: list[dict] = []
    stops: list[str] = []

    async def main() -> None:
        task = asyncio.ensure_future(watch_nodes(scheduler, launcher, layout_, lambda **r: records.append(r),
                                                 stops.append))
        try:
            await asyncio.wait_for(task, timeout)
        except asyncio.TimeoutError:
            pass

    asyncio.run(main())
    return records, stops


def test_a_lost_node_is_named_and_started_again_and_the_run_goes_on() -> None:
    scheduler = Scheduler(["w0", "w1", "w2", "w3"])
    launcher = Launcher(scheduler, [(1, "its srun step ended (exit 137)")])
    records, stops = watch(launcher, scheduler, two_nodes(), timeout=0.5)
    assert stops == [] and launcher.restarted == [1]
    [lost] = records[-1]["lost_nodes"]
    assert lost["node"] == 1 and lost["host"] == "node2" and lost["workers"] == ["w2", "w3"]
    assert lost["why"] == "its srun step ended (exit 137)" and lost["restarted"] is True
    assert records[-1]["workers"] == 4  # back: the restarted node's workers took their names again


def test_on_node_loss_stop_ends_the_run_naming_the_node() -> None:
    scheduler = Scheduler(["w0", "w1", "w2", "w3"])
    launcher = Launcher(scheduler, [(1, "gone")])
    records, stops = watch(launcher, scheduler, two_nodes(on_node_loss="stop"))
    assert stops == ["stopping the run: node 1 (node2) was lost and the site's mpi.on_node_loss is stop"]
    assert launcher.restarted == [] and records[-1]["lost_nodes"][0]["restarted"] is False


def test_with_no_node_left_the_run_stops_instead_of_idling_to_walltime() -> None:
    scheduler = Scheduler(["w0", "w1", "w2", "w3"])
    launcher = Launcher(scheduler, [(0, "gone"), (1, "gone")], restarts=False)
    records, stops = watch(launcher, scheduler, two_nodes(node_restarts=0))
    assert stops == ["stopping the run: no node is left (node1, node2 lost), so nothing can run the remaining "
                     "trials; not waiting for walltime"]
    assert [e["node"] for e in records[-1]["lost_nodes"]] == [0, 1] and records[-1]["workers"] == 0


def test_one_launch_for_every_node_a_node_whose_workers_all_left_is_lost() -> None:
    """mpiexec: no process per node to watch; a node counts as lost once all its workers left the scheduler
    for NODE_GONE_AFTER, and a node with one worker back is not."""
    scheduler = Scheduler(["w0", "w1", "w3"])  # node 1 has one worker back (a Nanny restarting the other)
    launcher = Launcher(scheduler, [])
    launcher.per_node = False
    records, stops = watch(launcher, scheduler, two_nodes(), timeout=0.3)
    assert stops == [] and not any(r["lost_nodes"] for r in records)
    del scheduler.workers["w0"], scheduler.workers["w1"]
    records, stops = watch(launcher, scheduler, two_nodes(), timeout=0.5)
    [lost] = records[-1]["lost_nodes"]
    assert lost["node"] == 0 and lost["why"].startswith("all its workers left the scheduler")
    assert launcher.restarted == []  # one launch hosts every node: nothing to start again alone


def test_the_run_exits_non_zero_once_the_watch_stopped_it() -> None:
    watch_ = NodeWatch()
    assert watch_.exit_code(0) == 0 and watch_.exit_code(3) == 3
    watch_.stopped = "stopping the run: no node is left"
    assert watch_.exit_code(0) == 1 and watch_.exit_code(3) == 3


def test_the_job_ending_cancels_the_watch_so_its_end_is_no_lost_node() -> None:
    async def main() -> bool:
        scheduler = Scheduler(["w0", "w1", "w2", "w3"])
        launcher = Launcher(scheduler, [])
        watch_ = NodeWatch().start(scheduler, launcher, two_nodes(), lambda **r: None, proc=None)  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        watch_.job_ending(signal.SIGTERM)
        await asyncio.sleep(0.05)
        return watch_._tasks[0].cancelled()

    assert asyncio.run(main())
