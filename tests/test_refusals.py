"""A UserError that ends a flow's process (hpc_garage/prefect/refusals.py): one line, exit 2, no traceback,
whether it reaches the top of the script or passes through Prefect's engine; every other error as before.

Each case runs in a process of its own: the hooks are process-wide. The stale scheduler file itself, under
`python sweep.py`, `hpc-garage run` and a deployment's job, is in test_errors.py and test_work_pool.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hpc_garage.core.errors import UserError
from hpc_garage.prefect import refusals

PY = sys.executable
HOOKED = "from hpc_garage.prefect import refusals\nrefusals.install()\n"


def _python(code: str, tmp_path: Path, hooked: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
    """The script `code` in a fresh process; `hooked`: refusals.install() first (task_runner() does that)."""
    script = tmp_path / "script.py"
    script.write_text((HOOKED if hooked else "") + textwrap.dedent(code))
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("HPC_GARAGE_", "SLURM_", "PBS_"))}
    return subprocess.run([PY, str(script)], env=environment | {"HOME": str(tmp_path), **env}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)


def test_the_user_error_is_found_through_the_causes_prefect_adds_and_not_through_a_later_error() -> None:
    refusal = UserError("scheduler file x is stale")
    try:
        raise RuntimeError("Script at 'sweep.py' encountered an exception") from refusal  # Prefect's ScriptError
    except RuntimeError as wrapped:
        assert refusals.user_error(wrapped) is refusal
    try:
        try:
            raise refusal
        except UserError:
            raise KeyError("a bug while handling it")  # noqa: B904 - its context, not its cause
    except KeyError as bug:
        assert refusals.user_error(bug) is None  # a bug is not dressed as the user's mistake
    assert refusals.user_error(None) is None and refusals.user_error(ValueError("x")) is None


def test_a_refusal_at_the_top_of_a_script_is_one_line_and_exit_2(tmp_path: Path) -> None:
    done = _python("from hpc_garage.core.errors import UserError\nraise UserError('bad  value\\n given')\n",
                   tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == ["hpc-garage: error: bad value given"]


def test_any_other_error_keeps_its_traceback_and_exit_1(tmp_path: Path) -> None:
    done = _python("raise ValueError('a bug')\n", tmp_path)
    assert done.returncode == 1
    assert "Traceback (most recent call last)" in done.stderr and "ValueError: a bug" in done.stderr


def test_prefects_engine_records_of_a_refusal_are_dropped_and_the_refusal_kept_for_the_one_line(
        tmp_path: Path) -> None:
    """Prefect's engine logs an error that escapes a flow on these loggers, with its traceback, before it
    exits 1 (or re-raises it): those records of a refusal go; others stay, as do records on other loggers."""
    done = _python("""
        import logging, sys
        from hpc_garage.core.errors import UserError
        logging.basicConfig(stream=sys.stdout, format="%(name)s: %(message)s")
        refusal = UserError("stale")
        for name in refusals.ENGINE_LOGGERS:
            try:
                try:
                    raise refusal
                except UserError as exc:
                    raise RuntimeError("wrapped") from exc
            except RuntimeError:
                logging.getLogger(name).error("Unexpected exception", exc_info=True)
            try:
                raise ValueError("a bug")
            except ValueError:
                logging.getLogger(name).error("kept", exc_info=True)
        try:
            raise refusal
        except UserError:
            logging.getLogger("elsewhere").error("kept too", exc_info=True)
        assert refusals.pending() is refusal
        print("pending:", refusals.pending())
        """, tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "Unexpected exception" not in out
    assert [line for line in out.splitlines() if ": kept" in line] == \
        [f"{name}: kept" for name in refusals.ENGINE_LOGGERS] + ["elsewhere: kept too"]
    assert out.count("ValueError: a bug") == len(refusals.ENGINE_LOGGERS) and "pending: stale" in out


@pytest.mark.slow
def test_a_refusal_inside_the_flow_through_prefects_engine_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """`python sweep.py` whose flow meets a refusal once it runs (a task asks for GPUs no worker has): Prefect's
    engine logs it with its traceback and raises it out of the flow call; the user sees the one line."""
    done = _python("""
        from prefect import flow, task
        import hpc_garage

        @task(tags=hpc_garage.resources(gpu=8))
        def square(x):
            return x * x

        @flow(task_runner=hpc_garage.task_runner(cluster_kwargs={"dashboard_address": None}))
        def sweep():
            return sum(f.result() for f in square.map(range(2)))

        if __name__ == "__main__":
            sweep()
        """, tmp_path, hooked=False, HPC_GARAGE_SITE="local")
    try:
        assert done.returncode == 2, done.stderr[-3000:]
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        ours = [line for line in done.stderr.splitlines() if line.startswith("hpc-garage: error:")]
        assert len(ours) == 1 and "task 'square' asks for GPU=8 but no worker" in ours[0], done.stderr[-3000:]
    finally:
        subprocess.run([PY, "-m", "hpc_garage", "server", "stop", "--force"], env={**os.environ, "HOME": str(tmp_path)},
                       capture_output=True, timeout=120)
