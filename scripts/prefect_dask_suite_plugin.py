"""pytest plugin of scripts/prefect-dask-suite, loaded in both of its runs (`-p prefect_dask_suite_plugin`).

- `--hpc-garage`: every DaskTaskRunner that prefect-dask's tests build is made by `hpc_garage.task_runner()`
  instead, which passes their arguments on as prefect-dask documents them. The tests import the name
  `prefect_dask.DaskTaskRunner` after this plugin is configured, so replacing that name is enough; the class
  itself stays (hpc-garage's runner subclasses it).
- always: Prefect's test harness (the suite's session fixture) waits up to 180 s for its server to start,
  not 30 s: on a busy machine the server's start alone timed out, erroring every test of a run.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

HARNESS_STARTUP_TIMEOUT = 180
made: list[str] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--hpc-garage", action="store_true",
                     help="build the tests' DaskTaskRunners with hpc_garage.task_runner()")


def pytest_configure(config: pytest.Config) -> None:
    import prefect.testing.utilities as testing

    harness = testing.prefect_test_harness
    testing.prefect_test_harness = functools.partial(harness, server_startup_timeout=HARNESS_STARTUP_TIMEOUT)
    if not config.getoption("--hpc-garage"):
        return
    import prefect_dask

    import hpc_garage
    from hpc_garage.prefect.task_runner import HpcTaskRunner

    def DaskTaskRunner(**kwargs: Any) -> HpcTaskRunner:  # noqa: N802 - it stands in for the class
        runner = hpc_garage.task_runner(**kwargs)
        made.append(type(runner).__name__)
        return runner

    prefect_dask.DaskTaskRunner = DaskTaskRunner


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if config.getoption("--hpc-garage"):
        terminalreporter.write_line(f"hpc-garage: {len(made)} runners made by hpc_garage.task_runner() "
                                    f"({', '.join(sorted(set(made))) or 'none'})")
