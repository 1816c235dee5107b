"""A worker binds itself to its cores, first thing in its own process.

A Nanny forks its worker from the node's forkserver, so the Nanny cannot set the child's affinity: the child
does, from the `HPC_GARAGE_CPUS` its Nanny put in its environment (`core.layout.bind_node` chose them). The
worker class below binds in its constructor, before distributed starts any thread of the worker: every
thread it starts later (the task threads, the event loop's helpers) inherits the binding.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from distributed import Worker

from hpc_garage.core.gpus import parse_cpulist
from hpc_garage.variables import CPUS_ENV


def bind_self(env: Mapping[str, str] | None = None) -> frozenset[int] | None:
    """Bind every thread of this process to $HPC_GARAGE_CPUS; the CPUs, or None where it is unset."""
    env = os.environ if env is None else env
    text = env.get(CPUS_ENV, "").strip()
    if not text:
        return None
    cpus = parse_cpulist(text)
    threads = {int(t) for t in os.listdir("/proc/self/task")} if os.path.isdir("/proc/self/task") else {0}
    for tid in sorted(threads):  # normally only this one; any other started before now is bound too
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            pass  # a thread that has ended since
    return cpus


class BoundWorker(Worker):
    """A distributed Worker that first binds its process to its cores (`bind_self`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bind_self()
        super().__init__(*args, **kwargs)
