"""schedulers/container.py and the job script: a site's container on disk, in `show --script`, in the launchers."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from hpc_garage.core.errors import SiteError
from hpc_garage.schedulers import container as job_container
from hpc_garage.sites import parse_site_file, with_container


def _site(tmp_path: Path, container: str, gpus: int = 2) -> Path:
    path = tmp_path / "c.yaml"
    per = "gpu" if gpus else "node"
    path.write_text(f"scheduler: slurm\nnode: {{cores: 4, memory: 8GiB, gpus: {gpus}}}\nworkers: {{per: {per}}}\n"
                    f"run_directory: {tmp_path}/runs\ncontainer: {container}\n")
    return path


def test_a_missing_image_path_and_a_missing_bind_are_refused_naming_file_and_key(tmp_path):
    with pytest.raises(SiteError, match=r"c\.yaml: container\.image: '/no/such\.sif' does not exist"):
        parse_site_file(_site(tmp_path, "{runtime: apptainer, image: /no/such.sif}"))
    with pytest.raises(SiteError, match=r"c\.yaml: container\.binds: '/no/such/dir' does not exist"):
        parse_site_file(_site(tmp_path, f"{{runtime: apptainer, image: {tmp_path}, binds: [/no/such/dir]}}"))
    site = parse_site_file(_site(tmp_path, "{runtime: podman, image: localhost/garage}"))  # a reference: not a path
    assert site.container is not None and site.container.image == "localhost/garage"


def test_the_container_flag_replaces_the_image_and_is_checked(tmp_path):
    site = parse_site_file(_site(tmp_path, f"{{runtime: apptainer, image: {tmp_path}}}"))
    other = tmp_path / "other.sif"
    other.write_text("")
    moved = with_container(site, str(other))
    assert moved.container is not None and moved.container.image == str(other)
    assert moved.container.runtime == "apptainer" and moved.raw["container"]["image"] == str(other)
    with pytest.raises(SiteError, match="--container: container.image: '/gone.sif' does not exist"):
        with_container(site, "/gone.sif")


def test_the_job_script_shows_the_exact_entry_line_and_runs_command_with_the_images_python(tmp_path, monkeypatch):
    from hpc_garage.core.request import Request
    from hpc_garage.schedulers.submission import prepare

    image = tmp_path / "img"
    image.mkdir()
    monkeypatch.setenv("HOME", str(tmp_path))
    path = _site(tmp_path, f"{{runtime: apptainer, image: {image}, python: /opt/py/bin/python, env: {{K: v w}}}}")
    script = tmp_path / "sweep.py"
    script.write_text("")
    prepared = prepare(str(path), str(script), request=Request(container=str(image)), cwd=str(tmp_path))
    text = prepared.script
    line = next(l for l in text.splitlines() if l.startswith("#   apptainer"))
    argv = shlex.split(line[4:])
    assert argv[:3] == ["apptainer", "exec", "--nv"]
    assert f"{tmp_path}:{tmp_path}" in argv and ["--env", "K=v w"] == argv[argv.index("--env"):argv.index("--env") + 2]
    assert argv[argv.index(str(image)) + 1:] == ["/opt/py/bin/python", "-m", "hpc_garage", "run", "..."]
    last = text.rstrip().splitlines()[-1]
    assert f"--container {image} -- /opt/py/bin/python {script}" in last


def test_launchers_start_node_processes_inside_the_image(tmp_path, monkeypatch):
    image = tmp_path / "img"
    image.mkdir()
    site = parse_site_file(_site(tmp_path, f"{{runtime: charliecloud, image: {image}, gpus: none}}"))
    monkeypatch.setenv(job_container.CONTAINER_ENV, "charliecloud")  # handed down by `run`: no PATH lookup
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    argv = job_container.python_argv(site)
    assert argv[0] == "ch-run" and argv[-3:] == [str(image), "--", "python3"]
    assert f"--bind={tmp_path}:{tmp_path}" in argv  # the site's folder, which holds its run directory too


def test_a_runtime_missing_here_is_named(tmp_path, monkeypatch):
    image = tmp_path / "img"
    image.mkdir()
    site = parse_site_file(_site(tmp_path, f"{{runtime: apptainer, image: {image}}}"))
    monkeypatch.delenv(job_container.CONTAINER_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(Exception, match="container.runtime: apptainer, but `apptainer` is not on PATH here"):
        job_container.resolve_runtime(site)
    auto = with_container(parse_site_file(_site(tmp_path, f"{{image: {image}}}", gpus=0)), str(image))
    with pytest.raises(Exception, match="container.runtime: auto, but none of apptainer, singularity, podman, ch-run"):
        job_container.resolve_runtime(auto)
