"""The run root and the run directory (hpc_garage/rundir.py): one owner of where runs live and of how a job's
directory is named in it (`<run root>/<job id>/`), one owner of every name in that directory, of what a new job
clears and a requeue keeps, and of its JSON."""

from __future__ import annotations

import ast
import json
import os
import re
import stat
import time
from pathlib import Path

import pytest

import hpc_garage
from hpc_garage import rundir as rundir_module
from hpc_garage.cluster.handoff import Handoff
from hpc_garage.core.errors import UserError
from hpc_garage.files import read_json
from hpc_garage.rundir import (CLOCK_SLACK, EARLIER_RUN, HANDOFF, RunDir, RunRoot, first_run_dir, newest_submitted,
                                note_flow_run)
from hpc_garage.variables import RUN_DIR_ENV

PACKAGE = Path(hpc_garage.__file__).parent


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# ------------------------------------------------------------------------------------------- the names


def test_every_path_in_a_run_directory_comes_from_the_run_dir(tmp_path: Path) -> None:
    rundir = RunDir(tmp_path)
    paths = {
        rundir.submit_file: "submit.json", rundir.script_file: "job.sh", rundir.state_file: "state.json",
        rundir.scheduler_file: "scheduler.json", rundir.dask_scheduler_file: "dask-scheduler.json",
        rundir.ranks_file: "ranks.json", rundir.rank_records: "dask-mpi-ranks", rundir.tls_dir: "tls",
        rundir.worker_file("gpu"): "jobqueue-gpu.json", rundir.worker_jobs_file: "worker-jobs.json",
        rundir.worker_logs: "worker-logs", rundir.worker_log("hpcg-gpu-7", "12"): "worker-logs/hpcg-gpu-7-12.out",
        rundir.flow_runs_file: "flow-runs", rundir.report_file: "report.json",
        rundir.unrecorded_file: "unrecorded.json", rundir.unrecorded_dir: "unrecorded",
        rundir.kept_flow_states_file: "unrecorded/flow-runs.json", rundir.replayed_file: "unrecorded/replayed.json",
        rundir.kept_file("events", "h-1"): "unrecorded/events-h-1.jsonl",
    }
    assert {str(p.relative_to(tmp_path)): name for p, name in paths.items()} == {n: n for n in paths.values()}
    assert set(rundir.credential_paths().values()) == {str(tmp_path / "tls" / "cert.pem"),
                                                      str(tmp_path / "tls" / "key.pem")}
    assert RunRoot(tmp_path).run_dir("42").path == tmp_path / "42"


# ------------------------------------------------------------------------------------------ the run root


def test_a_run_root_expands_home_and_variables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("SCRATCH", "/scratch/me")
    assert RunRoot.of("~/.hpc-garage/runs").path == tmp_path / ".hpc-garage" / "runs"
    assert RunRoot.of("$SCRATCH/runs").path == Path("/scratch/me/runs")
    assert RunRoot.default() == RunRoot(tmp_path / ".hpc-garage" / "runs")  # a site that names none


def test_a_run_root_names_each_jobs_run_directory_and_nothing_else(tmp_path: Path) -> None:
    root = RunRoot(tmp_path)
    rundir = root.run_dir("42")
    assert rundir == RunDir(tmp_path / "42") and rundir.job_id == "42" and rundir.root == root
    assert rundir.root.run_dir("43").path == tmp_path / "43"  # a follow-up, another job of its sweep
    for bad in ("", ".", "..", "../42", "a/b", "4\0"):
        with pytest.raises(ValueError, match="is not a job id"):
            root.run_dir(bad)


def test_a_run_root_lists_the_jobs_submitted_from_it_and_nothing_beside_them(tmp_path: Path) -> None:
    """Beside the jobs' directories: the default results root, the work pool's claims, a `run` on a login
    node (no submit.json), a directory whose record is another job's (copied by hand): none is a job here."""
    root = RunRoot(tmp_path)
    assert list(RunRoot(tmp_path / "missing").jobs()) == [] and root.submitted("42") is None
    for job_id, record_id in (("42", "42"), ("43", "43"), ("44", "7")):
        root.run_dir(job_id).path.mkdir()
        root.run_dir(job_id).write_submit_record({"job_id": record_id, "submitted": 1.0})
    for other in ("sweeps", "prefect-flow-runs", "45"):
        (tmp_path / other).mkdir()
    assert sorted(rundir.job_id for rundir, _ in root.jobs()) == ["42", "43"]
    assert root.submitted("44") is None and root.submitted("45") is None
    assert root.submitted("42") == (root.run_dir("42"), {"job_id": "42", "submitted": 1.0})


def test_a_job_is_found_across_run_roots(tmp_path: Path) -> None:
    """Sites may name different run roots: a job is the newest submission of its id in any of them (a
    recycled id), and a run hpc-garage did not submit is the first directory of its id (holding a file)."""
    first, second = RunRoot(tmp_path / "a"), RunRoot(tmp_path / "b")
    for root, submitted in ((first, 1.0), (second, 2.0)):
        root.run_dir("42").path.mkdir(parents=True)
        root.run_dir("42").write_submit_record({"job_id": "42", "submitted": submitted})
    found = newest_submitted("42", [first, second])
    assert found is not None and found[0] == second.run_dir("42")
    assert newest_submitted("42", [first]) == (first.run_dir("42"), {"job_id": "42", "submitted": 1.0})
    assert newest_submitted("43", [first, second]) is None
    second.run_dir("9").path.mkdir()
    second.run_dir("9").write_state({"phase": "running"})
    assert first_run_dir("9", [first, second]) == second.run_dir("9")
    assert first_run_dir("42", [first, second], holding="state.json") is None
    assert first_run_dir("42", [first, second]) == first.run_dir("42")


_JOB = re.compile(r"job_?id|next_job|RUN_ID")  # what names a job's id in hpc-garage's source


def _joins_a_root_and_a_job(source: str) -> list[str]:
    """Where `source` makes a job's run directory itself: a path joined with a job id, a RunDir built from a
    joined path, or the parent of a run directory (its run root) taken by hand."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and _JOB.search(ast.unparse(node.right)):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("RunDir") and any(
                isinstance(arg, ast.BinOp) and isinstance(arg.op, ast.Div) for arg in node.args):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute) and node.attr == "parent" and re.search(r"run_?dir",
                                                                                       ast.unparse(node.value)):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_check_finds_a_run_directory_made_by_hand() -> None:
    spelled = ("a = root / job_id\nb = root / view.job_id\nc = view.run_dir.parent / check_job_id(next_job)\n"
               "d = RunDir(root / name)\ne = rundir.path.parent\nf = RunDir(root / 'RUN_ID')\n")
    assert {int(line.split(":")[0]) for line in _joins_a_root_and_a_job(spelled)} == {1, 2, 3, 4, 5, 6}
    assert _joins_a_root_and_a_job("a = RunRoot(root).run_dir(job_id)\nb = claims / f'{job.flow_run_id}.json'\n"
                                   "c = rundir.root.run_dir(next_job)\nd = run_root / '%j.out'\n") == []


def test_no_other_module_joins_a_run_root_and_a_job_id() -> None:
    """`<run root>/<job id>` is spelled in rundir.py alone (RunRoot): a module that joins them again fails
    here, naming file and line."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "rundir.py" and path.parent == PACKAGE:
            continue
        found += [f"{path.relative_to(PACKAGE.parent)}:{hit}" for hit in _joins_a_root_and_a_job(path.read_text())]
    assert not found, "a run directory made outside hpc_garage/rundir.py (use RunRoot):\n" + "\n".join(found)


def test_no_other_module_spells_a_name_in_the_run_directory() -> None:
    """Each name (as a whole string) appears in rundir.py alone: a module that spells one again fails here,
    naming file and line. ("tls" is left out: it is also the protocol's name; "metrics" too: it is also the key
    under which progress and report.json keep what the trials reported, cluster/trial_metrics.py.)"""
    source = ast.parse(Path(rundir_module.__file__).read_text())
    names = {node.value.value for node in source.body if isinstance(node, ast.Assign)
             and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
             and node.targets[0].id not in ("TLS_DIR", "METRICS_DIR")}  # type: ignore[attr-defined]
    assert {"submit.json", "state.json", "flow-runs", "jobqueue-", "replayed.json"} <= names
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "rundir.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.value!r}")
    assert not found, "spelled outside hpc_garage/rundir.py:\n" + "\n".join(found)


def test_the_run_directory_of_this_run_comes_from_its_variable(tmp_path: Path) -> None:
    assert RunDir.of_this_run({RUN_DIR_ENV: str(tmp_path)}) == RunDir(tmp_path)
    assert RunDir.of_this_run({}) is None
    assert RunDir.of_this_run({RUN_DIR_ENV: ""}) is None


# ----------------------------------------------------------------------------- what a new job clears


def test_run_clears_what_an_earlier_job_left_in_its_run_directory(tmp_path: Path) -> None:
    """A recycled job id: a corrupt scheduler file, one that is a directory, old credentials are cleared, so
    the new run's COMMAND never reads them."""
    rundir = RunRoot(tmp_path).run_dir("42")
    rundir.path.mkdir()
    (rundir.path / "scheduler.json").mkdir()
    (rundir.path / "dask-scheduler.json").write_text('{"address": ')
    (rundir.path / "tls").mkdir()
    (rundir.path / "tls" / "key.pem").write_text("old")
    (rundir.path / "submit.json").write_text("{}")  # the job's own record stays
    rundir.request_cancel()  # an earlier start's cancel: this start is not being cancelled
    assert rundir.cancel_requested() and _mode(rundir.path / "cancel-requested") == 0o600
    rundir.create()
    assert sorted(p.name for p in rundir.path.iterdir()) == ["submit.json"] and not rundir.cancel_requested()


def test_a_recycled_job_id_starts_with_nothing_the_earlier_job_ran(tmp_path: Path) -> None:
    """The flow runs the earlier job noted, what it kept for replay, its report, what its trials reported, its
    search's summary, its doctor's findings and its workers' logs are cleared when they predate this job's
    submission (CI once showed an earlier job's 32 pruned trials in the report of a job whose trials reported
    nothing); a requeued job (the same submission) keeps its first start's, for replay."""
    rundir = RunRoot(tmp_path).run_dir("42")
    rundir.path.mkdir()

    def earlier_jobs_files() -> list[str]:
        rundir.flow_runs_file.write_text("1f0c\n")
        rundir.unrecorded_file.write_text("{}")
        rundir.unrecorded_dir.mkdir(exist_ok=True)
        rundir.kept_file("events", "h-1").write_text("{}\n")
        rundir.report_file.write_text("{}")
        rundir.metrics_dir.mkdir(exist_ok=True)
        rundir.metrics_summary.write_text('{"trials": {}}')
        rundir.trial_metrics("train-1").write_text("{}\n")
        rundir.search_summary.write_text("{}")
        rundir.doctor_file.write_text("{}")
        rundir.worker_logs.mkdir(exist_ok=True)
        rundir.worker_log("w", "7").write_text("earlier\n")
        return sorted(p.name for p in rundir.path.iterdir())

    written = earlier_jobs_files()
    assert set(written) == set(EARLIER_RUN)
    rundir.create(submitted=time.time() - 3600)  # submitted before they were written: this job's own (requeued)
    assert sorted(p.name for p in rundir.path.iterdir()) == written
    assert rundir.worker_log("w", "7").read_text() == "earlier\n"
    rundir.create(submitted=time.time() + 10)  # submitted after: an earlier job's
    assert list(rundir.path.iterdir()) == []
    earlier_jobs_files()
    rundir.create(submitted=None)  # a run hpc-garage did not submit: nothing tells, nothing is removed
    assert sorted(p.name for p in rundir.path.iterdir()) == written


def test_a_requeue_keeps_the_jobs_own_records_and_clears_only_the_handoff(tmp_path: Path) -> None:
    """The same job started again (requeued after a node failure): its submission is older than what its
    first start wrote, so its records stay for replay; the first start's cluster does not."""
    rundir = RunRoot(tmp_path).run_dir("42")
    rundir.path.mkdir()
    rundir.write_submit_record({"job_id": "42", "submitted": time.time()})
    rundir.script_file.write_text("#!/bin/sh\n")
    for name in HANDOFF:
        (rundir.path / name).write_text("first start's")
    note_flow_run("1f0c", {RUN_DIR_ENV: str(rundir.path)})
    rundir.unrecorded_dir.mkdir()
    rundir.kept_file("events", "h-1").write_text("{}\n")
    rundir.write_state({"phase": "running"})
    rundir.create(rundir.submitted_at())
    assert sorted(p.name for p in rundir.path.iterdir()) == sorted(
        ["submit.json", "job.sh", "flow-runs", "unrecorded", "state.json"])
    assert rundir.flow_runs() == ["1f0c"]


def test_the_end_of_a_run_removes_its_cluster_and_keeps_its_records(tmp_path: Path) -> None:
    """One list for the start and the end: the handoff (address, keys, rank file) goes, the rest stays."""
    rundir = RunDir(tmp_path / "42").create()
    rundir.write_credentials()
    rundir.dask_scheduler_file.write_text("{}")
    rundir.ranks_file.write_text("{}")
    rundir.publish(_handoff("42"))
    kept = [rundir.state_file, rundir.report_file, rundir.flow_runs_file, rundir.submit_file, rundir.unrecorded_file]
    for path in kept:
        path.write_text("{}")
    rundir.clear_handoff()
    assert sorted(rundir.path.iterdir()) == sorted(kept)
    assert set(HANDOFF) == {"scheduler.json", "dask-scheduler.json", "tls", "ranks.json"}
    assert not set(HANDOFF) & set(EARLIER_RUN)


# ------------------------------------------------------------------------------------------ private


def test_the_directory_and_its_files_are_private(tmp_path: Path) -> None:
    loose = tmp_path / "42"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    rundir = RunDir(loose).create()
    assert _mode(rundir.path) == 0o700
    rundir.write_credentials()
    assert _mode(rundir.tls_dir) == 0o700
    assert {_mode(Path(p)) for p in rundir.credential_paths().values()} == {0o600}
    rundir.write_state({"phase": "starting"})
    rundir.write_submit_record({"job_id": "42"})
    rundir.publish(_handoff("42"))
    note_flow_run("1f0c", {RUN_DIR_ENV: str(rundir.path)})
    for path in (rundir.state_file, rundir.submit_file, rundir.scheduler_file, rundir.flow_runs_file):
        assert _mode(path) == 0o600, path


# --------------------------------------------------------------------------------------------- JSON


def test_json_round_trips(tmp_path: Path) -> None:
    rundir = RunDir(tmp_path / "42").create()
    state = {"phase": "running", "workers": 3, "progress": {"done": 2}}
    rundir.write_state(state)
    assert rundir.state() == state
    submitted = time.time()
    rundir.write_submit_record({"job_id": "42", "submitted": submitted})
    assert rundir.submit_record() == {"job_id": "42", "submitted": submitted}
    assert rundir.submitted_at() == pytest.approx(submitted - CLOCK_SLACK)
    path = rundir.publish(_handoff("42"))
    back = Handoff.read(path, expect_job="42")
    assert (back.address, back.job_id, back.workers) == ("tcp://127.0.0.1:8786", "42", ["w0"])
    assert json.loads(path.read_text())["address"] == "tcp://127.0.0.1:8786"  # Dask's scheduler-file format


def test_flow_runs_are_noted_once_each_and_only_under_run(tmp_path: Path) -> None:
    rundir = RunDir(tmp_path / "42").create()
    assert rundir.flow_runs() == []
    for flow_run in ("a", "b", "a"):
        note_flow_run(flow_run, {RUN_DIR_ENV: str(rundir.path)})
    assert rundir.flow_runs() == ["a", "b"]
    note_flow_run("c", {})  # not under `run`: nowhere to note it, and no error
    assert rundir.flow_runs() == ["a", "b"]


def test_kept_records_are_listed_by_kind(tmp_path: Path) -> None:
    rundir = RunDir(tmp_path).create()
    rundir.unrecorded_dir.mkdir()
    for kind, process in (("logs", "h-2"), ("events", "h-1")):
        rundir.kept_file(kind, process).write_text("{}\n")
    rundir.kept_flow_states_file.write_text("{}")  # not a kept record: states are read by name
    assert [(kind, p.name) for kind, p in rundir.kept_files()] == [("events", "events-h-1.jsonl"),
                                                                  ("logs", "logs-h-2.jsonl")]


@pytest.mark.parametrize("text", ['{"phase": ', "[1, 2]", "\udcff", ""])
def test_a_broken_json_file_is_read_as_none(tmp_path: Path, text: str) -> None:
    """Half-written (its writer killed), not an object, not text, empty: none of it is a record."""
    rundir = RunDir(tmp_path / "42").create()
    for path in (rundir.state_file, rundir.submit_file):
        path.write_bytes(text.encode(errors="surrogateescape"))
    assert rundir.state() is None and rundir.submit_record() is None and rundir.submitted_at() is None
    assert read_json(tmp_path / "missing.json") is None
    assert read_json(rundir.path) is None  # a directory


def test_a_broken_json_file_that_matters_is_refused_in_one_line(tmp_path: Path) -> None:
    """`hpc-garage replay` reads what the flow kept: a broken file there is named, not skipped."""
    path = RunDir(tmp_path).unrecorded_file
    path.write_text('{"events_kept": ')
    with pytest.raises(UserError) as refused:
        read_json(path, broken="it was written by the job's flow")
    message = str(refused.value)
    assert message.startswith(f"{path} cannot be read (") and "written by the job's flow" in message
    assert "\n" not in message
    assert read_json(tmp_path / "missing.json", broken="never said") is None  # missing is not broken


def test_a_broken_submit_record_clears_nothing_of_the_jobs_records(tmp_path: Path) -> None:
    """Without a readable submission time nothing tells an earlier job's records from this one's: kept."""
    rundir = RunDir(tmp_path / "42").create()
    rundir.submit_file.write_text('{"submitted": ')
    note_flow_run("1f0c", {RUN_DIR_ENV: str(rundir.path)})
    rundir.create(rundir.submitted_at())
    assert rundir.flow_runs() == ["1f0c"]


def _handoff(job_id: str) -> Handoff:
    return Handoff(address="tcp://127.0.0.1:8786", job_id=job_id, workers=["w0"])
