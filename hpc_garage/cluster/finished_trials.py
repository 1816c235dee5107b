"""A run's finished trials as the scheduler records them for the report, in memory bounded by the work in flight.

Why. The report (cluster/report.py) needs every trial's worker and compute span, but the scheduler must not
hold a record per finished trial while the sweep runs (issue 32: at 100,000 trials they were its only growth).
`FinishedTrials` keeps the latest RECENT records in memory, where a worker's late GPU figures or a lost
worker's recomputation still find them, and writes older ones to an unnamed file of its own (a JSON line each,
gone when the scheduler ends); the count, failed and interrupted trials are counted as records come and go.
`records()` reads them all back, once, for the report at the run's end.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

__all__ = ["FinishedTrials", "RECENT", "TrialRecord"]

RECENT = 4096  # records kept in memory: ~1 MB, and several times the trials a scheduler has in flight at once
READ_BYTES = 1 << 16  # the file is read back this much at a time


@dataclass(slots=True)
class TrialRecord:
    """One finished trial (small, slots, no per-trial dicts)."""
    key: str
    worker: str
    start: float
    stop: float
    failed: bool
    asked_gpu: bool
    interrupted: bool = False  # it raised hpc_garage.trial.Interrupted: saved, not done (not failed)
    gpu: dict[str, Any] | None = None  # what the worker's sampler measured on its GPUs (gpu_* figures)

    def sampled(self, msg: dict[str, Any]) -> None:
        """Take what the worker's sampler said: its own timing, a Prefect Failed state, the GPU figures."""
        if "stop" in msg:
            self.start, self.stop = float(msg["start"]), float(msg["stop"])
        self.failed = self.failed or bool(msg.get("failed"))
        self.gpu = {k: v for k, v in msg.items() if k.startswith("gpu")} or None

    def as_dict(self) -> dict[str, Any]:
        """As the report reads a trial (cluster/report.py build)."""
        return {"key": self.key, "worker": self.worker, "start": self.start, "stop": self.stop, "failed": self.failed,
                "asked_gpu": self.asked_gpu, **({"interrupted": True} if self.interrupted else {}), **(self.gpu or {})}

    def row(self) -> list[Any]:
        return [self.key, self.worker, self.start, self.stop, self.failed, self.asked_gpu, self.interrupted, self.gpu]


class FinishedTrials:
    """The finished trials (see the module docstring); `spool_dir`: where the unnamed file lives (the run
    directory: on the job's file system, not a node's small /tmp), else the system's temporary directory."""

    def __init__(self, spool_dir: Path | None = None, recent: int = RECENT) -> None:
        self._recent: OrderedDict[str, TrialRecord] = OrderedDict()
        self._limit = recent
        self._spool_dir = spool_dir
        self._spool: IO[bytes] | None = None
        self.count = self.failed = self.interrupted = 0

    def __len__(self) -> int:
        return self.count

    def __contains__(self, key: str) -> bool:
        """Finished lately (a record written out long ago is not looked for)."""
        return key in self._recent

    def get(self, key: str) -> TrialRecord | None:
        return self._recent.get(key)

    def add(self, record: TrialRecord) -> None:
        """A trial finished; one computed again while its first record is still in memory replaces it."""
        if (old := self._recent.pop(record.key, None)) is not None:
            self._count(old, -1)
        self._recent[record.key] = record
        self._count(record, 1)
        if len(self._recent) > self._limit:
            self._write(self._recent.popitem(last=False)[1])

    def update(self, record: TrialRecord, msg: dict[str, Any]) -> None:
        """A recent record takes what its worker's sampler said, its counts with it."""
        self._count(record, -1)
        record.sampled(msg)
        self._count(record, 1)

    def latest(self, n: int) -> list[str]:
        """The keys of the `n` trials that finished last, the last first."""
        keys = []
        for key in reversed(self._recent):
            if len(keys) == n:
                break
            keys.append(key)
        return keys

    def records(self) -> Iterator[TrialRecord]:
        """Every record, those written out first (in the order they finished), then the recent ones. Each walk
        reads the file at its own offset (pread): walks may interleave, and records may be added meanwhile."""
        if self._spool is not None:
            self._spool.flush()
            fd, offset, rest = self._spool.fileno(), 0, b""
            while chunk := os.pread(fd, READ_BYTES, offset):
                offset += len(chunk)
                *lines, rest = (rest + chunk).split(b"\n")
                for line in lines:
                    yield TrialRecord(*json.loads(line))
        yield from list(self._recent.values())

    def close(self) -> None:
        if self._spool is not None:
            self._spool.close()
            self._spool = None

    def _count(self, record: TrialRecord, sign: int) -> None:
        self.count += sign
        self.failed += sign * record.failed
        self.interrupted += sign * record.interrupted

    def _write(self, record: TrialRecord) -> None:
        if self._spool is None:
            self._spool = tempfile.TemporaryFile("w+b", prefix=".hpc-garage-trials-", dir=self._spool_dir)
        self._spool.write(json.dumps(record.row(), separators=(",", ":")).encode() + b"\n")
