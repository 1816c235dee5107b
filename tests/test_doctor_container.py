"""doctor/container.py: the runtime, the image and hpc-garage's version inside it, each named in one line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from hpc_garage._version import __version__
from hpc_garage.doctor.checks import guarded
from hpc_garage.doctor.container import container_check
from hpc_garage.sites import parse_site_file


def _site(tmp_path: Path, container: str) -> object:
    path = tmp_path / "c.yaml"
    path.write_text(f"scheduler: local\nnode: {{cores: 2, memory: 4GiB}}\nrun_directory: {tmp_path}/runs\n"
                    f"container: {container}\n")
    return parse_site_file(path)


def _answer(stdout: str = "", stderr: str = "", code: int = 0, calls: list | None = None):
    def run(argv, **kwargs):
        if calls is not None:
            calls.append(argv)
        return subprocess.CompletedProcess(argv, code, stdout, stderr)
    return run


def _env(tmp_path: Path, path_dir: Path) -> dict[str, str]:
    return {"PATH": str(path_dir), "HOME": str(tmp_path)}


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "bin"
    folder.mkdir()
    for tool in ("ch-run", "podman"):
        (folder / tool).write_text("#!/bin/sh\n")
        (folder / tool).chmod(0o755)
    return folder


def test_a_missing_runtime_is_named(tmp_path, monkeypatch):
    site = _site(tmp_path, f"{{runtime: apptainer, image: {tmp_path}}}")
    monkeypatch.setenv("PATH", str(tmp_path))
    check = guarded("container", lambda: container_check(site, _env(tmp_path, tmp_path), _answer()))
    assert check is not None and check.failed
    assert "container.runtime: apptainer, but `apptainer` is not on PATH here" in check.line()


def test_a_missing_podman_image_is_named(tmp_path, monkeypatch, bin_dir):
    site = _site(tmp_path, "{runtime: podman, image: localhost/garage:1}")
    monkeypatch.setenv("PATH", str(bin_dir))
    check = container_check(site, _env(tmp_path, bin_dir), _answer(code=1))
    assert check is not None and check.failed and "podman has no image 'localhost/garage:1' here" in check.line()


def test_a_version_mismatch_is_one_line_naming_both(tmp_path, monkeypatch, bin_dir):
    site = _site(tmp_path, f"{{runtime: charliecloud, image: {tmp_path}}}")
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.chdir(tmp_path)  # a directory image binds only onto what it has; under /tmp, the host's
    calls: list = []
    found = json.dumps({"hpc-garage": "0.0.1", "prefect": "3.0.0", "distributed": "2024.1.0"})
    check = container_check(site, _env(tmp_path, bin_dir), _answer(found + "\n", calls=calls))
    assert check is not None and check.failed
    assert f"has hpc-garage 0.0.1, and this one is {__version__}" in check.line() and "\n" not in check.line()
    assert calls[0][0] == "ch-run" and calls[0][calls[0].index("--") + 1:][:2] == ["python3", "-c"]


def test_an_image_without_hpc_garage_and_the_same_version(tmp_path, monkeypatch, bin_dir):
    site = _site(tmp_path, f"{{runtime: charliecloud, image: {tmp_path}}}")
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.chdir(tmp_path)  # a directory image binds only onto what it has; under /tmp, the host's
    bad = container_check(site, _env(tmp_path, bin_dir),
                          _answer(stderr="ModuleNotFoundError: No module named 'hpc_garage'", code=1))
    assert bad is not None and bad.failed and "has no hpc-garage" in bad.line()
    same = json.dumps({"hpc-garage": __version__, "prefect": "3", "distributed": "2"})
    good = container_check(site, _env(tmp_path, bin_dir), _answer(same))
    assert good is not None and not good.failed and f"hpc-garage {__version__} inside, as here" in good.line()
