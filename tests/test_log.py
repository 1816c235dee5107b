"""hpc-garage's messages (hpc_garage/log.py): the `hpc-garage: ...` line, set up once per process, on stderr
as it is when a line is written; standard logging silences or redirects them, and a user's own
configuration of the `hpc_garage` logger wins."""

from __future__ import annotations

import logging
import logging.config
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpc_garage import log

PY = sys.executable


@pytest.fixture(autouse=True)
def fresh_logger() -> Iterator[logging.Logger]:
    """The `hpc_garage` logger as a process that has not set it up has it; put back afterwards."""
    logger = logging.getLogger(log.ROOT)
    saved = logger.handlers[:], logger.level, logger.propagate, logger.disabled
    logger.handlers[:] = []
    logger.setLevel(logging.NOTSET)
    logger.propagate, logger.disabled = True, False
    yield logger
    logger.handlers[:], logger.level, logger.propagate, logger.disabled = saved[0], saved[1], saved[2], saved[3]


def record(level: int, message: str, name: str = "hpc_garage.cluster.run") -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, message, None, None)


def test_the_line_says_hpc_garage_and_the_level_word_only_for_warnings_and_errors() -> None:
    line = log.LineFormatter()
    assert line.format(record(logging.INFO, "4 workers registered in 2.0 s")) == \
        "hpc-garage: 4 workers registered in 2.0 s"
    assert line.format(record(logging.WARNING, "the driver job's end is unknown")) == \
        "hpc-garage: warning: the driver job's end is unknown"
    assert line.format(record(logging.ERROR, "3 worker jobs failed")) == "hpc-garage: error: 3 worker jobs failed"
    assert line.format(record(logging.CRITICAL, "x")) == "hpc-garage: error: x"
    kept = log.LineFormatter("hpc-garage server keeper", clock=True).format(record(logging.INFO, "stopping"))
    assert re.fullmatch(r"hpc-garage server keeper \[\d\d:\d\d:\d\d\]: stopping", kept), kept


def test_a_logged_traceback_follows_the_line() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        rec = logging.LogRecord("hpc_garage.x", logging.WARNING, __file__, 1, "scaling step failed: %s", ("boom",),
                                sys.exc_info())
    text = log.LineFormatter().format(rec)
    assert text.startswith("hpc-garage: warning: scaling step failed: boom\nTraceback") and "RuntimeError: boom" in text


def test_setup_is_idempotent_and_module_loggers_write_the_line_to_stderr(
        fresh_logger: logging.Logger, capsys: pytest.CaptureFixture[str]) -> None:
    assert log.setup() is fresh_logger and log.setup() is fresh_logger
    assert len(fresh_logger.handlers) == 1 and fresh_logger.level == logging.INFO and not fresh_logger.propagate
    logging.getLogger("hpc_garage.cluster.node_loss").info("node 1 (node2) lost at 12:00:00: gone")
    logging.getLogger("hpc_garage.launchers.jobqueue.launcher").debug("not shown at INFO")
    captured = capsys.readouterr()  # the handler looks sys.stderr up per line: the capture gets it
    assert captured.err == "hpc-garage: node 1 (node2) lost at 12:00:00: gone\n" and captured.out == ""


def test_the_keepers_lines_go_to_stdout_with_a_clock(capsys: pytest.CaptureFixture[str]) -> None:
    log.setup(label="hpc-garage server keeper", clock=True, stream="stdout")
    logging.getLogger("hpc_garage.prefect.server").info("stopping")
    captured = capsys.readouterr()
    assert re.fullmatch(r"hpc-garage server keeper \[\d\d:\d\d:\d\d\]: stopping\n", captured.out) and not captured.err


def test_a_user_silences_them_with_the_loggers_level(fresh_logger: logging.Logger,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    log.setup()
    logging.getLogger("hpc_garage").setLevel(logging.ERROR)
    logging.getLogger("hpc_garage.cluster.wind_down").info("walltime: 25 s left: winding down")
    logging.getLogger("hpc_garage.launchers.jobqueue.launcher").warning("a worker job failed")
    logging.getLogger("hpc_garage.launchers.jobqueue.launcher").error("no more worker jobs")
    assert capsys.readouterr().err == "hpc-garage: error: no more worker jobs\n"


def test_a_level_set_before_setup_is_kept(fresh_logger: logging.Logger, capsys: pytest.CaptureFixture[str]) -> None:
    fresh_logger.setLevel(logging.WARNING)
    log.setup()
    assert fresh_logger.level == logging.WARNING
    logging.getLogger("hpc_garage.cluster.run").info("sweep x@1")
    assert capsys.readouterr().err == ""


def test_a_user_redirects_them_to_a_file(fresh_logger: logging.Logger, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    log.setup()
    to_file = logging.FileHandler(tmp_path / "hpc-garage.log")
    to_file.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger("hpc_garage").handlers[:] = [to_file]  # what the README shows
    logging.getLogger("hpc_garage.cluster.node_loss").warning("node 1 lost")
    log.setup()  # an entry point later in the same process leaves the user's handler alone
    logging.getLogger("hpc_garage.cluster.run").info("report: 8 trials")
    to_file.close()
    assert (tmp_path / "hpc-garage.log").read_text().splitlines() == [
        "WARNING hpc_garage.cluster.node_loss: node 1 lost", "INFO hpc_garage.cluster.run: report: 8 trials"]
    assert capsys.readouterr().err == ""


def test_a_users_own_configuration_wins(fresh_logger: logging.Logger, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "mine.log"
    logging.config.dictConfig({
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"mine": {"format": "[mine] %(message)s"}},
        "handlers": {"file": {"class": "logging.FileHandler", "filename": str(path), "formatter": "mine"}},
        "loggers": {"hpc_garage": {"level": "WARNING", "handlers": ["file"], "propagate": False}},
    })
    mine = fresh_logger.handlers[:]
    log.setup()
    assert fresh_logger.handlers == mine and fresh_logger.level == logging.WARNING
    logging.getLogger("hpc_garage.prefect.outage").info("not wanted at WARNING")
    logging.getLogger("hpc_garage.prefect.outage").warning("Prefect's API does not answer")
    for handler in mine:
        handler.close()
    assert path.read_text() == "[mine] Prefect's API does not answer\n" and capsys.readouterr().err == ""


def test_a_root_handler_does_not_print_them_a_second_time(fresh_logger: logging.Logger,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Prefect configures a console handler on the root logger in every flow process."""
    root = logging.getLogger()
    console = logging.StreamHandler(sys.stderr)
    root.addHandler(console)
    try:
        log.setup()
        logging.getLogger("hpc_garage.prefect.outage").warning("kept")
    finally:
        root.removeHandler(console)
    assert capsys.readouterr().err == "hpc-garage: warning: kept\n"


CHILDREN = '''
import logging
import multiprocessing
import sys

from hpc_garage.launchers.common import run_entry


def forkserver_child() -> None:
    """A Dask worker forked from the node's forkserver: its first Prefect task sets the line up."""
    from hpc_garage.prefect.fast import trust_no_tag_limits_longer

    trust_no_tag_limits_longer()
    logging.getLogger("hpc_garage.prefect.fast").info("from a forkserver child")


def forked_child() -> None:
    logging.getLogger("hpc_garage.cluster.node_loss").info("from a forked child")


def main() -> int:
    logging.getLogger("hpc_garage.launchers.mpi").info("from the entry point")
    for method, target in (("fork", forked_child), ("forkserver", forkserver_child)):
        child = multiprocessing.get_context(method).Process(target=target)
        child.start()
        child.join()
        sys.stderr.flush()
    from hpc_garage.core.errors import UserError

    raise UserError("a bad value; fix it")


if __name__ == "__main__":
    run_entry(main)
'''


def test_an_entry_point_and_its_forked_and_forkserver_children_write_the_line(tmp_path: Path) -> None:
    """`run_entry` (node, rank and worker-job processes) sets the line up; a forked child inherits it, and a
    forkserver's child (a Dask worker) sets it up at its first task."""
    script = tmp_path / "children.py"
    script.write_text(textwrap.dedent(CHILDREN))
    done = subprocess.run([PY, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("hpc-garage")]
    assert lines == ["hpc-garage: from the entry point", "hpc-garage: from a forked child",
                     "hpc-garage: from a forkserver child", "hpc-garage: error: a bad value; fix it"], done.stderr
