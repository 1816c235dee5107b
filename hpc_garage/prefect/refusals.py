"""A UserError that ends a flow's process: one line on stderr and exit 2, however the flow was started.

hpc-garage's CLI says a refusal in one line (cli/__init__.py), but a flow is the user's own script: `python
sweep.py` raises a refusal of `task_runner()` (a stale scheduler file: the job that wrote it has ended) at
the top of the script, when the flow is decorated, or out of the flow call; Prefect's engine (a deployment's
job: `python -m hpc_garage.prefect.flow_run`) catches it and logs it with its traceback, twice, before it
exits 1. `install()` (the task runner's first step, and flow_run.py's) adds two hooks scoped to UserError,
everything else left as it was: `sys.excepthook` prints the line and exits 2; a filter on Prefect's engine
loggers drops their records of it and keeps it for whoever ends the process (`pending()`).

`refuse_unguarded_flow_call()`: the refusal the runner makes before any worker starts, of a flow called at a
script's top level (Dask's spawned workers re-import the script and would run it again).
"""

from __future__ import annotations

import ast
import logging
import os
import sys
from pathlib import Path
from types import TracebackType

from hpc_garage.core.errors import UserError

__all__ = ["install", "line", "pending", "refuse_unguarded_flow_call", "user_error"]

# where Prefect's engine logs an exception that escapes loading or running a flow (with its traceback)
ENGINE_LOGGERS = ("prefect.engine", "prefect.flow_runs")

_pending: list[UserError] = []  # refusals whose Prefect log records were dropped: not yet said


def line(error: UserError) -> str:
    """The one line, as the CLI says it."""
    return f"hpc-garage: error: {error}"


def user_error(exc: BaseException | None) -> UserError | None:
    """The UserError an exception is, or was raised from (Prefect wraps a script's error in its ScriptError)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, UserError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__
    return None


def pending() -> UserError | None:
    """The latest refusal Prefect's engine met and did not show; it is said by whoever ends the process."""
    return _pending[-1] if _pending else None


class _DropRefusals(logging.Filter):
    """Prefect's record of a UserError (its traceback) is dropped; the error is kept for the one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = user_error(record.exc_info[1]) if record.exc_info else None
        if error is None:
            return True
        if all(error is not seen for seen in _pending):
            _pending.append(error)
        return False


_FILTER = _DropRefusals()


def _excepthook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    error = user_error(exc)
    if error is None:
        _previous(kind, exc, tb)
        return
    print(line(error), file=sys.stderr, flush=True)
    raise SystemExit(error.exit_code)  # from an excepthook: the process's exit status


_previous = sys.excepthook
_installed = False


def install() -> None:
    """Both hooks, once per process."""
    global _previous, _installed
    if not _installed:
        _previous, sys.excepthook, _installed = sys.excepthook, _excepthook, True
    for name in ENGINE_LOGGERS:
        logging.getLogger(name).addFilter(_FILTER)  # a filter already there is not added again


def refuse_unguarded_flow_call() -> None:
    """Dask's spawned workers re-import the script: a top-level flow call would run again in each of them
    (seen as "Nanny failed to start"). Refuse before any worker starts, naming the line."""
    import dask

    if dask.config.get("distributed.worker.multiprocessing-method", "spawn") == "fork":
        return
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not os.path.isfile(path):
        return  # python -c, a notebook, an interactive session: nothing gets re-imported
    frame = sys._getframe()
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None:
        return  # the flow was not called from the script's top level (a thread, a test runner)
    lineno = frame.f_lineno
    try:
        tree = ast.parse(Path(path).read_text(), path)
    except (OSError, SyntaxError):
        return
    if any(_is_main_guard(node) and node.body[0].lineno <= lineno <= (node.body[-1].end_lineno or lineno)
           for node in tree.body):
        return
    raise UserError(
        f"{path}, line {lineno}: the flow is called at the top level of the script; the Dask worker processes "
        f"re-import the script and would run the flow again. Put the call under `if __name__ == \"__main__\":`"
    )


def _is_main_guard(node: ast.stmt) -> bool:
    if not isinstance(node, ast.If) or not isinstance(test := node.test, ast.Compare) or len(test.ops) != 1:
        return False
    sides = [test.left, test.comparators[0]]
    return (isinstance(test.ops[0], ast.Eq) and any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))
