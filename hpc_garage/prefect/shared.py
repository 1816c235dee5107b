"""Bytes that every task of a flow run carries, sent to each worker once instead of with every task.

Why. Each Prefect task on the fast path carried ~13 KB: the flow run context (6.3 KB pickled), Prefect's
settings (4.3 KB) and the task itself (1.8 KB), for a trial whose own arguments are a few bytes. Dask's
scheduler unpickles every task it is sent and pickles it again for its worker, and all of it crosses TLS
twice: at 3,000 trivial trials, 23 % of the scheduler's busy samples were in `SSLSocket.send` and 17 % in
(un)pickling those task specs (py-spy, bench/scale_flow.py under `hpc-garage run --site local`).

How. The flow side publishes each distinct blob once, under its content hash, in the scheduler's metadata
(`Client.set_metadata`), and the task carries a `Shared` reference of a few dozen bytes. A worker fetches a
blob from the scheduler the first time one of its tasks names it, keeps the last few, and unpickles a fresh
value for every task, as before: no task sees another's objects. The scheduler leaves a reference as it is
(it unpickles as itself). A runner drops its blobs at its exit; a new scheduler (a follow-up job) gets its
own, since publishing is per client.
"""

from __future__ import annotations

import hashlib
import pickle
import threading
import uuid
from collections import OrderedDict
from typing import Any

ROOT = "hpc-garage-shared"  # the scheduler's metadata key all published blobs live under
MAX_TASKS = 64  # task objects a Publisher remembers (a sweep has a few; a task per trial is never shared)
KEEP_ON_WORKER = 32  # blobs a worker process keeps (a flow run needs 2-3; several flows may share a worker)

_cache: OrderedDict[str, bytes] = OrderedDict()
_lock = threading.Lock()
_fetching = threading.Lock()  # one fetch from the scheduler at a time per process
_fetched = [0]  # blobs this process fetched from a scheduler (tests: once per blob, not per task)


class Shared:
    """A reference to a published blob: pickles (and, on the scheduler, unpickles) as itself."""

    __slots__ = ("space", "digest")

    def __init__(self, space: str, digest: str) -> None:
        self.space, self.digest = space, digest

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return Shared, (self.space, self.digest)

    def __repr__(self) -> str:
        return f"Shared({self.digest[:12]})"


class Publisher:
    """The flow side: publishes each distinct blob once to this client's scheduler, under a namespace of its
    own (dropped by `close`)."""

    def __init__(self, client: Any) -> None:
        self.client, self.space = client, uuid.uuid4().hex
        self._published: set[str] = set()
        self._tasks: dict[int, tuple[Any, Shared | None]] = {}  # id -> (task, its reference once shared)

    def share(self, data: bytes) -> Shared:
        digest = hashlib.blake2b(data, digest_size=16).hexdigest()
        if digest not in self._published:
            self.client.set_metadata([ROOT, self.space, digest], data)
            self._published.add(digest)
        return Shared(self.space, digest)

    def task(self, task: Any) -> Any:
        """The task itself at its first submission; from its second on, a Shared reference (a task made per
        trial with `with_options` is sent as it is, and publishes nothing)."""
        import cloudpickle

        seen = self._tasks.get(id(task))
        if seen is None or seen[0] is not task:
            if len(self._tasks) >= MAX_TASKS:
                self._tasks.pop(next(iter(self._tasks)))
            self._tasks[id(task)] = (task, None)
            return task
        if seen[1] is None:
            seen = self._tasks[id(task)] = (task, self.share(cloudpickle.dumps(task)))
        return seen[1]

    def close(self) -> None:
        """Drop this publisher's blobs from the scheduler (its tasks are over); best effort."""
        if self._published:
            self._published.clear()
            try:
                self.client.set_metadata([ROOT, self.space], {})
            except Exception:  # noqa: BLE001 - the cluster may be gone already: nothing to free then
                pass


class Pickled:
    """Without a publisher: a value pickled once and sent as those bytes with every task (cloudpickle: the
    flow may live in __main__); it unpickles as the value itself."""

    __slots__ = ("data",)

    def __init__(self, value: Any) -> None:
        import cloudpickle

        self.data = cloudpickle.dumps(value)

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return pickle.loads, (self.data,)


def value(item: Any) -> Any:
    """`item` itself, or a fresh copy of the value a `Shared` reference names (on a Dask worker)."""
    return pickle.loads(fetch(item)) if isinstance(item, Shared) else item


def fetch(ref: Shared) -> bytes:
    """The blob `ref` names: from this process's cache, else from the scheduler of the worker running us
    (once per blob: a worker's other threads wait for that fetch rather than repeat it)."""
    with _lock:
        data = _cache.get(ref.digest)
        if data is not None:
            _cache.move_to_end(ref.digest)
            return data
    with _fetching:
        with _lock:
            if (data := _cache.get(ref.digest)) is not None:
                return data
        from distributed import get_worker
        from distributed.utils import sync

        worker = get_worker()
        data = sync(worker.loop, worker.scheduler.get_metadata, keys=[ROOT, ref.space, ref.digest], default=None)
        if not isinstance(data, bytes):
            raise RuntimeError(f"hpc-garage: the scheduler at {worker.scheduler.address} no longer holds the "
                               f"flow's shared task data {ref.digest} (its task runner has exited)")
        with _lock:
            _fetched[0] += 1
            _cache[ref.digest] = data
            while len(_cache) > KEEP_ON_WORKER:
                _cache.popitem(last=False)
        return data


def fetched() -> int:
    """How many blobs this process has fetched from a scheduler."""
    return _fetched[0]
