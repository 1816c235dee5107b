"""files.py: private files written whole (0600, atomic), JSON read back or refused in one line, lines appended
whole, a lock, a writer's pid; the I/O every layer above the core shares."""

from __future__ import annotations

import multiprocessing
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hpc_garage.core.errors import UserError
from hpc_garage.files import (append_private, locked, pid_alive, read_json, read_secrets, write_json,
                              write_private)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_private_file_is_the_owners_alone_and_replaced_whole(tmp_path: Path) -> None:
    path = tmp_path / "scheduler.json"
    old_umask = os.umask(0)  # even where the umask would let others read
    try:
        write_private(path, "first")
        write_private(path, "second")
    finally:
        os.umask(old_umask)
    assert path.read_text() == "second" and mode(path) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["scheduler.json"]  # no temporary file left beside it


def test_json_round_trips_and_what_is_not_an_object_reads_as_none(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_json(path, {"phase": "running", "workers": 4}, indent=1)
    assert read_json(path) == {"phase": "running", "workers": 4} and mode(path) == 0o600
    assert "\n" in path.read_text()  # indent=1: one key a line
    path.write_text("[1, 2]")
    assert read_json(path) is None
    path.write_text('{"phase": ')  # its writer still at it, or killed
    assert read_json(path) is None and read_json(tmp_path / "missing.json") is None


def test_a_broken_file_that_matters_is_one_line_with_the_hint(tmp_path: Path) -> None:
    path = tmp_path / "submit.json"
    path.write_text("{not json")
    with pytest.raises(UserError) as refused:
        read_json(path, broken="it was written by `submit`; submit the job again")
    message = str(refused.value)
    assert message.startswith(f"{path} cannot be read (") and message.endswith("; submit the job again")
    assert "\n" not in message
    assert read_json(tmp_path / "missing.json", broken="never said") is None  # missing is not broken


def _append(path: str, tag: str) -> None:
    for i in range(200):
        append_private(Path(path), [f"{tag}-{i}-" + "x" * 200, f"{tag}-{i}-end"])


def test_appended_lines_of_several_processes_do_not_interleave(tmp_path: Path) -> None:
    path = tmp_path / "flow-runs"
    append_private(path, [])
    assert not path.exists()  # nothing to say: no file
    procs = [multiprocessing.get_context("fork").Process(target=_append, args=(str(path), t)) for t in "ab"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    lines = path.read_text().splitlines()
    assert len(lines) == 800 and mode(path) == 0o600
    for first, second in zip(lines[::2], lines[1::2]):  # each call's two lines stay together, whole
        assert first == "-".join(first.split("-")[:2]) + "-" + "x" * 200
        assert second == "-".join(first.split("-")[:2]) + "-end"


def test_the_lock_is_exclusive_across_threads(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    inside: list[int] = []
    overlap: list[bool] = []

    def hold(n: int) -> None:
        with locked(lock):
            inside.append(n)
            overlap.append(len(inside) > 1)
            time.sleep(0.02)
            inside.remove(n)

    threads = [threading.Thread(target=hold, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert overlap == [False] * 4 and mode(lock) == 0o600


def test_a_pid_is_alive_until_its_process_ends() -> None:
    assert pid_alive(os.getpid())
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert not pid_alive(int(done.stdout))
    assert pid_alive(1)  # someone else's (init): alive, though we may not signal it



def test_secrets_are_read_only_from_a_private_file_of_names_and_values(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    write_json(path, {"PREFECT_API_AUTH_STRING": "u:p"})
    assert read_secrets(str(path), "VAR") == {"PREFECT_API_AUTH_STRING": "u:p"}
    for prepare, words in ((lambda: path.chmod(0o640), "mode 640"),
                           (lambda: (path.chmod(0o600), path.write_text('{"A": 1}')), "not a JSON object of"),
                           (lambda: path.write_text("{"), "cannot be read"),
                           (lambda: path.unlink(), "no such file")):
        prepare()
        with pytest.raises(UserError, match=f"^VAR={path}") as caught:
            read_secrets(str(path), "VAR")
        assert words in str(caught.value) and "\n" not in str(caught.value)
