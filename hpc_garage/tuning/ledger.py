"""When a search stops asking: its trial count, its GPU-hour budget, its failures, or the job's wind-down.

Pure: the clock and the job's end are given. GPU-seconds are each trial's wall time on its worker times the GPUs
its task asks for (1 for a task that asks none: a worker's time), kept in the study (its user attribute
GPU_SECONDS, and each trial's), so that a resumed search goes on counting from where the last job stopped.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

GPU_SECONDS = "hpc_garage_gpu_seconds"  # an Optuna trial's user attribute: the GPU-seconds it ran, all jobs
TRIALS, BUDGET, FAILURES, WALLTIME, INTERRUPTED = "trials", "budget", "failures", "walltime", "interrupted"


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.3g} GPUh"


@dataclass
class Ledger:
    """What the search spent and saw; `stop_reason` says whether it may ask another trial."""

    trials: int  # at most this many trials in the study
    budget: float | None  # GPU-seconds, or None
    max_failures: int
    used: float = 0.0  # GPU-seconds of the trials ended (and of interrupted ones, up to their interruption)
    asked: int = 0  # trials in the study (asked in this job or an earlier one)
    failures: int = 0
    last_failure: str = ""
    first_reports: list[float] = field(default_factory=list)  # s from a trial's start to its first report (or end)
    durations: list[float] = field(default_factory=list)  # s each trial ran, start to end
    stopped: str | None = None  # the one-line reason the search stopped asking, once it did

    def running(self, in_flight: list[tuple[float, float]], now: float) -> float:
        """GPU-seconds of the trials in flight so far: (started, gpus) each."""
        return sum(max(0.0, now - started) * gpus for started, gpus in in_flight)

    def stop_reason(self, now: float, in_flight: list[tuple[float, float]],
                    winds_down_at: float | None) -> str | None:
        """Why no further trial is asked now (it stays so once said), or None: ask."""
        if self.stopped is None:
            self.stopped = self._why(now, in_flight, winds_down_at)
        return self.stopped

    def _why(self, now: float, in_flight: list[tuple[float, float]], winds_down_at: float | None) -> str | None:
        if self.failures >= self.max_failures:
            return (f"{FAILURES}: {self.failures} trials failed (max_failures={self.max_failures}); the last: "
                    f"{self.last_failure}")
        if self.budget is not None and self.used + self.running(in_flight, now) >= self.budget:
            return f"{BUDGET}: {hours(self.used + self.running(in_flight, now))} of {hours(self.budget)} used"
        if self.asked >= self.trials:
            return f"{TRIALS}: all {self.trials} trials asked"
        if winds_down_at is not None and (first := self.first_report()) is not None and now + first > winds_down_at:
            return (f"{WALLTIME}: a trial takes {first:.0f} s to its first report, and the job winds down in "
                    f"{max(0.0, winds_down_at - now):.0f} s; the next job continues the search")
        return None

    def may_queue(self, now: float, winds_down_at: float | None) -> bool:
        """Whether a trial may wait in Dask's queue for the next worker that frees: it starts up to a trial's
        duration from now, so it must still reach its first report before the wind-down from then."""
        if winds_down_at is None:
            return True
        if not self.durations or (first := self.first_report()) is None:
            return False
        return now + statistics.median(self.durations) + first <= winds_down_at

    def first_report(self) -> float | None:
        """How long a trial takes to report first (or end), judged from the trials seen so far: the median."""
        return statistics.median(self.first_reports) if self.first_reports else None

    def failed(self, why: str) -> None:
        self.failures += 1
        self.last_failure = " ".join(why.split())[:200]
