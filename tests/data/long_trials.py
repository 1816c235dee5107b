"""A sweep of GPU trials longer than a job (tests/test_long_trials.py, docs/how-to/long-sweeps.md).

Each trial "trains" for --duration seconds of work in 1-s steps. With --every N it saves its step to
`hpc_garage.trial.checkpoint_dir()` every N steps, resumes from it, and on `should_stop()` saves, notes
`stopped-<i>-<pid>` in --marks (the step saved, the reason) and raises `Interrupted`; with --every 0 it never
checkpoints (and never calls the API). Every attempt keeps `work-<i>-<pid>-<ns>` in --marks up to date with
the seconds it worked and the step it started from, so a test counts the work each trial did in all; the
flow writes its result to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from prefect import flow, task, unmapped

import hpc_garage
from hpc_garage import trial


@task(tags=hpc_garage.resources(gpu=1))
def train(i: int, duration: float, every: int, marks: str) -> int:
    ckpt = trial.checkpoint_dir() / "step.json" if every else None
    step = json.loads(ckpt.read_text())["step"] if ckpt is not None and ckpt.exists() else 0
    mark = Path(marks, f"work-{i}-{os.getpid()}-{time.time_ns()}")
    began, first = time.monotonic(), step
    while step < duration:
        time.sleep(1.0)
        step += 1
        written = mark.with_name(f".{mark.name}.tmp")  # renamed whole: a reader never sees half a record
        written.write_text(json.dumps({"worked": round(time.monotonic() - began, 1), "from": first, "step": step}))
        written.replace(mark)
        if ckpt is not None and (step % every == 0 or trial.should_stop()):
            ckpt.with_suffix(".tmp").write_text(json.dumps({"step": step}))
            ckpt.with_suffix(".tmp").replace(ckpt)
            if trial.should_stop() and step < duration:
                Path(marks, f"stopped-{i}-{os.getpid()}").write_text(json.dumps({"step": step,
                                                                                "why": trial.stop_reason()}))
                raise trial.Interrupted(f"checkpoint saved at step {step}")
    return i * i


@flow(task_runner=hpc_garage.task_runner())
def long_sweep(trials: int, duration: float, every: int, marks: str, out: str) -> int:
    futures = train.map(range(trials), duration=unmapped(duration), every=unmapped(every), marks=unmapped(marks))
    result = sum(f.result() for f in futures)
    Path(out).write_text(json.dumps({"result": result}))
    print(f"long_trials: result {result}")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--duration", type=float, default=150.0)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--marks", required=True)
    parser.add_argument("--out", required=True)
    a = parser.parse_args()
    Path(a.marks).mkdir(parents=True, exist_ok=True)
    result = long_sweep(a.trials, a.duration, a.every, a.marks, a.out)
    raise SystemExit(0 if result == sum(i * i for i in range(a.trials)) else 1)
