"""A worker preload for tests (HPC_GARAGE_WORKER_PRELOAD=...,fake_gpu_reader, tests/data on PYTHONPATH): every
worker forked after it reads its GPUs through FakeReader, fixed figures per GPU id, as if NVML were there.

This machine has no GPU, so NVML cannot be read; the forkserver imports this module before it forks the
workers, so their `launchers.gpu_sampler.open_reader` is this one and the rest of the path (the sampler's
events, the report, the Prefect artifacts) is the real one."""

from __future__ import annotations

from hpc_garage.launchers import gpu_sampler


def figures(gpu: str) -> tuple[float, float]:
    """(utilisation %, device memory bytes) this reader gives GPU `gpu`: different for every GPU id."""
    return 40.0 + 10 * int(gpu), (1 + int(gpu)) * 2.0**30


class FakeReader:
    def __init__(self, ids: list[str]) -> None:
        self.ids = ids

    def sample(self) -> list[tuple[float | None, float | None]]:
        return [figures(i) for i in self.ids]

    def close(self) -> None:
        pass


def open_reader(vendor: str, ids: list[str]) -> FakeReader | None:
    return FakeReader(ids) if ids else None


gpu_sampler.open_reader = open_reader
