"""Watch a running allocation's node processes for the whole run (issue 11): a lost node is named, and
started again where the launcher can, and a run left with no node stops at once instead of idling to walltime.

Why: workers that die with their node process leave the flow waiting for workers that will never come
(measured before this: 469 s with zero workers, until walltime, while `status` said "running (8 workers)").
Dask itself hands a lost worker's running trials to the others; what it cannot do is tell the user, start the
node again, or give up when nothing is left.

A loss is seen two ways: the launcher says a node's own process ended (`Launcher.lost_nodes`, srun: one step
per node), or, where one launch hosts every node (mpiexec), all of a node's workers have left the scheduler
for NODE_GONE_AFTER seconds (a Nanny restarting one worker takes a second or two; a node whose every worker
is away that long is gone). Each loss goes to the job log and to state.json's `lost_nodes`, which
`hpc-garage status` shows.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from hpc_garage.core.layout import Layout
from hpc_garage.launchers.common import Launcher

POLL = 0.5  # s between looks at the launcher and the scheduler
NODE_GONE_AFTER = 10.0  # s all of a node's workers may be away before the node counts as lost (mpiexec)
RESTART_WAIT = 30.0  # s a restart waits for the lost node's old workers to leave the scheduler (their names)

logger = logging.getLogger(__name__)  # the job log: each lost node, each restart, why the run stops


async def watch_nodes(scheduler: Any, launcher: Launcher, layout_: Layout, record: Callable[..., None],
                      stop: Callable[[str], None]) -> None:
    """Until cancelled (teardown) or the run must stop: `record(workers=..., lost_nodes=[...])` on every
    change, `stop(why)` once when no node is left or the site's `mpi.on_node_loss` is `stop`."""
    mpi = layout_.site.mpi
    hosts = [n.host or f"node {i}" for i, n in enumerate(layout_.allocation.nodes)]
    node_of = {w.name: w.node for w in layout_.workers}
    names = {i: [w.name for w in layout_.workers if w.node == i] for i in range(len(hosts))}
    watched = [i for i in range(len(hosts)) if names[i]]  # a node without workers has no process to lose
    lost: list[dict[str, Any]] = []
    down: set[int] = set()
    restarts: Counter[int] = Counter()
    absent_since: dict[int, float] = {}
    last_count = len(scheduler.workers)

    def present_nodes() -> set[int]:
        return {node_of[str(ws.name)] for ws in scheduler.workers.values() if str(ws.name) in node_of}

    while True:
        await asyncio.sleep(POLL)
        events = launcher.lost_nodes()
        if not launcher.per_node:
            present, now = present_nodes(), time.monotonic()
            for node in watched:
                if node in present:
                    absent_since.pop(node, None)
                    down.discard(node)
                elif node not in down and now - absent_since.setdefault(node, now) > NODE_GONE_AFTER:
                    events.append((node, f"all its workers left the scheduler over {NODE_GONE_AFTER:.0f} s ago"))
        changed = bool(events) or len(scheduler.workers) != last_count
        for node, why in events:
            entry = {"node": node, "host": hosts[node], "at": time.time(), "why": why, "workers": names[node],
                     "restarted": False}
            lost.append(entry)
            down.add(node)
            logger.info(f"node {node} ({hosts[node]}) lost at {time.strftime('%H:%M:%S')}: {why}; its workers "
                        f"({', '.join(names[node])}) are gone, and their running trials go to the other workers")
            if mpi.on_node_loss == "stop":
                record(workers=len(scheduler.workers), lost_nodes=lost)
                stop(f"stopping the run: node {node} ({hosts[node]}) was lost and the site's mpi.on_node_loss "
                     "is stop")
                return
            if restarts[node] < mpi.node_restarts and launcher.per_node:
                await _gone(scheduler, names[node], RESTART_WAIT)  # the new workers take the same names
                if await launcher.restart_node(node):
                    restarts[node] += 1
                    entry["restarted"] = True
                    down.discard(node)
                    logger.info(f"node {node} ({hosts[node]}): its process started again ({restarts[node]} of "
                                f"{mpi.node_restarts} restarts), with the same workers and GPUs")
        if changed:
            last_count = len(scheduler.workers)
            record(workers=last_count, lost_nodes=lost)
        if watched and down.issuperset(watched):
            stop(f"stopping the run: no node is left ({', '.join(hosts[i] for i in sorted(down))} lost), "
                 "so nothing can run the remaining trials; not waiting for walltime")
            return


async def _gone(scheduler: Any, names: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(str(ws.name) in names for ws in scheduler.workers.values()):
        await asyncio.sleep(0.1)


class NodeWatch:
    """`watch_nodes` running beside COMMAND; when it says stop, COMMAND is ended (SIGTERM, then SIGKILL), so
    the run exits now, non-zero, and `stopped` says why."""

    def __init__(self) -> None:
        self.stopped: str | None = None
        self._tasks: list[asyncio.Future[Any]] = []

    def start(self, scheduler: Any, launcher: Launcher, layout_: Layout, record: Callable[..., None],
              proc: asyncio.subprocess.Process) -> NodeWatch:
        if launcher.nodes_watched:
            self._tasks.append(asyncio.ensure_future(watch_nodes(scheduler, launcher, layout_, record,
                                                                 lambda why: self._stop(why, proc))))
        return self

    def _stop(self, why: str, proc: asyncio.subprocess.Process) -> None:
        import signal

        from hpc_garage.launchers.common import end_process

        self.stopped = why
        logger.info(why)
        self._tasks.append(asyncio.ensure_future(end_process(proc, ((signal.SIGTERM, 30.0), (signal.SIGKILL, 5.0)))))

    def exit_code(self, code: int) -> int:
        """COMMAND's exit code, never 0 once the watch stopped the run."""
        return code or 1 if self.stopped else code

    def cancel(self) -> None:
        for task in self._tasks[:1]:  # the watch; an ending COMMAND is left to finish
            task.cancel()

    def job_ending(self, sig: int) -> None:
        """`run` got SIGTERM/SIGINT (scancel, the batch system's end): the batch system signals every node's
        step too, and a node process ending now is the job ending, not a lost node to name or restart."""
        self.cancel()
