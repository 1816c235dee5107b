"""What a trial longer than one job uses: a checkpoint directory that follows it from job to job, a stop it
can act on before its job ends, and the exception that says "saved, not done".

    from hpc_garage import trial

    @task(tags=hpc_garage.resources(gpu=1))
    def train(lr: float) -> float:
        ckpt = trial.checkpoint_dir() / "state.pt"
        state = load(ckpt) if ckpt.exists() else fresh(lr)
        while not state.done:
            step(state)
            if state.step % 100 == 0 or trial.should_stop():
                save(state, ckpt)
            if trial.should_stop():
                raise trial.Interrupted("checkpoint saved")
        return state.loss

Under `hpc-garage run` (a job, a follow-up, a resume, or `run` on a login node) the directory is
`<the epoch's results>/.checkpoints/<the trial's result key>`: the key Prefect caches the trial's result
under (task source + inputs + sweep epoch), so every job and attempt of the trial in the epoch finds it,
a trial whose source or inputs changed does not, and a fresh `submit` (a new epoch) starts clean. Outside
hpc-garage (plain `python sweep.py`) it is `./.hpc-garage-checkpoints/<task source + inputs>` and
`should_stop()` is always False: the same code runs unchanged.

An interrupted trial ends in Prefect's **Crashed** state ("Execution was interrupted ... Interrupted: ..."):
Prefect's own state for a run its infrastructure stopped, neither Failed nor Completed. Its result is not
cached and Prefect does not retry it; the follow-up job (the site's `requeue: auto`) or `hpc-garage resume`
runs it again, from its checkpoint. `Interrupted` derives from BaseException, as KeyboardInterrupt does, so
an `except Exception:` in the trial does not swallow it.

Imports nothing heavy: should_stop() is one flag test.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from hpc_garage.cluster import stopping
from hpc_garage.cluster.stopping import CHECKPOINTS_DIR
from hpc_garage.variables import RESULTS_ENV, SWEEP_ENV

__all__ = ["Interrupted", "checkpoint_dir", "on_stop", "should_stop", "stop_reason"]

LOCAL_DIR = ".hpc-garage-checkpoints"  # outside hpc-garage: under the current directory


class Interrupted(BaseException):
    """Raised by a trial that saved its checkpoint and is not done: recorded as interrupted (Prefect's
    Crashed), not failed and not finished; its result is not cached, and it is continued from the checkpoint."""


def should_stop() -> bool:
    """True once this trial's job is winding down (walltime margin, the site's warning_signal, a preemption
    notice): save a checkpoint and raise Interrupted within the site's `checkpoint_grace`. False outside
    hpc-garage."""
    return stopping.any_stop() and stopping.reason(_run_id()) is not None


def stop_reason() -> str | None:
    """Why this trial should stop (e.g. "walltime: 30 s left"), or None."""
    return stopping.reason(_run_id()) if stopping.any_stop() else None


def on_stop(callback: Callable[[str], None]) -> None:
    """Call `callback(reason)` once when this process is told to stop, from the worker's event loop: keep it
    short (set a flag, signal a training loop); the checkpoint is saved by the trial's own thread."""
    stopping.on_stop(callback)


def checkpoint_dir() -> Path:
    """This trial's checkpoint directory (created): the same in every job and attempt of the trial within
    the sweep's epoch, on the sweep's results storage; a local directory outside hpc-garage."""
    from hpc_garage.prefect.sweep_cache import task_context, trial_key

    ctx = task_context()
    sweep, results = os.environ.get(SWEEP_ENV), os.environ.get(RESULTS_ENV)
    key = trial_key(ctx, sweep or "") if ctx is not None else None
    if sweep and results and key:
        run_id = ctx.task_run.id.hex
        if (known := stopping.trial(run_id)) is not None:
            known["asked"] = True
        path = Path(results) / CHECKPOINTS_DIR / key
    else:
        path = Path.cwd() / LOCAL_DIR / (key or "default")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def _run_id() -> str | None:
    """The current Prefect task run's id (hex); asked only once a stop is known."""
    try:
        from hpc_garage.prefect.sweep_cache import task_context
    except ImportError:  # no Prefect here
        return None
    ctx = task_context()
    return ctx.task_run.id.hex if ctx is not None else None
