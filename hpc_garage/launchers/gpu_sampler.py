"""In every worker: each trial's own span, what it did to its GPUs, and whether a Prefect trial failed.

The scheduler knows when a task ran, but shifted by Dask's per-heartbeat estimate of each worker's clock
offset (seen moving consecutive trials into each other), and not what the GPU did meanwhile, nor that a
Prefect task "succeeded" as a Dask task while returning a Failed state. `TrialSampler` is a WorkerPlugin
that `cluster/progress.py` registers on the scheduler, so every worker of every launcher gets it as it
registers (own launcher, dask-mpi ranks, jobqueue worker jobs alike). While a task executes it samples the
worker's own GPUs (the ids its pinning variable lists) every SAMPLE_SECONDS through NVML (`nvidia-ml-py`)
or `amdsmi`; when the task ends it logs one event under TOPIC: the key, its start and stop on this worker's
clock, the GPU figures, and `failed` for a Prefect Failed/Crashed state (the scheduler adds the worker's
address as "worker"). At start it logs its GPU ids. A worker without the library or without a GPU samples
nothing: no GPU columns, no error.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from distributed.diagnostics.plugin import WorkerPlugin

TOPIC = "hpc-garage-trial"
NAME = "hpc-garage-trial-sampler"
SAMPLE_SECONDS = 0.5
FAILED_STATES = ("FAILED", "CRASHED")  # Prefect's StateType values of a trial that did not succeed


class GpuReader(Protocol):
    def sample(self) -> list[tuple[float | None, float | None]]:
        """(utilisation %, device memory used in bytes) of each of the worker's GPUs; None where unreadable."""

    def close(self) -> None: ...


class NvmlReader:
    """NVML (nvidia-ml-py's `pynvml`): a worker's GPUs by CUDA_VISIBLE_DEVICES entry (index or UUID)."""

    def __init__(self, ids: list[str]) -> None:
        import pynvml

        self.nvml = pynvml
        pynvml.nvmlInit()
        try:
            self.handles = [pynvml.nvmlDeviceGetHandleByUUID(i) if i.startswith(("GPU-", "MIG-"))
                            else pynvml.nvmlDeviceGetHandleByIndex(int(i)) for i in ids]
        except Exception:
            pynvml.nvmlShutdown()
            raise

    def sample(self) -> list[tuple[float | None, float | None]]:
        return [(_or_none(lambda: float(self.nvml.nvmlDeviceGetUtilizationRates(h).gpu)),
                 _or_none(lambda: float(self.nvml.nvmlDeviceGetMemoryInfo(h).used))) for h in self.handles]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.nvml.nvmlShutdown()


class AmdsmiReader:
    """ROCm's `amdsmi`: a worker's GPUs by ROCR_VISIBLE_DEVICES index."""

    def __init__(self, ids: list[str]) -> None:
        import amdsmi

        self.amdsmi = amdsmi
        amdsmi.amdsmi_init()
        try:
            handles = amdsmi.amdsmi_get_processor_handles()
            self.handles = [handles[int(i)] for i in ids]
        except Exception:
            amdsmi.amdsmi_shut_down()
            raise

    def sample(self) -> list[tuple[float | None, float | None]]:
        a = self.amdsmi
        return [(_or_none(lambda: float(a.amdsmi_get_gpu_activity(h)["gfx_activity"])),
                 _or_none(lambda: float(a.amdsmi_get_gpu_vram_usage(h)["vram_used"]) * 2**20)) for h in self.handles]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.amdsmi.amdsmi_shut_down()


def _or_none(read: Any) -> float | None:
    try:
        return read()
    except Exception:  # noqa: BLE001 - a figure the device does not give (MIG utilisation, a lost GPU)
        return None


def open_reader(vendor: str, ids: list[str]) -> GpuReader | None:
    """A reader for these GPUs, or None where the vendor's library or the GPUs cannot be read here."""
    if not ids:
        return None
    readers = {"nvidia": NvmlReader, "amd": AmdsmiReader}
    try:
        return readers[vendor](ids) if vendor in readers else None
    except Exception:  # noqa: BLE001 - library absent (ImportError), no driver, no such device: no GPU columns
        return None


def worker_gpus(vendor: str, env: Any = None) -> list[str]:
    """This worker's GPU ids as its pinning variable lists them ([] when none, or unreadable)."""
    from hpc_garage.core.gpus import job_gpus

    try:
        return list(job_gpus(vendor, os.environ if env is None else env).ids)
    except Exception:  # noqa: BLE001 - a malformed list was refused before the workers started
        return []


@dataclass
class TrialFigures:
    """One executing task's GPU samples, per GPU of its worker."""

    start: float = 0.0  # this worker's clock (time.time()): Dask's startstops are shifted by a per-heartbeat
    #                     estimate of the clock offset to the scheduler, which moved trials into each other here
    util_sum: list[float] = field(default_factory=list)
    util_peak: list[float] = field(default_factory=list)
    memory_peak: list[float] = field(default_factory=list)
    samples: int = 0

    def add(self, sample: list[tuple[float | None, float | None]]) -> None:
        if not self.util_sum:
            n = len(sample)
            self.util_sum, self.util_peak, self.memory_peak = [0.0] * n, [0.0] * n, [0.0] * n
        for i, (util, memory) in enumerate(sample):
            self.util_sum[i] += util or 0.0
            self.util_peak[i] = max(self.util_peak[i], util or 0.0)
            self.memory_peak[i] = max(self.memory_peak[i], memory or 0.0)
        self.samples += 1

    def to_dict(self) -> dict[str, Any]:
        """Mean and peak utilisation (%) and peak device memory (bytes), over the trial's GPUs."""
        n = max(self.samples, 1)
        return {"gpu_util_mean": round(sum(self.util_sum) / n / len(self.util_sum), 1),
                "gpu_util_peak": max(self.util_peak), "gpu_memory_peak": max(self.memory_peak),
                "gpu_samples": self.samples}


class TrialSampler(WorkerPlugin):
    """See the module docstring. Pickled on the scheduler, set up in each worker."""

    name = NAME
    idempotent = True

    def __init__(self, vendor: str = "nvidia", period: float = SAMPLE_SECONDS) -> None:
        self.vendor = vendor
        self.period = period
        self.worker: Any = None
        self.gpus: list[str] = []
        self.reader: GpuReader | None = None
        self.running: dict[str, TrialFigures] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"vendor": self.vendor, "period": self.period}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def setup(self, worker: Any) -> None:
        self.worker = worker
        self.gpus = worker_gpus(self.vendor)
        self.reader = open_reader(self.vendor, self.gpus)
        if self.gpus:  # the report names GPUs by these ids (sent once the worker's stream opens)
            worker.log_event(TOPIC, {"gpus": self.gpus})
        if self.reader is not None:
            self.thread = threading.Thread(target=self._sample_loop, name=NAME, daemon=True)
            self.thread.start()

    def teardown(self, worker: Any) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(2 * self.period)
        if self.reader is not None:
            self.reader.close()

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if finish == "executing":
            with self.lock:
                self.running[str(key)] = TrialFigures(start=time.time())
        elif start in ("executing", "long-running") and finish != "long-running":
            stop = time.time()
            with self.lock:
                figures = self.running.pop(str(key), None)
            if figures is None:
                return
            event: dict[str, Any] = {"key": str(key), "start": figures.start, "stop": stop}
            if self.reader is not None:
                if not figures.samples:  # shorter than one period: read once now
                    figures.add(self.reader.sample())
                with self.lock:
                    event |= figures.to_dict()
            if finish == "memory" and self._failed_state(key):
                event["failed"] = True
            self.worker.log_event(TOPIC, event)

    def _failed_state(self, key: Any) -> bool:
        """The task returned a Prefect Failed or Crashed state (duck-typed: no Prefect import here)."""
        data = self.worker.data
        held = getattr(data, "fast", data)  # a SpillBuffer's in-memory part: never unspill to look
        try:
            value = held[key] if key in held else None
        except Exception:  # noqa: BLE001
            return False
        kind = getattr(getattr(value, "type", None), "value", None)
        return callable(getattr(value, "is_failed", None)) and kind in FAILED_STATES

    def _sample_loop(self) -> None:
        while not self.stop.wait(self.period):
            with self.lock:
                trials = list(self.running.values())
            if not trials or self.reader is None:
                continue
            sample = self.reader.sample()
            with self.lock:
                for figures in trials:
                    figures.add(sample)
